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

__all__ = ["TP_DEGREES", "tp_refusal"]

TP_DEGREES = (1, 2, 4, 8)
"""The tensor-parallel degrees the planner searches (a replica's ranks inside one node)."""


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
