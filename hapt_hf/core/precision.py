"""Training precisions: the one list of names, what each costs, and the rule ``auto`` follows.

A job trains in *mixed precision* as the runtime runs it: the weights, their gradients and the
optimizer state stay in fp32 (the master weights), and the forward and backward compute in the
job's 16-bit dtype under autocast; ``fp32`` computes in fp32 too. fp16's narrow range needs
dynamic loss scaling; bf16 has fp32's range and needs none.

The precision a job asks for is one of :data:`PRECISIONS`; ``auto`` resolves against the devices
the job runs on (:func:`resolve_precision`): bf16 where every GPU supports it, else fp16 with
dynamic loss scaling, and fp32 on CPUs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hapt_hf.errors import PrecisionError

__all__ = ["DTYPES", "DTYPE_BYTES", "DTYPE_ALIASES", "TORCH_DTYPE_NAMES", "canonical_dtype",
           "AUTO", "PRECISIONS", "DEFAULT_PRECISION", "MASTER_BYTES", "STATE_BYTES_PER_PARAM",
           "ADAM_STATE_BYTES", "REPLICATED", "SHARDED", "OPTIMIZER_STATES", "state_bytes_per_param",
           "Precision", "canonical_precision", "resolve_precision", "PrecisionError"]

DTYPES = ("fp32", "fp16", "bf16")
"""The compute dtypes a job, a plan, a hapt config or the CLI may give."""
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes per element of a tensor in each dtype."""
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16",
                 "float": "fp32"}
"""torch's and transformers' spellings of the same precisions."""
TORCH_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""The ``torch`` attribute of each precision (``getattr(torch, name)``)."""

AUTO = "auto"
PRECISIONS = (AUTO, "bf16", "fp16", "fp32")
"""What a job may ask for: a compute dtype, or ``auto`` (chosen from the devices)."""
DEFAULT_PRECISION = AUTO

MASTER_BYTES = 4
"""Bytes per weight and per weight gradient: both stay fp32 whatever the compute dtype, so the
data-parallel all-reduce moves 4 bytes per parameter."""
STATE_BYTES_PER_PARAM = 16
"""Training state per parameter with Adam: 4 (fp32 weights, the master copy) + 4 (fp32
gradients) + 8 (two fp32 Adam moments), the same in every precision. The 16-bit copies of the
weights that autocast makes live with the activations (one per micro-batch in flight)."""
ADAM_STATE_BYTES = 8
"""The two fp32 Adam moments per parameter: the part of :data:`STATE_BYTES_PER_PARAM` that a
sharded optimizer (ZeRO-1) splits among a stage's replicas."""

REPLICATED = "replicated"
SHARDED = "sharded"
OPTIMIZER_STATES = (REPLICATED, SHARDED)
"""How a stage keeps its optimizer state: ``replicated`` (every replica holds the whole Adam
state) or ``sharded`` (ZeRO-1, as ``torch.distributed.optim.ZeroRedundancyOptimizer`` does:
each replica holds and updates the Adam moments of its own share of the parameters, then the
updated weights are broadcast to the other replicas)."""


def state_bytes_per_param(optimizer: str, replicas: int) -> float:
    """Training-state bytes per parameter on one GPU of a stage of ``replicas`` replicas: fp32
    weights and gradients stay whole on every replica (the gradients are all-reduced and
    accumulate over the micro-batches); a sharded optimizer splits only the Adam moments."""
    if optimizer == SHARDED:
        return STATE_BYTES_PER_PARAM - ADAM_STATE_BYTES + ADAM_STATE_BYTES / max(1, replicas)
    return float(STATE_BYTES_PER_PARAM)


def canonical_dtype(name: object) -> str | None:
    """``name`` as one of :data:`DTYPES` (aliases resolved), or None if it is none of them."""
    d = DTYPE_ALIASES.get(str(name), str(name))
    return d if d in DTYPES else None


def canonical_precision(name: object) -> str | None:
    """``name`` as one of :data:`PRECISIONS` (dtype aliases resolved), or None."""
    return AUTO if str(name) == AUTO else canonical_dtype(name)


@dataclass(frozen=True)
class Precision:
    """How a job computes: the compute dtype and the loss scaling it needs."""

    compute: str
    """'bf16' | 'fp16' | 'fp32': the dtype of the forward and backward (autocast)."""
    loss_scaling: str | None
    """'dynamic' (fp16) or None (bf16 and fp32 need none)."""
    reason: str = ""
    """Why this precision was chosen (for messages; not saved)."""

    @classmethod
    def of(cls, compute: str, reason: str = "") -> "Precision":
        """``compute`` with the loss scaling it needs."""
        return cls(compute, "dynamic" if compute == "fp16" else None, reason)

    def describe(self) -> str:
        """``fp16 with dynamic loss scaling (V100-32 has no bf16)``."""
        text = self.compute + (f" with {self.loss_scaling} loss scaling"
                               if self.loss_scaling else "")
        return f"{text} ({self.reason})" if self.reason else text

    def to_dict(self) -> dict:
        return {"compute": self.compute, "loss_scaling": self.loss_scaling}


def resolve_precision(requested: str | None, devices: Mapping[str, bool | None],
                      cpus: frozenset[str] | set[str] = frozenset()) -> Precision:
    """The precision a job runs in on ``devices`` (device name -> bf16 support, None where
    unknown); ``cpus`` names the devices that are CPUs.

    ``auto`` (or None): fp32 if any device is a CPU, bf16 if every GPU supports it, else fp16
    with dynamic loss scaling. An explicit bf16 that a GPU cannot run is refused, naming it.
    """
    wanted = canonical_precision(AUTO if requested is None else requested)
    if wanted is None:
        raise PrecisionError(f"precision {requested!r} is not known; use one of "
                             f"{', '.join(PRECISIONS)}")
    gpus = {d: ok for d, ok in devices.items() if d not in cpus}
    lacking = sorted(d for d, ok in gpus.items() if not ok)
    if wanted == "bf16" and lacking:
        unknown = [d for d in lacking if gpus[d] is None]
        fix = (f"; if {unknown[0]} does support it, set bf16: true in its group of the cluster "
               "file" if unknown else "")
        raise PrecisionError(f"precision bf16: {', '.join(lacking)} cannot compute in bf16; "
                             f"use precision fp16 (with dynamic loss scaling) or auto{fix}")
    if wanted != AUTO:
        return Precision.of(wanted, "as asked")
    if cpus & set(devices):
        return Precision.of("fp32", f"{sorted(cpus & set(devices))[0]} is a CPU")
    if lacking:
        why = "has no bf16" if gpus[lacking[0]] is False else "has no known bf16 support"
        return Precision.of("fp16", f"{lacking[0]} {why}")
    return Precision.of("bf16", "every GPU supports bf16")
