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
"""
from __future__ import annotations

import contextlib

import torch

from hapt_hf.core.precision import TORCH_DTYPE_NAMES

__all__ = ["torch_dtype", "compute_context", "autocast_mismatch", "inference_context"]


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of one of hapt_hf's precision names ('fp32', 'bf16', 'fp16')."""
    return getattr(torch, TORCH_DTYPE_NAMES[dtype])


def compute_context(dtype: str, device: str | torch.device):
    """Autocast to ``dtype`` over fp32 weights (how the runtime computes in 16 bits), or
    nothing for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype))


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
