"""Refinement by simulation: move layer boundaries of a finalist while its replay improves.

A stage that must recompute recomputes only its fewest first blocks that let it hold what it
holds (``Stage.recompute_layers``): first on the finalist as the partition made it (its
stages recomputing all their blocks), against the replay's micro-batches in flight, then on
every boundary move."""
from __future__ import annotations

from dataclasses import replace

from hapt_hf.core.schedules import ScheduleKind

from ..simulate import SimResult
from .options import Layout
from .problem import SearchProblem
from .replays import better, simulate_layout
from .state import partial_recompute, stage_state
from .warmups import hapt_warmups

__all__ = ["as_schedule", "moved_layout", "refine_boundaries", "stage_setting", "trim_recompute"]


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


def stage_setting(problem: SearchProblem, replicas, mbs: int, a: int, b: int, in_flight: int
                  ) -> tuple[bool, str, bool, int] | None:
    """(recompute, optimizer, sequence parallel, recompute_layers) of a stage holding layers
    [a, b) with ``in_flight`` micro-batches (:func:`~.state.stage_state`); where it must
    recompute, only its fewest first block units that let it fit
    (:func:`~.state.partial_recompute`); None where nothing fits."""
    cm, sp_ok = problem.cost_model, problem.options.allow_sequence_parallel
    got = stage_state(cm, replicas, mbs, a, b, in_flight, problem.allow_recompute,
                      problem.allow_sharded, sp_ok)
    if got is None or not got[0] or not problem.options.allow_partial_recompute:
        return None if got is None else (*got, 0)
    part = partial_recompute(cm, replicas, mbs, a, b, in_flight, problem.allow_sharded, sp_ok)
    units = max(min(b, cm.model.num_layers - 1) - max(a, 1), 0)
    if part is None or part[0] >= units:
        return (*got, 0)
    return False, part[1], part[2], part[0]


def trim_recompute(problem: SearchProblem, layout: Layout, in_flight) -> Layout | None:
    """``layout`` with each stage that recomputes all its blocks recomputing only the fewest
    first ones that let it hold ``in_flight`` micro-batches (:func:`stage_setting`), or None
    where no stage can recompute fewer."""
    stages, changed = list(layout.stages), False
    for j, s in enumerate(layout.stages):
        if not s.recompute:
            continue
        got = stage_setting(problem, s.replicas, layout.micro_batch_size, *s.layers,
                            in_flight[j])
        if got is not None and not got[0]:
            stages[j] = replace(s, recompute=False, optimizer=got[1], sequence_parallel=got[2],
                                recompute_layers=got[3])
            changed = True
    return replace(layout, stages=tuple(stages)) if changed else None


def moved_layout(problem: SearchProblem, layout: Layout, idx: tuple[int, ...], d: int,
                 in_flight) -> Layout | None:
    """``layout`` with boundaries ``idx`` moved by ``d`` layers (one move of :func:`_moves`),
    each stage set to hold ``in_flight[j]`` micro-batches (:func:`stage_setting`); None where
    the move empties a stage or a stage then fits no setting."""
    bounds = _moved(layout, idx, d)
    if bounds is None:
        return None
    states = []
    for j, (a, b) in enumerate(bounds):
        got = stage_setting(problem, layout.stages[j].replicas, layout.micro_batch_size, a, b,
                            in_flight[j])
        if got is None:
            return None
        states.append(got)
    return layout.with_layers(bounds, [s[0] for s in states], [s[1] for s in states],
                              [s[2] for s in states], [s[3] for s in states])


def refine_boundaries(problem: SearchProblem, layout: Layout, sim: SimResult,
                      budget: int) -> tuple[Layout, SimResult]:
    """Move layer boundaries of ``layout`` (replayed as ``sim``) by one while the replay
    improves (at most ``budget`` replays)."""
    cm, m = problem.cost_model, problem.num_microbatches(layout.micro_batch_size)
    if budget > 0 and any(s.recompute for s in layout.stages):
        cand = trim_recompute(problem, layout, sim.peak_in_flight or layout.warmups)
        if cand is not None:
            budget -= 1
            r = simulate_layout(cm, cand, m)
            if better(r, sim):
                layout, sim = cand, r
    improved = True
    while improved and budget > 0:
        improved = False
        for idx, d in _moves(layout.num_stages):
            if budget <= 0:
                break
            cand = moved_layout(problem, layout, idx, d, sim.peak_in_flight or layout.warmups)
            if cand is None:
                continue
            budget -= 1
            r = simulate_layout(cm, cand, m)
            if better(r, sim):
                layout, sim, improved = cand, r, True
    return layout, sim
