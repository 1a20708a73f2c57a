"""A transformer block's tensor-parallel compute split, on one device.

A ``t``-way tensor-parallel replica shards the projections the model's own plan names
(``config.base_model_tp_plan``): a colwise projection keeps ``1/t`` of its output features
(attention heads, key/value heads, MLP width), a rowwise one ``1/t`` of its input features;
norms and everything else stay whole. What one rank of the replica computes is therefore the
block with those projections cut to TP rank 0's shard, plus the all-reduces of the rowwise
outputs (forward) and of the colwise inputs' gradients (backward), which need ``t`` devices.

:func:`split_block` builds the first part from a block the profiler built (it slices the
block's own weights, so the attention's head count follows from the projections' widths, as it
does on a real TP rank); the profiler times it per ``t`` and times the all-reduces on the
group's link apart (:func:`hapt_hf.profiling.links.measure_tp_allreduce`). Which modules are
cut, and which models and degrees are refused, is read as the runtime reads it
(:mod:`hapt_hf.pipeline.tensor_parallel`: ``stage_tp_plan``, ``tp_plan_refusal``).
"""
from __future__ import annotations

from hapt_hf.core.tp import TP_DEGREES

from .store import ProfilerError

__all__ = ["tp_degrees", "split_block"]

_CUT_DIM = {"colwise": 0, "rowwise": 1}
"""The styles that cut an ``nn.Linear`` weight, and the dimension they cut (out features 0, in
features 1); the runtime's other style, ``replicated_with_grad_allreduce``, keeps the module
whole."""


def _refusal(config, t: int) -> str | None:
    """Why a block of ``config`` cannot be split ``t`` ways: the runtime's reasons
    (:func:`hapt_hf.pipeline.tensor_parallel.tp_plan_refusal`: no plan, a style it does not run,
    a degree the heads, key/value heads or MLP width refuse), said for the profiler where the
    model has no plan."""
    from hapt_hf.pipeline.tensor_parallel import tp_plan_refusal
    if t > 1 and not getattr(config, "base_model_tp_plan", None):
        return (f"model type {getattr(config, 'model_type', '?')!r} has no tensor-parallel plan "
                "(config.base_model_tp_plan): its blocks are timed whole only")
    return tp_plan_refusal(config, t)


def tp_degrees(config, asked: tuple[int, ...] | None = None
               ) -> tuple[tuple[int, ...], list[str]]:
    """(degrees above 1 to time, why each other one is left out): ``asked`` (None: every
    degree of :data:`~hapt_hf.core.tp.TP_DEGREES`), kept where the runtime could split the
    model's blocks that many ways (:func:`_refusal`). A reason shared by several degrees is
    given once."""
    keep, why = [], []
    for t in (TP_DEGREES if asked is None else asked):
        if t <= 1:
            continue
        refusal = _refusal(config, t)
        if refusal is None:
            keep.append(t)
        elif refusal not in why:
            why.append(refusal)
    return tuple(keep), why


def split_block(stage, config, t: int, rank: int = 0):
    """``stage`` (a built one-block stage, changed in place and returned) with every projection
    the model's plan shards cut to TP rank ``rank``'s shard of ``t``: a colwise ``nn.Linear``
    keeps rows ``[rank * n, (rank + 1) * n)`` of its weight and bias (``n = out_features / t``),
    a rowwise one those columns of its weight (``n = in_features / t``) and its bias on rank 0
    only (added once after the all-reduce, as torch's ``RowwiseParallel`` does). The profiler
    times rank 0's shard; ``t`` = 1 returns the stage as is."""
    import torch

    from hapt_hf.pipeline.tensor_parallel import stage_tp_plan
    if not 0 <= rank < t:
        raise ProfilerError(f"TP rank {rank} is not one of the {t} ranks 0..{t - 1}")
    if t == 1:
        return stage
    refusal = _refusal(config, t)
    if refusal is not None:
        raise ProfilerError(refusal)
    try:
        plan = stage_tp_plan(stage, config)
    except ValueError as e:  # a plan entry outside the blocks
        raise ProfilerError(f"{e}; time this model's blocks whole (degree 1)") from None
    cuts = {path: style for path, style in plan.items() if style in _CUT_DIM}
    if not cuts:
        raise ProfilerError(f"no module of the stage is sharded by the tensor-parallel plan of "
                            f"{config.model_type!r}; time its blocks whole (degree 1)")
    for name, style in cuts.items():
        module = stage.get_submodule(name)
        if type(module) is not torch.nn.Linear:
            raise ProfilerError(f"{name} is a {type(module).__name__}, not the nn.Linear a "
                                f"{style} split cuts; time this model with tensor-parallel "
                                "degree 1 only")
        dim = _CUT_DIM[style]
        full = module.weight.shape[dim]
        if full % t:
            raise ProfilerError(f"{name} has {full} {('output', 'input')[dim]} features, which "
                                f"tensor-parallel degree {t} does not divide")
        part = slice(rank * full // t, (rank + 1) * full // t)
        rows, cols = (slice(None), part) if dim else (part, slice(None))
        bias = module.bias is not None and (not dim or rank == 0)
        shard = torch.nn.Linear(full // t if dim else module.in_features,
                                module.out_features if dim else full // t, bias=bias,
                                device=module.weight.device, dtype=module.weight.dtype)
        with torch.no_grad():
            shard.weight.copy_(module.weight[rows, cols])
            if bias:
                shard.bias.copy_(module.bias if dim else module.bias[rows])
        parent, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(parent), leaf, shard.train(module.training))
    return stage
