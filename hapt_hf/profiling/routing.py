"""Expert routing with data, for the model reader's forwards on tensors without any.

Meta and fake tensors carry shapes, not values, so the experts a router picks have no value to
read. Experts dispatched through transformers' experts interface run as batched matmuls over
each token's top-k experts and need none; a model whose own code groups the tokens by expert
reads the routing: ``nonzero`` over an expert mask (DBRX), the tokens per expert as a Python
list (JetMoE). Inside :class:`BalancedRouting` every top-k over a tensor without data returns
real CPU tensors instead: indices spreading the rows evenly over the candidates (row ``r`` takes
``(r * k + j) mod n`` for ``j < k``: ``k`` distinct experts per token, each expert the same
share of the tokens to within one) and values ``1 / k``. The routing code then runs on those
real tensors (small: tokens x k), each expert's matmul on the tokens routed to it, so the FLOPs
counted are the top-k share of the experts, ``tokens x k`` expert passes, as the batched matmuls
count (a router's expected load, perfectly balanced). Where real and data-less tensors meet, the
real ones are taken in as the others (moved to the meta device; the fake mode takes real inputs
itself); a data-less tensor made by a constant factory (``zeros``, ``ones``, ``full``...) and not
written since is made real where it meets routing data (JetMoE counts tokens per expert in one).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hapt_hf.compat.torch_api import (DispatchMode, is_fake, outside_fake_tensors, storage_key,
                                      written_arguments)

__all__ = ["BalancedRouting", "balanced_routing"]

aten = torch.ops.aten

_FILL = {aten.zeros.default: lambda args: 0, aten.zeros_like.default: lambda args: 0,
         aten.new_zeros.default: lambda args: 0, aten.ones.default: lambda args: 1,
         aten.ones_like.default: lambda args: 1, aten.new_ones.default: lambda args: 1,
         aten.full.default: lambda args: args[1], aten.full_like.default: lambda args: args[1],
         aten.new_full.default: lambda args: args[2]}
"""Factories of a constant tensor: the fill value, read off the op's arguments."""


def _dataless(t: Tensor) -> bool:
    return t.device.type == "meta" or is_fake(t)


class BalancedRouting(DispatchMode):
    """Top-k routing with real, evenly spread choices (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.constants = WeakIdKeyDictionary()
        """Data-less tensors made by a constant factory and not written since: their fill."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.topk.default and _dataless(args[0]):
            return _balanced_topk(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        real = [t for t in tensors if not _dataless(t)]
        if real:  # routing data, or a real tensor among data-less ones (rare: the fast path)
            return self._with_real(func, args, kwargs, tensors, real)
        out = func(*args, **kwargs)
        self._track(func, args, out)
        return out

    def _with_real(self, func, args: tuple, kwargs: dict, tensors: list, real: list):
        dataless = [t for t in tensors if _dataless(t)]
        if all(t in self.constants for t in dataless) and \
                any(t.dim() > 0 or not dataless for t in real) and \
                not any(_dataless(args[i]) for i in _written(func, len(args))):
            # routing data (and constants it meets): computed for real
            args, kwargs = _map_tensors(self._real, args, kwargs)
            with outside_fake_tensors():
                return func(*args, **kwargs)
        if any(t.device.type == "meta" for t in dataless):
            args, kwargs = _map_tensors(_to_meta, args, kwargs)
        out = func(*args, **kwargs)
        self._track(func, args, out)
        return out

    def _real(self, t: Tensor) -> Tensor:
        if not _dataless(t):
            return t
        with outside_fake_tensors():
            return torch.full(t.shape, self.constants[t], dtype=t.dtype)

    def _track(self, func, args: tuple, out) -> None:
        written = [storage_key(args[i]) for i in _written(func, len(args))
                   if isinstance(args[i], Tensor)] if self.constants else []
        if written:  # a constant written in place (or through a view) is one no more
            for t in [t for t in self.constants if storage_key(t) in written]:
                del self.constants[t]
        if func in _FILL and isinstance(out, Tensor) and _dataless(out):
            self.constants[out] = _FILL[func](args)


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among an aten op's arguments (alone or in a list, as aten passes them)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, Tensor))
    return found


def _map_tensors(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with ``fn`` applied to every tensor (alone or in a list)."""
    def one(a):
        if isinstance(a, Tensor):
            return fn(a)
        if isinstance(a, (list, tuple)):
            return type(a)(fn(x) if isinstance(x, Tensor) else x for x in a)
        return a
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


@functools.lru_cache(maxsize=None)
def _written(func, n_args: int) -> tuple[int, ...]:
    """Positions of the arguments ``func`` writes in place, among its first ``n_args``."""
    return tuple(written_arguments(func, (None,) * n_args))


def _to_meta(t: Tensor) -> Tensor:
    """A real tensor met by meta ones, taken in as meta (a 0-dim one mixes as it is)."""
    return t if _dataless(t) or t.dim() == 0 else t.to("meta")


def _balanced_topk(x: Tensor, k: int, dim: int = -1, largest: bool = True,
                   sorted: bool = True) -> tuple[Tensor, Tensor]:
    """Real (values, indices) of ``x.topk(k, dim)``'s shapes: row ``r`` picks ``(r*k + j) % n``."""
    dim = dim % x.dim()
    n, others = x.shape[dim], [s for i, s in enumerate(x.shape) if i != dim]
    with outside_fake_tensors():
        rows = torch.arange(math.prod(others)).view(*others, 1)
        indices = ((rows * k + torch.arange(k)) % n).movedim(-1, dim).contiguous()
        return torch.full(indices.shape, 1.0 / k, dtype=x.dtype), indices


class _RealCalls(TorchFunctionMode):
    """Calls on real tensors only (routing data) run outside the fake mode: a composite such as
    ``one_hot`` makes its own tensors inside, which the fake mode would make data-less."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if tensors and not any(_dataless(t) for t in tensors):
            with outside_fake_tensors():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def balanced_routing(fake: bool = False) -> Iterator[BalancedRouting]:
    """A :class:`BalancedRouting` context, entered inside the FLOP-counting mode or (``fake``)
    the fake one, where calls on real tensors only are also taken out of it."""
    with _RealCalls() if fake else contextlib.nullcontext(), BalancedRouting() as mode:
        yield mode
