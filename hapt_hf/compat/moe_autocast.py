"""A transformers MoE whose forward fails under autocast, run as transformers' other MoEs run.

DBRX's experts (``DbrxExperts.forward`` in ``transformers/models/dbrx/modeling_dbrx.py``,
transformers 5.23 and 5.24) add each expert's output into a buffer made like their input::

    next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, ...)
    ...
    states = self.mlp(hidden_states[token_idx], w1, v1, w2)
    states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]
    next_states.index_add_(0, token_idx, states)

Under autocast the input is the fp32 residual stream (autocast runs the LayerNorm before it in
fp32) and ``states``, the output of the expert's matmuls, is 16-bit. ``index_add_`` is in none of
autocast's op lists (an in-place op keeps its operands' dtypes) and refuses the mix: "index_add_():
self (Float) and source (BFloat16) must have the same scalar type", in bf16 and fp16 (seen on the
CPU; CUDA's autocast also runs LayerNorm in fp32 and the op's dtype check is not per device).
Every other MoE of transformers casts the source to the buffer's dtype first, e.g.
``MixtralExperts.forward`` (``models/mixtral/modeling_mixtral.py``)::

    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

:func:`cast_index_add_sources` gives such modules that cast: while autocast is on, their forward
runs in a torch-function mode that casts ``index_add_``'s source to its destination's dtype
(a differentiable ``.to``, as Mixtral's). Without autocast, or where the dtypes already agree,
the module's own code runs unchanged; a transformers release that adds the cast itself leaves
the mode nothing to do.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["UNCAST_INDEX_ADD", "cast_index_add_sources"]

UNCAST_INDEX_ADD = ("transformers.models.dbrx.modeling_dbrx.DbrxExperts",)
"""Module classes (module path and name) whose forward adds a 16-bit source into an fp32
buffer with ``index_add_`` under autocast."""
_INDEX_ADDS = (Tensor.index_add_, Tensor.index_add, torch.index_add)


def cast_index_add_sources(root: nn.Module) -> list[str]:
    """Give every module of ``root`` of a class in :data:`UNCAST_INDEX_ADD` a forward whose
    ``index_add_`` casts its source to its destination's dtype under autocast; the names of the
    modules changed (already changed ones are left as they are)."""
    changed = []
    for name, module in root.named_modules():
        cls = type(module)
        if f"{cls.__module__}.{cls.__qualname__}" in UNCAST_INDEX_ADD \
                and not isinstance(module.__dict__.get("forward"), types.MethodType):
            # bound to the module, so a deep copy of it is bound to the copy
            module.forward = types.MethodType(_forward_casting_index_add, module)
            changed.append(name)
    return changed


def _forward_casting_index_add(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
    if x is None or not torch.is_autocast_enabled(x.device.type):
        return forward(self, *args, **kwargs)
    with _CastIndexAddSource():
        return forward(self, *args, **kwargs)


class _CastIndexAddSource(TorchFunctionMode):
    """``index_add_(dim, index, source)``'s source cast to the destination's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _INDEX_ADDS:
            dest = args[0] if args else kwargs["input"]
            if len(args) > 3:
                args = (*args[:3], _to(args[3], dest), *args[4:])
            elif "source" in kwargs:
                kwargs["source"] = _to(kwargs["source"], dest)
        return func(*args, **kwargs)


def _to(source: Any, dest: Tensor) -> Any:
    if isinstance(source, Tensor) and source.dtype != dest.dtype and dest.is_floating_point():
        return source.to(dest.dtype)
    return source
