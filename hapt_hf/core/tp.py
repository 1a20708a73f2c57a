"""Tensor parallelism inside a replica: which degrees a model allows, written once.

A replica of a stage is held by ``t`` ranks together (its ``ranks`` in plan.json). They shard
the transformer blocks' projections the model's own tensor-parallel plan names (transformers'
``config.base_model_tp_plan``: attention heads and the MLP width split ``t`` ways, column-wise
in, row-wise out); the embedding, the final norm and the LM head stay whole on each of them.
So ``t`` must divide the attention heads, the key/value heads and the MLP width. The planner
(which reads sizes from its model description) and the runtime (which reads the transformers
config) both ask :func:`tp_refusal`.
"""
from __future__ import annotations

__all__ = ["TP_DEGREES", "TP_STYLES", "tp_refusal", "block_entries", "tp_plan_problem"]

TP_DEGREES = (1, 2, 4, 8)
"""The tensor-parallel degrees the planner searches (a replica's ranks inside one node)."""


TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
"""The styles of ``config.base_model_tp_plan`` a replica shards a block by: ``colwise`` and
``rowwise`` split a projection by its output rows or input columns, and
``replicated_with_grad_allreduce`` keeps a module whole with its gradient summed over the
replica's ranks."""


def block_entries(tp_plan: dict[str, str] | None) -> dict[str, str]:
    """The entries of a tensor-parallel plan inside the blocks (``<blocks>.*.<module>``)."""
    return {k: v for k, v in (tp_plan or {}).items() if k.split(".")[1:2] == ["*"]}


def tp_plan_problem(model_type: str, tp_plan: dict[str, str] | None) -> str | None:
    """Why no replica of several ranks can hold this model's blocks, the degree aside (None
    where one can): the model has no tensor-parallel plan, its plan shards nothing inside the
    blocks, or it names a style not in :data:`TP_STYLES`. The planner and the runtime both ask
    it of ``config.model_type`` and ``config.base_model_tp_plan``."""
    if not tp_plan:
        return (f"config.model_type {model_type!r} has no tensor-parallel plan "
                "(config.base_model_tp_plan is empty), so its blocks cannot be sharded")
    blocks = block_entries(tp_plan)
    if not blocks:
        return (f"config.model_type {model_type!r}'s tensor-parallel plan "
                f"(config.base_model_tp_plan: {sorted(tp_plan)}) shards nothing inside the "
                "blocks")
    bad = sorted(f"{v!r} ({k})" for k, v in blocks.items() if v not in TP_STYLES)
    if bad:
        return (f"config.model_type {model_type!r}'s tensor-parallel plan uses the style(s) "
                f"{', '.join(bad)}, which hapt_hf does not run (it runs "
                f"{', '.join(TP_STYLES)})")
    return None


def tp_refusal(t: int, num_heads: int, num_kv_heads: int | None,
               intermediate_size: int) -> str | None:
    """Why ``t``-way tensor parallelism cannot shard a block of these sizes, or None if it can.

    ``num_kv_heads`` None means as many as ``num_heads`` (no grouped-query attention)."""
    if t < 1:
        return f"a tensor-parallel degree must be >= 1, got {t}"
    if t == 1:
        return None
    kv = num_heads if num_kv_heads is None else num_kv_heads
    bad = [f"{what} {n}" for what, n in (("attention heads", num_heads),
                                          ("key/value heads", kv),
                                          ("MLP width", intermediate_size)) if n % t]
    if bad:
        return (f"tensor-parallel degree {t} does not divide the model's {', '.join(bad)}; "
                "use a degree that divides the attention heads, the key/value heads and the "
                "MLP width")
    return None
