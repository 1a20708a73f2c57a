"""What the runtime collects on one rank from every stage: the last stage's logits of a global
batch, and the full model's state dict (Hugging Face keys). Both are collectives over every rank;
the runtime runs them inside its failure channel, so a rank that dies meanwhile is named.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hapt_hf.pipeline.checkpoint_io import gather_state_dicts
from hapt_hf.pipeline.placement import replica_slice
from hapt_hf.planner.plan import Plan

__all__ = ["gather_logits", "gather_state_dict"]


def gather_logits(outs: dict[int, Tensor], shape: torch.Size, plan: Plan, rank: int,
                  vocab: int, device: torch.device) -> Tensor | None:
    """The full logits [global_batch, seq, vocab] (float32, CPU) on rank 0, None elsewhere.

    ``outs``: this rank's logits by micro-batch (a last-stage replica's slice of each); every
    replica of the last stage sends its slices to rank 0, in micro-batch order, from its first
    rank (every rank of a tensor-parallel replica holds the same whole logits).
    """
    mbs = plan.micro_batch_size
    full = None
    last = plan.stages[-1]
    if rank == 0:
        full = torch.empty((shape[0], shape[1], vocab), dtype=torch.float32)
    senders = [rep.ranks[0] for rep in last.replicas]
    for k in range(plan.num_microbatches):
        for r, peer in enumerate(senders):
            lo, hi = (k * mbs + x for x in replica_slice(mbs, last, r))
            if peer == rank == 0:
                full[lo:hi] = outs[k].float().cpu()
            elif peer == rank:
                dist.send(outs[k].float().contiguous(), 0, tag=k)
            elif rank == 0:
                buf = torch.empty_like(full[lo:hi], device=device)
                dist.recv(buf, peer, tag=k)
                full[lo:hi] = buf.cpu()
    return full


def gather_state_dict(mine: dict[str, Tensor] | None, rank: int,
                      dst: int = 0) -> dict[str, Tensor] | None:
    """Every stage's tensors merged into the full model's state dict on rank ``dst`` (None
    elsewhere). ``mine``: this rank's stage state dict (CPU, whole tensors), None on every rank
    but the first of the stage's first replica, so that each stage counts once."""
    parts: list[Any] | None = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(mine, parts, dst=dst)
    if parts is None:
        return None
    return gather_state_dicts(p for p in parts if p)
