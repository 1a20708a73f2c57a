"""How the runtime computes in a plan's precision: the torch dtype of each precision name, the
autocast region of a forward, the dtype activations travel in between stages, and the context of
a forward-only pass.

Mixed precision as the runtime runs it (:mod:`hapt_hf.core.precision`): the stage's modules,
their gradients and the optimizer state stay fp32 (the master weights); the forward runs under
``torch.autocast`` to the plan's compute dtype, on CUDA and on CPU alike (torch's CPU autocast
supports bf16 and fp16), and the backward follows the dtypes the forward chose. The residual
stream between layers stays fp32 under autocast; at a stage boundary it is cast to the compute
dtype for the wire (what the planner prices: ``ModelSpec.boundary_bytes``) and back to fp32 on
arrival, and the same for its gradient going the other way.

What a stage keeps per micro-batch in flight under autocast: its activations, and not a 16-bit
copy of its weights. Each forward runs in its own autocast region, whose cast cache
(``cached_cast`` in aten/src/ATen/autocast_mode.cpp) lives only until the region ends, so each
micro-batch's matmuls would save their own cast of every weight for the backward.
:class:`SharedWeightCasts` keeps, for the whole step, the first micro-batch's cast of each
weight and hands it to every later micro-batch's backward in place of its own (which is then
freed, as the op that used it ends: the forward runs without autocast's cache, which would hold
a second cast of every weight until the forward ends): one copy per weight while any
micro-batch holds it, the same values bit for bit. A
longer autocast region would not do it: torch's cast cache is one per process while its
nesting count is one per thread, so on CUDA the backward thread's activation recomputation
(``torch.utils.checkpoint`` re-enters autocast) empties it at every recomputed block; and the
cache would hold the casts of recomputed blocks too, which keep none.

A frozen weight (``requires_grad=False``: LoRA's base weights) is cast by autocast with no
autograd record of where the cast came from, and torch's cast cache skips it (it caches leaves
that require grad only), so the saved-tensor hooks cannot tell its cast from an activation.
:class:`SharedWeightCasts` casts it itself instead: while a forward runs, a projection
(``nn.Linear``, or transformers' ``Conv1D``: GPT-2's ``c_attn``, ``c_proj`` and ``c_fc``, which
peft's LoRA wraps with ``fan_in_fan_out``) whose weight is frozen reads the step's one 16-bit
cast of that weight in place of the fp32 parameter, for the length of its own forward. Autocast
leaves a tensor already in its dtype as it is, and its own cast is the same ``.to(dtype)``, so
the projection computes, and saves for the backward, the same values bit for bit: one copy per
frozen weight while any micro-batch holds it, as for the weights that train. (``Conv1D``'s
``torch.addmm`` also casts its bias on every call; the bias is not saved for the backward, so
that cast is freed as the op ends and stays autocast's.)
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from transformers import Conv1D

from hapt_hf.compat.torch_api import cast_parameter, swap_parameter
from hapt_hf.core.precision import TORCH_DTYPE_NAMES

__all__ = ["torch_dtype", "compute_context", "autocast_mismatch", "inference_context",
           "SharedWeightCasts", "lends_frozen"]

_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of one of hapt_hf's precision names ('fp32', 'bf16', 'fp16')."""
    return getattr(torch, TORCH_DTYPE_NAMES[dtype])


def compute_context(dtype: str, device: str | torch.device, casts: "SharedWeightCasts | None" = None):
    """Autocast to ``dtype`` over fp32 weights (how the runtime computes in 16 bits), or
    nothing for fp32. ``casts``: the step's shared weight casts, which the forward's saved
    tensors go through (a forward that builds a backward)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    if casts is None:
        return torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype))
    # without the region's own cache, which would hold a second cast of every weight until
    # the forward ends: each cast is freed as its op ends, the step's first one kept
    region = torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype),
                            cache_enabled=False)
    stack = contextlib.ExitStack()
    stack.enter_context(region)
    stack.enter_context(casts.saving())
    return stack


class SharedWeightCasts:
    """One step's 16-bit casts of the weights, one per weight, shared by every micro-batch's
    backward (see the module's docstring).

    Around each forward, :meth:`saving` routes the tensors autograd saves through
    :meth:`pack`: a 16-bit cast of a parameter (or a view of one, as a projection saves
    ``weight.t()``) is exchanged for the first one of the step with the same parameter, dtype
    and layout. The step's casts are all of the same fp32 weights, so the values are the same
    bit for bit; gradients flow through each micro-batch's own graph as before. A frozen
    weight of a projection is not cast by autocast at all there: :meth:`saving` hands the
    projection the step's one cast of it (:meth:`frozen_cast`). Entries are weak: a cast no
    backward still needs is freed. Use one per step (the weights change at the optimizer step);
    saved-tensor hooks entered inside :meth:`saving` replace it unless they pass the tensors
    they leave alone to it (:func:`hapt_hf.compat.torch_api.saved_tensors_hooks_in_force`)."""

    def __init__(self, lend_frozen: bool = True) -> None:
        self._lend_frozen = lend_frozen
        """Whether :meth:`saving` hands projections their frozen weights' casts (the runtime
        passes :func:`lends_frozen` of its stages: without a frozen projection the module hooks
        that do it would only slow every module call)."""
        self._kept: dict[tuple[Any, ...], weakref.ref[Tensor]] = {}
        self._frozen: dict[tuple[int, torch.dtype], weakref.ref[Tensor]] = {}
        self._swapped: dict[int, list[Tensor]] = {}  # by id(module): the parameters it lent
        self._lenders: dict[int, nn.Module] = {}
        self._thread: int | None = None
        self.shared = 0
        """Casts exchanged for an earlier micro-batch's, or frozen weights' casts reused (each
        one a copy not kept)."""

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The context in which a forward's saved tensors go through :meth:`pack`, and its
        projections read the step's casts of their frozen weights (on this thread)."""
        self._thread = threading.get_ident()
        hooks = []
        if self._lend_frozen:
            hooks = [torch_module.register_module_forward_pre_hook(self._lend),
                     torch_module.register_module_forward_hook(self._give_back, always_call=True)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _same):
                yield
        finally:
            for hook in hooks:
                hook.remove()
            for key in list(self._swapped):  # a forward that raised inside a projection
                while self._swapped.get(key):
                    self._give_back(self._lenders[key])
            self._thread = None

    def pack(self, t: Tensor) -> Tensor:
        """``t``, or the step's first cast of the same weight in the same layout."""
        if t.dtype not in _SIXTEEN_BITS or not t.requires_grad:
            return t
        weight = cast_parameter(t)
        if weight is None:
            return t
        key = (id(weight), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        ref = self._kept.get(key)
        first = ref() if ref is not None else None
        if first is None:
            self._kept[key] = weakref.ref(t)
            return t
        self.shared += 1
        return first

    def frozen_cast(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """The step's cast of the frozen ``weight`` to ``dtype``, made here on first use
        (as autocast makes its own: ``weight.to(dtype)``)."""
        key = (id(weight), dtype)
        ref = self._frozen.get(key)
        cast = ref() if ref is not None else None
        if cast is not None:
            self.shared += 1
            return cast
        cast = weight.detach().to(dtype)
        self._frozen[key] = weakref.ref(cast)
        return cast

    def _lend(self, module: nn.Module, args: Any) -> None:
        """Before a projection's forward: its frozen weight's step cast in place of it."""
        if threading.get_ident() != self._thread:
            return
        weight = _frozen_projection_weight(module)
        if weight is None or not torch.is_autocast_enabled(weight.device.type):
            return
        dtype = torch.get_autocast_dtype(weight.device.type)
        if dtype not in _SIXTEEN_BITS:
            return
        cast = self.frozen_cast(weight, dtype)
        self._lenders[id(module)] = module
        self._swapped.setdefault(id(module), []).append(swap_parameter(module, "weight", cast))

    def _give_back(self, module: nn.Module, *_: Any) -> None:
        """After a projection's forward (or its failure): its own parameter again."""
        lent = self._swapped.get(id(module))
        if lent:
            swap_parameter(module, "weight", lent.pop())
            if not lent:
                del self._swapped[id(module)], self._lenders[id(module)]


def lends_frozen(module: nn.Module) -> bool:
    """Whether ``module`` holds a projection (``nn.Linear``, ``Conv1D``) whose frozen fp32
    weight :class:`SharedWeightCasts` would lend its step cast (LoRA's base weights, a frozen
    layer)."""
    return any(_frozen_projection_weight(m) is not None for m in module.modules())


_PROJECTION_FORWARDS = (nn.Linear.forward, Conv1D.forward)
"""Forwards that read their module's weight in one autocast-lowered op only (``F.linear``;
``Conv1D``'s ``torch.addmm(bias, x, weight)``), and nothing else of it."""


def _frozen_projection_weight(module: nn.Module) -> nn.Parameter | None:
    """The weight of ``module`` if it is a projection (``nn.Linear``'s or transformers'
    ``Conv1D``'s own forward, which reads it in one autocast-lowered op only) whose fp32 weight
    does not train; None otherwise (a distributed tensor's weight included)."""
    if type(module).forward not in _PROJECTION_FORWARDS:
        return None
    weight = module.weight
    if type(weight) is not nn.Parameter or weight.requires_grad or weight.dtype != torch.float32 \
            or weight.is_meta:
        return None
    return weight


def _same(t: Tensor) -> Tensor:
    return t


def autocast_mismatch(plan_dtype: str, autocast_dtype: torch.dtype | None) -> str | None:
    """Why an explicit ``RuntimeConfig.autocast_dtype`` cannot run a plan computing in
    ``plan_dtype`` (None when it is unset or the same): the plan's memory and transfers were
    priced for its own precision."""
    if autocast_dtype is None or autocast_dtype == torch_dtype(plan_dtype):
        return None
    return (f"RuntimeConfig.autocast_dtype={autocast_dtype} but the plan computes in "
            f"{plan_dtype} (plan.json precision.compute); leave autocast_dtype unset to follow "
            f"the plan, or re-plan with the precision you want")


@contextlib.contextmanager
def inference_context(module: torch.nn.Module, device: torch.device):
    """Run a forward-only pass as a single process's ``model.eval()`` under ``no_grad``
    would: dropout off, and the RNG streams training draws from (the CPU generator, and
    ``device`` if it is a GPU) left as they were, so that evaluating between two steps
    changes nothing that follows. Every module gets its own mode back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            module.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training
