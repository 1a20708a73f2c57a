"""Point-to-point transfers of the pipeline runtime: one posted send or receive.

Transfers are torch.distributed's own ``isend``/``irecv``, on the groups of each stage boundary
(:func:`~hapt_hf.pipeline.process_group.transfer_groups`); :class:`Transfer` keeps a posted one
with the peer it involves and what it carries, so that
:class:`~hapt_hf.pipeline.failure.FailureChannel` can wait for it and name the peer if it fails.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Transfer"]


@dataclass(frozen=True)
class Transfer:
    """One posted send or receive with the peer it involves and what it carries."""

    work: dist.Work
    peer: int
    what: str
    """E.g. "RECV_F of micro-batch 3 from rank 2 (stage 1)": used in failure messages."""
    buffer: torch.Tensor
    """Kept alive until the transfer completes (a send's source, a receive's destination)."""
