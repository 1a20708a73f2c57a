"""Shares of a micro-batch for replicas of unlike speed: the slowest replica as fast as can be.

Each replica ``j`` needs ``time_of[j](s)`` seconds for ``s`` samples (non-decreasing in ``s``).
:func:`speed_shares` gives every replica one sample, then hands out the others one at a time,
each to the replica that would finish it soonest. That is exact for the slowest replica's time:
if ``T`` is the best achievable maximum, every replica can take ``c_j(T)`` samples within ``T``
and those capacities sum to at least the micro-batch; the greedy only ever places a sample whose
finishing time is the smallest on offer, so it never places one above ``T`` while a replica still
has room below it.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from hapt_hf.errors import PlanningError

__all__ = ["speed_shares"]


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
