"""Tensor parallelism inside a replica: which degrees a model allows, written once.

A replica of a stage is held by ``t`` ranks together (its ``ranks`` in plan.json). They shard
the transformer blocks' projections the model's own tensor-parallel plan names (transformers'
``config.base_model_tp_plan``: attention heads and the MLP width split ``t`` ways, column-wise
in, row-wise out); the embedding, the final norm and the LM head stay whole on each of them.
So ``t`` must divide the attention heads, the key/value heads and the MLP width. The planner
(which reads sizes from its model description) and the runtime (which reads the transformers
config) both ask :func:`tp_refusal`.

Two levers beside it, asked by both sides too: sequence parallelism inside a replica's blocks
(:func:`sp_refusal`, plan.json's per-stage ``"sp"``) and the LM head split by vocabulary rows
over the last stage's ranks (:func:`head_sharded`).
"""
from __future__ import annotations

from hapt_hf.core.layers import BLOCK

__all__ = ["TP_DEGREES", "TP_STYLES", "SP_MODEL_TYPES", "SP_PROJECTIONS", "HEAD_MODULE", "HEAD_STYLE", "tp_refusal",
           "block_entries", "tp_plan_problem", "sp_refusal", "block_activation_parts", "head_refusal",
           "head_sharded"]

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


SP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The ``config.model_type`` values whose blocks run sequence parallel: pre-norm decoder layers
``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``, each
sub-layer's output made by a row-wise ``self_attn.o_proj`` / ``mlp.down_proj``, with per-token
(RMS) norms and nothing else on the residual stream (checked against one process for each)."""

SP_PROJECTIONS = {"self_attn.o_proj": "rowwise", "mlp.down_proj": "rowwise"}
"""The block entries a sequence-parallel block's tensor-parallel plan must hold as written: the
projections whose partial outputs are reduce-scattered onto the sequence instead of
all-reduced."""

HEAD_MODULE = "lm_head"
"""The LM head's entry in a causal-LM class's own tensor-parallel plan (transformers'
``LlamaForCausalLM._tp_plan == {"lm_head": "colwise_gather_output"}``)."""

HEAD_STYLE = "colwise_gather_output"
"""The head style a class's plan must name for hapt_hf to split the head: the weight split by
vocabulary rows (transformers then gathers the logits; hapt_hf takes the loss on them split,
``hapt_hf.pipeline.vocab_parallel``, and gathers them only where they are asked for)."""


def sp_refusal(model_type: str, tp_plan: dict[str, str] | None, t: int = 2,
               layer_unit: str = BLOCK) -> str | None:
    """Why a stage of this model held by ``t`` ranks cannot run its blocks sequence parallel
    (None where it can). ``tp_plan`` is ``config.base_model_tp_plan``.

    Sequence parallelism (Korthikanti et al., 2022; torch's ``PrepareModuleInput`` and
    ``RowwiseParallel(output_layouts=Shard(1))`` as torchtitan's llama plan uses them) keeps
    the residual stream of the stage's blocks split on the sequence over the replica's ``t``
    ranks: the norms and the residual adds run on ``s/t`` tokens each, and the attention's and
    the MLP's all-gathered inputs are kept for the backward as each rank's slice and gathered
    again there (as Megatron-LM does), so a rank holds :func:`block_activation_parts`:
    ``34/t`` of Korthikanti's 34 parts. Sequence parallelism changes no FLOP of the block;
    forward, the bytes it moves are those of tensor parallelism in other collectives; backward,
    two all-gathers more. Per block and micro-batch of ``b`` samples, ``s`` tokens each, hidden
    ``h``, in the compute dtype (``e`` bytes an element):

    * forward: an all-gather of the attention's input and one of the MLP's input
      (``b·s·h·e`` bytes gathered, each rank contributing ``1/t``), and a reduce-scatter of the
      ``o_proj`` and ``down_proj`` outputs (``b·s·h·e`` bytes reduced, ``1/t`` kept) where plain
      tensor parallelism all-reduces them: the same bytes on the wire as the two all-reduces
      (an all-reduce is a reduce-scatter then an all-gather);
    * backward: the same two pairs reversed (each all-gather's backward is a reduce-scatter,
      and each reduce-scatter's an all-gather), and the attention's and the MLP's inputs
      all-gathered again (``b·s·h·e`` bytes each) for the projections' weight gradients: two
      all-gathers more than plain tensor parallelism's backward;
    * at the stage's edges (transfers between stages stay whole activations): the first block's
      input is sliced (no communication, backward one all-gather of ``b·s·h·e``), and the last
      block's output is all-gathered on the sequence (``b·s·h·e``, backward a slice), so a
      stage pays one extra all-gather forward and one backward;
    * the block norms' weight gradients are summed over the ``t`` ranks once per iteration
      (``2·h`` elements per block, fp32);
    * under activation recomputation the forward's two all-gathers run again in the backward
      (and the inputs are not gathered a third time).

    A batch whose sequence length ``t`` does not divide is right-padded by the runtime to a
    multiple of ``t`` (masked; up to ``t - 1`` tokens a sample computed for nothing).
    Refused: a ``model_type`` not in :data:`SP_MODEL_TYPES`, a tensor-parallel plan without
    both rows of :data:`SP_PROJECTIONS`, ``t`` of 1 (nothing to split), and ``layer_unit``
    ``half`` (a stage may then begin or end inside a block)."""
    if model_type not in SP_MODEL_TYPES:
        return (f"config.model_type {model_type!r} is not among the models whose blocks run "
                f"sequence parallel ({', '.join(SP_MODEL_TYPES)}: pre-norm decoder layers); "
                "set the stage's \"sp\" to false")
    if t < 2:
        return ("sequence parallelism splits a stage's sequence over its tensor-parallel ranks, "
                f"and the stage has {t}; set its \"sp\" to false or give it tp > 1")
    if layer_unit != BLOCK:
        return (f"sequence parallelism runs whole blocks only, and the plan's layer_unit is "
                f"{layer_unit!r}; use layer_unit 'block' or set \"sp\" to false")
    entries = {k.partition(".*.")[2]: v for k, v in block_entries(tp_plan).items()}
    missing = [f"{k}: {v}" for k, v in SP_PROJECTIONS.items() if entries.get(k) != v]
    if missing:
        return (f"config.model_type {model_type!r}'s tensor-parallel plan lacks "
                f"{', '.join(missing)}, which sequence parallelism reduce-scatters onto the "
                "sequence; set the stage's \"sp\" to false")
    return None


def block_activation_parts(t: int, sequence_parallel: bool) -> float:
    """Of Korthikanti et al.'s 34 parts of ``s·b·h`` (2-byte activations) a block keeps for its
    backward on one GPU (attention scores aside), those each of a replica's ``t`` ranks keeps.

    Without sequence parallelism ``10 + 24/t``: the two norms' inputs (4), the attention's and
    the MLP's inputs (2 + 2) and the dropout masks (2) are whole on every rank. With it,
    ``34/t``: everything is split on the sequence, the attention's and the MLP's all-gathered
    inputs kept as the rank's slice and gathered again in the backward (see
    :func:`sp_refusal`). ``benchmarks/sp_check.py`` measures it (LLaMA blocks, hidden 512,
    seq 256, fp32, t = 2, no dropout in the model): 0.637 of one GPU's kept bytes without
    sequence parallelism (``22/34`` = 0.647) and 0.516 with it (``17/34`` = 0.5)."""
    if t < 1:
        raise ValueError(f"a tensor-parallel degree must be >= 1, got {t}")
    return 34 / t if sequence_parallel else 10 + 24 / t


def head_refusal(head_tp_plan: dict[str, str] | None, tied: bool) -> str | None:
    """Why the LM head stays whole on each rank of a tensor-parallel last stage (None where it
    is split). ``head_tp_plan`` is the causal-LM class's own tensor-parallel plan (transformers'
    ``LlamaForCausalLM._tp_plan``, read through :mod:`hapt_hf.compat`); ``tied``:
    ``config.tie_word_embeddings``. A tied head shares its weight with the embedding, which
    stays whole (the first stage's ranks sum its gradient with the last stage's), so it stays
    whole too."""
    if tied:
        return ("the LM head is tied to the input embedding (tie_word_embeddings), which stays "
                "whole on every rank, so the head does too")
    style = (head_tp_plan or {}).get(HEAD_MODULE)
    if style != HEAD_STYLE:
        return (f"the model class's tensor-parallel plan gives {HEAD_MODULE!r} "
                f"{style!r}, not {HEAD_STYLE!r}, so the head stays whole")
    return None


def head_sharded(t: int, head_tp_plan: dict[str, str] | None, tied: bool) -> bool:
    """Whether the LM head of a last stage held by ``t`` ranks is split by vocabulary rows over
    them: ``t`` > 1 and :func:`head_refusal` has nothing against it.

    What to price (``V`` vocabulary rows, hidden ``h``, ``b·s`` tokens a micro-batch of the
    replica, ``e`` bytes an element of the compute dtype): the head's weight, gradient and
    optimizer state are ``V/t·h`` per rank (``V`` a multiple of ``t``; else torch's uneven
    chunks: ``ceil(V/t)`` rows on the first ranks), its matmul ``2·b·s·h·V/t`` FLOPs forward
    (twice that backward). The logits stay split: each rank takes the loss on its columns
    (``hapt_hf.pipeline.vocab_parallel``), keeping a ``b·s·ceil(V/t)`` fp32 softmax instead
    of the whole vocabulary's, with two all-reduces of fp32 numbers a token forward (the
    largest logit; the sum of the exponentials and the target's logit) and none of its own
    backward. Backward: one all-reduce of the head input's gradient (``b·s·h·e`` bytes) over
    the ``t`` ranks. The final norm stays whole on each rank. Logits asked for whole
    (prediction) are all-gathered on the vocabulary."""
    return t > 1 and head_refusal(head_tp_plan, tied) is None
