"""What autograd really keeps for a backward, and the precision a layer computes in.

The profiler, the memory-model benchmark and its test all measure the same way: every tensor
autograd saves during a forward, counted once per storage, parameters excluded (the weights are
budgeted apart, as training state). That is what a micro-batch in flight holds until its
backward, on any device.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from hapt_hf.compat.torch_api import storage_key
# the runtime's own: the profiler times layers in exactly the precision the runtime runs
from hapt_hf.pipeline.precision import compute_context, torch_dtype

__all__ = ["saved_tensor_bytes", "compute_context", "torch_dtype"]

T = TypeVar("T")


def saved_tensor_bytes(module: torch.nn.Module, forward: Callable[[], T]) -> tuple[float, T]:
    """(bytes autograd saves while ``forward()`` runs, its result); ``module``'s parameters
    are not counted, every other storage once however many tensors view it."""
    weights = {storage_key(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)  # not data_ptr: fake tensors (the model reader's) have none
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return float(sum(seen.values())), out
