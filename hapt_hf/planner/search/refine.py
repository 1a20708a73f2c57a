"""Refinement by simulation: move layer boundaries of a finalist while its replay improves."""
from __future__ import annotations

from dataclasses import replace

from hapt_hf.core.schedules import ScheduleKind

from ..simulate import SimResult
from .options import Layout
from .problem import SearchProblem
from .replays import better, simulate_layout
from .state import stage_state
from .warmups import hapt_warmups

__all__ = ["as_schedule", "refine_boundaries"]


def as_schedule(layout: Layout, schedule: str, m: int) -> Layout:
    """The same partition under the planner's schedule. 1F1B is H-1F1B with one warm-up step
    per stage, so a 1F1B baseline keeps its depths (and its replay) under H-1F1B."""
    if layout.schedule == schedule:
        return layout
    if schedule == ScheduleKind.H1F1B and layout.schedule == ScheduleKind.ONE_F_ONE_B:
        return replace(layout, schedule=schedule)
    n = layout.num_stages
    warm = hapt_warmups(layout.shapes, [0.0] * (n - 1), 1.0, m, schedule)
    return replace(layout.with_warmups(warm), schedule=schedule)


def _moves(n: int):
    """Boundary moves: one boundary by one layer, or two neighbouring boundaries together
    (which shifts a whole stage by one layer)."""
    for i in range(n - 1):
        for d in (-1, 1):
            yield (i,), d
    for i in range(n - 2):
        for d in (-1, 1):
            yield (i, i + 1), d


def _moved(layout: Layout, idx: tuple[int, ...], d: int):
    edges = [a for a, _ in layout.bounds] + [layout.bounds[-1][1]]
    for i in idx:
        edges[i + 1] += d
    if any(b <= a for a, b in zip(edges, edges[1:])):
        return None
    return tuple(zip(edges, edges[1:]))


def refine_boundaries(problem: SearchProblem, layout: Layout, sim: SimResult,
                      budget: int) -> tuple[Layout, SimResult]:
    """Move layer boundaries of ``layout`` (replayed as ``sim``) by one while the replay
    improves (at most ``budget`` replays)."""
    cm, m = problem.cost_model, problem.num_microbatches(layout.micro_batch_size)
    allow_rc, allow_sharded = problem.allow_recompute, problem.allow_sharded
    improved = True
    while improved and budget > 0:
        improved = False
        for idx, d in _moves(layout.num_stages):
            if budget <= 0:
                break
            bounds = _moved(layout, idx, d)
            if bounds is None:
                continue
            inflight = sim.peak_in_flight or layout.warmups
            states = []
            for j, (a, b) in enumerate(bounds):
                got = stage_state(cm, layout.stages[j].replicas, layout.micro_batch_size, a, b,
                                  inflight[j], allow_rc, allow_sharded,
                                  problem.options.allow_sequence_parallel)
                if got is None:
                    break
                states.append(got)
            if len(states) != len(bounds):
                continue
            cand = layout.with_layers(bounds, [s[0] for s in states], [s[1] for s in states],
                                      [s[2] for s in states])
            budget -= 1
            r = simulate_layout(cm, cand, m)
            if better(r, sim):
                layout, sim, improved = cand, r, True
    return layout, sim
