"""Seeded initialisation of a stage without building the full model: a replay of its RNG stream.

``torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`` draws every weight of the
model from one generator, in construction order. A stage must hold the same values for its
layers, yet must not allocate the others. The model is therefore built twice on the meta device
under a dispatch mode:

1. :class:`InitReplay` with ``owned_ops=None`` numbers every in-place op by the storage it
   writes (:func:`construct` returns that meta model, from which the stage keeps its modules);
2. under the seed, :func:`seeded_values` builds it again with ``owned_ops`` set to the ops that
   write the stage's tensors: those run on CPU shadows of the stage's tensors, and every other
   random op runs on a throw-away tensor of the same shape, which consumes the generator exactly
   as the real build does.

Should the initialisation do something the replay cannot follow (:class:`ReplayUnsupported`),
:func:`full_model_init` builds the whole model on CPU once (a warning says so).
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from hapt_hf.compat.torch_api import DispatchMode, device_factories, storage_key, written_arguments

logger = logging.getLogger(__name__)

__all__ = ["InitReplay", "ReplayUnsupported", "construct", "seeded_values", "full_model_init"]


class ReplayUnsupported(RuntimeError):
    """The model's initialisation did something the meta replay cannot reproduce exactly."""


# Constructors that carry data stay on CPU: transformers probes the device with torch.tensor([])
# and skips weight initialisation under a meta device context, which would hide its RNG draws.
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = frozenset(f for f in device_factories() if f not in _DATA_CONSTRUCTORS)
_RNG_INPLACE = frozenset({
    torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.random_,
    torch.ops.aten.exponential_, torch.ops.aten.bernoulli_, torch.ops.aten.cauchy_,
    torch.ops.aten.log_normal_, torch.ops.aten.geometric_,
})
_RNG_FACTORIES = frozenset({
    torch.ops.aten.rand, torch.ops.aten.randn, torch.ops.aten.randint, torch.ops.aten.randperm,
    torch.ops.aten.normal, torch.ops.aten.bernoulli, torch.ops.aten.multinomial,
    torch.ops.aten.rand_like, torch.ops.aten.randn_like, torch.ops.aten.randint_like,
})


class _MetaFactories(TorchFunctionMode):
    """Tensor factories default to the meta device, like `torch.device("meta")`, except torch.tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class InitReplay(DispatchMode):
    """Numbers the in-place ops on meta tensors; replays the owned ones on CPU shadows.

    Args:
        owned_ops: None to record (``targets`` then lists the storage each op writes), or the
            numbers of the ops to replay on CPU.
    """

    def __init__(self, owned_ops: set[int] | None) -> None:
        super().__init__()
        self.owned_ops = owned_ops
        self.targets: list[int] = []
        self._keep_alive: list[Tensor] = []  # storage keys are addresses: keep them unique
        self._shadows: dict[int, Tensor] = {}
        self._count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _written_meta_arg(func, args)
        if target is not None:
            self._on_write(func, args, kwargs, target)
            if func.overloadpacket in _RNG_INPLACE:
                return args[0]  # on meta it changes nothing; skipping its slow decomposition
        out = func(*args, **kwargs)
        if func.overloadpacket in _RNG_FACTORIES and _is_meta(out):
            # A fresh random tensor on meta drew nothing; its real twin would have.
            raise ReplayUnsupported(f"random factory {func} on the meta device")
        return out

    def _on_write(self, func, args, kwargs, target: Tensor) -> None:
        index, self._count = self._count, self._count + 1
        self._keep_alive.append(target)
        if self.owned_ops is None:
            self.targets.append(storage_key(target))
        elif index in self.owned_ops:
            func(*self._on_shadows(args), **kwargs)
        elif func.overloadpacket in _RNG_INPLACE:
            scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
            func(scratch, *args[1:], **kwargs)

    def _on_shadows(self, args: tuple) -> list:
        out = []
        for arg in args:
            if isinstance(arg, Tensor) and arg.is_meta:
                key = storage_key(arg)
                if key not in self._shadows and arg is not args[0]:
                    raise ReplayUnsupported("an owned tensor is computed from a non-owned one")
                arg = self._shadow(arg, key)
            out.append(arg)
        return out

    def _shadow(self, tensor: Tensor, key: int) -> Tensor:
        if key not in self._shadows:
            numel = tensor.untyped_storage().nbytes() // tensor.element_size()
            self._shadows[key] = torch.empty(numel, dtype=tensor.dtype)
        return self._shadows[key].as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())

    def value_of(self, tensor: Tensor, name: str) -> Tensor:
        """The replayed value of a final model tensor (it must have been written)."""
        key = storage_key(tensor)
        if key not in self._shadows:
            raise ReplayUnsupported(f"{name} is never written during initialisation")
        return self._shadow(tensor, key)


def construct(config: PretrainedConfig, replay: InitReplay,
              attn_implementation: str | None = None) -> nn.Module:
    """The full model built on meta under ``replay`` (``config`` is copied, not changed)."""
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with _MetaFactories(), replay:
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), **extra)


def seeded_values(config: PretrainedConfig, keys: set[str], traced: nn.Module, trace: InitReplay,
                  seed: int | None, rng_state: Tensor) -> dict[str, Tensor]:
    """The values of the state_dict entries ``keys`` in a full model built under ``seed``.

    ``traced`` is the full model :func:`construct` built under the recording ``trace``
    (seed None: the generator restarts from ``rng_state`` instead).
    """
    owned = {storage_key(traced.state_dict(keep_vars=True)[k]) for k in keys}
    try:
        replay = InitReplay(owned_ops={i for i, k in enumerate(trace.targets) if k in owned})
        _reseed(seed, rng_state)
        tensors = construct(config, replay).state_dict(keep_vars=True)
        return {k: replay.value_of(tensors[k], k) for k in keys}
    except ReplayUnsupported as why:
        logger.warning("initialisation replay unsupported (%s); building the full model on CPU once", why)
        full = full_model_init(config, seed, rng_state)
        return {k: full[k] for k in keys}


def full_model_init(config: PretrainedConfig, seed: int | None, state: Tensor) -> dict[str, Tensor]:
    """The state_dict of the full model built on CPU under ``seed`` (the replay's fallback)."""
    _reseed(seed, state)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).state_dict()


def _reseed(seed: int | None, state: Tensor) -> None:
    if seed is None:
        torch.set_rng_state(state)
    else:
        torch.manual_seed(seed)


def _written_meta_arg(func, args: tuple) -> Tensor | None:
    """The meta tensor an in-place op writes (its first mutated argument), if any."""
    for i in written_arguments(func, args):
        arg = args[i]
        if isinstance(arg, Tensor) and arg.is_meta:
            return arg
    return None


def _is_meta(out) -> bool:
    return isinstance(out, Tensor) and out.is_meta
