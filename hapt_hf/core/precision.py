"""Training precisions: the one list of dtypes and what each costs per element."""
from __future__ import annotations

__all__ = ["DTYPES", "DTYPE_BYTES", "DTYPE_ALIASES", "TORCH_DTYPE_NAMES", "canonical_dtype"]

DTYPES = ("fp32", "fp16", "bf16")
"""The names a job, a plan, a hapt config or the CLI may give."""
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes per activation element and per parameter."""
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16",
                 "float": "fp32"}
"""torch's and transformers' spellings of the same precisions."""
TORCH_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""The ``torch`` attribute of each precision (``getattr(torch, name)``)."""


def canonical_dtype(name: object) -> str | None:
    """``name`` as one of :data:`DTYPES` (aliases resolved), or None if it is none of them."""
    d = DTYPE_ALIASES.get(str(name), str(name))
    return d if d in DTYPES else None
