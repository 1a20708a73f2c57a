"""Defaults that more than one layer of hapt_hf must agree on."""
from __future__ import annotations

__all__ = ["GRAD_BUCKET_BYTES", "DEFAULT_TIMEOUT_S", "ATTN_IMPLEMENTATIONS",
           "DEFAULT_ATTN_IMPLEMENTATION", "DEFAULT_MEMORY_HEADROOM"]

GRAD_BUCKET_BYTES = 25 * 2**20
"""Gradient all-reduce bucket size (PyTorch DDP's default): the runtime's buckets and the
cost model's estimate of how the all-reduce overlaps the last backward."""
DEFAULT_TIMEOUT_S = 300.0
"""How long a rank waits for the others before the job ends with a message."""
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
"""transformers' attention implementations a job may run: ``eager`` keeps the s x s attention
probabilities for the backward, ``sdpa`` (fused scaled-dot-product kernels) keeps a per-row
log-sum-exp instead."""
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
"""The attention preferred: where a job names none, the model's best is this one where the
model's class supports it, else eager (chosen once, by
``hapt_hf.profiling.model_figures.choose_attention``); a plan carries the choice, which the stage
builder, the profiler and the planner's memory model then share, or the planner would budget
memory the runtime does not have. Also the default of the lower-level calls that take an
attention (``build_stage``, ``ProfilerOptions``, a plan.json without the field)."""
DEFAULT_MEMORY_HEADROOM = 0.9
"""Fraction of each GPU's memory a plan may use: the planner's options, the cost model and the
simulator all default to it (the rest is left for the allocator's fragmentation and the CUDA
context)."""
