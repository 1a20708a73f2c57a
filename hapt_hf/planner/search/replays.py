"""Replaying a candidate layout in the event simulator, shortened where that is exact enough."""
from __future__ import annotations

import functools
from dataclasses import replace

from hapt_hf.core.schedules import RankLists, ScheduleKind, schedule_warmups

from ..cost_model import CostModel
from ..simulate import SimResult, encode_schedule, replay
from .options import Layout

__all__ = ["STEADY_MIN_MICROBATCHES", "simulate_layout", "better"]


@functools.lru_cache(maxsize=64)
def _encoded(kind: str, n: int, m: int, warmups: tuple[int, ...]) -> RankLists:
    # the refinements replay the same action lists with other costs many times over
    return encode_schedule(kind, n, m, warmups)


def _steady_cap(layout: Layout) -> int:
    return max(STEADY_MIN_MICROBATCHES, 4 * max(s.warmup for s in layout.stages)
               + 4 * layout.num_stages)


def simulate_layout(cm: CostModel, layout: Layout, num_microbatches: int, exact: bool = False,
              record_events: bool = False) -> SimResult:
    """Replay ``layout``. Unless ``exact``, a long iteration is replayed with fewer
    micro-batches (four times the deepest warm-up plus the pipeline depth, at least
    STEADY_MIN_MICROBATCHES) and half as many, and the time extrapolated along the steady
    state between them: the pipeline repeats the same period once it is full, so the two
    replays fix it. The period is never below the busiest stage's compute or link per
    micro-batch: behind deep warm-ups a slightly slower stage only paces the pipeline once
    their queue has filled, which can take longer than the short replays (on
    harp_3groups_1p3b the period measured between 32 and 64 micro-batches was 48.3 ms where
    the slowest stage needs 50.4 ms, and plans differing only there looked equal)."""
    costs = cm.stage_costs(layout.stages, layout.micro_batch_size)

    warmups = layout.warmups

    def run(m: int) -> SimResult:
        warm = schedule_warmups(layout.schedule, warmups, m)
        lists, placement = _encoded(layout.schedule, layout.num_stages, m, warm)
        return replay(lists, placement, costs, record_events)

    m = num_microbatches
    cap = _steady_cap(layout)
    # GPipe has no steady state to extrapolate: every forward runs before any backward
    if exact or m <= cap * 3 // 2 or layout.schedule == ScheduleKind.GPIPE:
        return run(m)
    m1, m2 = cap, cap // 2
    r1, r2 = run(m1), run(m2)
    if not (r1.feasible and r2.feasible) and r1.reason.startswith("deadlock"):
        return r1
    floor = max(max(c.forward_s + c.backward_s, c.send_forward_busy_s, c.send_backward_busy_s)
                for c in costs.stages)
    period = max((r1.iteration_s - r2.iteration_s) / (m1 - m2), floor)
    it = r1.iteration_s + (m - m1) * period
    busy = tuple(b * m / m1 for b in r1.stage_busy_s)
    bubble = 1.0 - (sum(busy) / len(busy)) / it if it > 0 else 0.0
    return replace(r1, iteration_s=it, bubble_fraction=bubble, stage_busy_s=busy, events=())


STEADY_MIN_MICROBATCHES = 64
"""Fewest micro-batches a shortened replay keeps: with fewer, the start-up transient of slow
links leaks into the extrapolated period (2% off on harp_3groups_1p3b at 32)."""


def better(a: SimResult, b: SimResult) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    return a.iteration_s < b.iteration_s * (1 - 1e-9)
