"""Defaults that more than one layer of hapt_hf must agree on."""
from __future__ import annotations

__all__ = ["GRAD_BUCKET_BYTES", "DEFAULT_TIMEOUT_S", "DEFAULT_JOB_DTYPE"]

GRAD_BUCKET_BYTES = 25 * 2**20
"""Gradient all-reduce bucket size (PyTorch DDP's default): the runtime's buckets and the
cost model's estimate of how the all-reduce overlaps the last backward."""
DEFAULT_TIMEOUT_S = 300.0
"""How long a rank waits for the others before the job ends with a message."""
DEFAULT_JOB_DTYPE = "fp16"
"""The precision a job is planned in when neither the command line nor ``job:`` names one."""
