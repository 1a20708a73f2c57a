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
group's link apart (:func:`hapt_hf.profiling.links.measure_tp_allreduce`).
"""
from __future__ import annotations

import re

from hapt_hf.core.tp import TP_DEGREES, tp_refusal

from .store import ProfilerError

__all__ = ["SHARDED_STYLES", "WHOLE_STYLES", "tp_plan", "tp_degrees", "split_block"]

SHARDED_STYLES = {"colwise": 0, "rowwise": 1}
"""Styles cut on one dimension of an ``nn.Linear`` weight (out features 0, in features 1)."""
WHOLE_STYLES = ("replicated_with_grad_allreduce",)
"""Styles that keep the module whole on every TP rank (its gradient summed over the group)."""


def tp_plan(config) -> dict[str, str]:
    """The model's tensor-parallel plan (module pattern -> style), refused with the reason where
    it has none or names a style the split does not know."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ProfilerError(f"model type {getattr(config, 'model_type', '?')!r} has no "
                            "tensor-parallel plan (config.base_model_tp_plan); time it with "
                            "tensor-parallel degree 1 only")
    unknown = sorted({s for s in plan.values() if s not in SHARDED_STYLES and
                      s not in WHOLE_STYLES})
    if unknown:
        raise ProfilerError(f"the tensor-parallel plan of {config.model_type!r} uses style(s) "
                            f"{', '.join(unknown)} the profiler cannot split; time it with "
                            "tensor-parallel degree 1 only")
    return dict(plan)


def _sizes(config) -> tuple[int, int | None, int]:
    heads = getattr(config, "num_attention_heads", None)
    width = getattr(config, "intermediate_size", None)
    if heads is None or width is None:
        raise ProfilerError(f"model type {config.model_type!r} does not give "
                            "num_attention_heads and intermediate_size; time it with "
                            "tensor-parallel degree 1 only")
    return heads, getattr(config, "num_key_value_heads", None), width


def tp_degrees(config, asked: tuple[int, ...] | None = None, most: int | None = None
               ) -> tuple[tuple[int, ...], list[str]]:
    """(degrees above 1 to time, why each other one is left out): ``asked`` (None: every
    degree of :data:`~hapt_hf.core.tp.TP_DEGREES`), kept where the model's heads, key/value
    heads and MLP width divide and, with ``most``, at most that many devices (a group's GPUs
    on one node). A model without a tensor-parallel plan gives no degree and says why."""
    candidates = tuple(t for t in (TP_DEGREES if asked is None else asked) if t > 1)
    if not candidates:
        return (), []
    try:
        tp_plan(config)
        heads, kv, width = _sizes(config)
    except ProfilerError as e:
        return (), [str(e)]
    keep, why = [], []
    for t in candidates:
        refusal = tp_refusal(t=t, num_heads=heads, num_kv_heads=kv, intermediate_size=width)
        if refusal is None and most is not None and t > most:
            refusal = f"tensor-parallel degree {t} needs more than the {most} devices given"
        if refusal is None:
            keep.append(t)
        else:
            why.append(refusal)
    return tuple(keep), why


def _pattern(key: str) -> re.Pattern:
    # 'layers.*.mlp.up_proj' names a module under the base model: any prefix, any layer index
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split("."))
    return re.compile(rf"(?:^|\.){body}$")


def split_block(stage, config, t: int, rank: int = 0):
    """``stage`` (a built one-block stage, changed in place and returned) with every projection
    the model's plan shards cut to TP rank ``rank``'s shard of ``t``: a colwise ``nn.Linear``
    keeps rows ``[rank * n, (rank + 1) * n)`` of its weight and bias (``n = out_features / t``),
    a rowwise one those columns of its weight (``n = in_features / t``) and its bias on rank 0
    only (added once after the all-reduce, as torch's ``RowwiseParallel`` does). The profiler
    times rank 0's shard; ``t`` = 1 returns the stage as is."""
    import torch

    if not 0 <= rank < t:
        raise ProfilerError(f"TP rank {rank} is not one of the {t} ranks 0..{t - 1}")
    if t == 1:
        return stage
    heads, kv, width = _sizes(config)
    refusal = tp_refusal(t=t, num_heads=heads, num_kv_heads=kv, intermediate_size=width)
    if refusal is not None:
        raise ProfilerError(refusal)
    patterns = [(_pattern(k), style) for k, style in tp_plan(config).items()
                if style in SHARDED_STYLES]
    cut = 0
    for name, module in list(stage.named_modules()):
        style = next((s for p, s in patterns if p.search(name)), None)
        if style is None:
            continue
        if type(module) is not torch.nn.Linear:
            raise ProfilerError(f"{name} is a {type(module).__name__}, not the nn.Linear a "
                                f"{style} split cuts; time this model with tensor-parallel "
                                "degree 1 only")
        dim = SHARDED_STYLES[style]
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
        cut += 1
    if not cut:
        raise ProfilerError(f"no module of the stage matches the tensor-parallel plan of "
                            f"{config.model_type!r}; time it with tensor-parallel degree 1 only")
    return stage
