"""How a micro-batch is laid out over a stage's replicas, and what neighbouring stages trade.

Replica ``r`` of a stage owns the contiguous slice ``[s_0 + .. + s_{r-1}, s_0 + .. + s_r)`` of
every micro-batch (its share ``s_r``, the shares laid end to end). Two neighbouring stages trade,
for every pair of their replicas, exactly the samples their slices have in common. Pure
arithmetic on share lists, so the planner (which prices the transfers) and the runtime (which
makes them) can agree without either importing the other.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["slices", "overlaps"]


def slices(shares: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``[lo, hi)`` of each replica's slice of a micro-batch, in replica order."""
    out, lo = [], 0
    for s in shares:
        out.append((lo, lo + s))
        lo += s
    return tuple(out)


def overlaps(left: Sequence[int], right: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(i, j, samples)`` for every replica ``i`` of the left stage and ``j`` of the right
    whose slices share ``samples > 0`` samples, in sample order."""
    if sum(left) != sum(right):
        raise ValueError(f"shares {list(left)} and {list(right)} cover different micro-batch "
                         "sizes; both stages must split the same micro-batch")
    out = []
    for i, (a0, a1) in enumerate(slices(left)):
        for j, (b0, b1) in enumerate(slices(right)):
            n = min(a1, b1) - max(a0, b0)
            if n > 0:
                out.append((i, j, n))
    return tuple(out)
