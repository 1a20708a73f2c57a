"""Shares of a micro-batch among a stage's replicas: how unlike replicas split it, how it is laid
out over them, and what neighbouring stages trade.

Replica ``r`` of a stage owns the contiguous slice ``[s_0 + .. + s_{r-1}, s_0 + .. + s_r)`` of
every micro-batch (its share ``s_r``, the shares laid end to end). Two neighbouring stages trade,
for every pair of their replicas, exactly the samples their slices have in common. Pure
arithmetic on share lists, so the planner (which chooses and prices the shares) and the runtime
(which makes the transfers) can agree without either importing the other.

Shares for replicas of unlike speed (:func:`speed_shares`) make the slowest replica as fast as
can be. Each replica ``j`` needs ``time_of[j](s)`` seconds for ``s`` samples (non-decreasing in
``s``); every replica gets one sample, then the others go one at a time, each to the replica
that would finish it soonest. That is exact for the slowest replica's time: if ``T`` is the best
achievable maximum, every replica can take ``c_j(T)`` samples within ``T`` and those capacities
sum to at least the micro-batch; the greedy only ever places a sample whose finishing time is
the smallest on offer, so it never places one above ``T`` while a replica still has room below
it.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from hapt_hf.errors import PlanningError

__all__ = ["speed_shares", "slices", "overlaps"]


def speed_shares(micro_batch_size: int,
                 time_of: Sequence[Callable[[int], float]]) -> tuple[int, ...]:
    """Integer samples per replica, each >= 1, summing to ``micro_batch_size``, minimising the
    slowest replica's ``time_of[j](samples_j)`` (ties go to the earlier replica)."""
    n = len(time_of)
    if n < 1 or micro_batch_size < n:
        raise PlanningError(f"a micro-batch of {micro_batch_size} samples cannot give each of "
                            f"{n} replicas at least one; use a micro-batch of at least {n}")
    shares = [1] * n
    heap = [(time_of[j](2), j) for j in range(n)]
    heapq.heapify(heap)
    for _ in range(micro_batch_size - n):
        _, j = heapq.heappop(heap)
        shares[j] += 1
        heapq.heappush(heap, (time_of[j](shares[j] + 1), j))
    return tuple(shares)


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
