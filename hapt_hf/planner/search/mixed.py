"""Pipeline stages that mix groups: GPUs of several groups in one stage, shares by speed.

The pipeline search puts every stage on one group (even shares). Two bounded families of
layouts let a stage hold GPUs of several linked groups, each GPU taking a share of every
micro-batch in proportion to its speed (:func:`~hapt_hf.core.shares.speed_shares`):

* **merged boundary**: in a pipeline already found, the last stage of one group and the first
  stage of the next become one stage over both stages' GPUs and layers (one stage of fill and
  one group-link cut fewer; the slower group no longer paces the pipeline alone). Merges are
  taken greedily, one boundary at a time, while the replay improves.
* **columns**: ``k`` stages, each taking a slice of every group (as equal as the group's size
  allows), so every stage has about the same mix and speed: a group whose GPU count divides
  neither the micro-batch nor the layers, or a slow group that would be a bottleneck stage on
  its own, is spread over every stage instead. The layers are cut by a min-max partition over
  the stages' slowest replicas under every replica's memory.

Both are replayed by the same simulator as every candidate and kept only when faster. A stage's
replicas all-reduce over the slowest link its ring crosses, so a layout whose stages span
groups without links between them is not weighed.
"""
from __future__ import annotations

from dataclasses import replace

from hapt_hf.core.precision import REPLICATED, SHARDED
from hapt_hf.errors import CostModelError

from ..cluster import GpuGroup
from ..cost_model import CostModel
from ..plan import Replica
from ..simulate import SimResult
from .data_parallel import layer_speed_shares
from .options import Layout
from .partition import cut_times, estimate_s, smallest_feasible_cap
from .problem import SearchProblem
from .refine import refine_boundaries
from .replays import better
from .shapes import divisors
from .state import stage_state
from .warmups import hapt_warmups, in_flight_guess, refine_warmups

__all__ = ["speed_shape", "merge_boundaries", "column_layouts", "mixed_candidate"]

_COLUMN_MBS = 3
"""Micro-batch sizes tried per column count: the smallest giving every GPU a sample, and the
next ones (larger ones only lengthen the fill)."""


def speed_shape(cm: CostModel, gpus: list[tuple[GpuGroup, int]], mbs: int, a: int,
                b: int) -> tuple[Replica, ...] | None:
    """The replicas of a stage over ``gpus`` ((group, index in group), in order) holding layers
    [a, b), each GPU's share of a micro-batch of ``mbs`` by its speed on those layers; None when
    ``mbs`` cannot give each GPU a sample."""
    if mbs < len(gpus):
        return None
    shares = layer_speed_shares(cm, [g for g, _ in gpus], mbs, a, b)
    return cm.gpu_replicas(gpus, shares)


def _gpus(cm: CostModel, replicas: tuple[Replica, ...]) -> list[tuple[GpuGroup, int]]:
    p = cm.placement(replicas)
    return list(zip(p.group_of, p.index))


_REFINE_WITHIN = 1.05
"""A column layout's boundaries are refined only when its replay is within this factor of the
best time so far: moving a layer rarely gains more, and each move costs a replay."""


def _finish(problem: SearchProblem, layout: Layout, refine_budget: int,
            best_s: float = float("inf")) -> tuple[Layout, SimResult] | None:
    """Warm-ups from HAPT's thresholds, then replayed with its warm-ups refined, and its
    boundaries where it comes near ``best_s``; None where it does not fit or its replicas
    cannot all-reduce."""
    cm, m = problem.cost_model, problem.num_microbatches(layout.micro_batch_size)
    try:
        cuts = cut_times(cm, layout.shapes, layout.bounds, layout.micro_batch_size)
        costs = cm.stage_costs(layout.stages, layout.micro_batch_size)
        cap = max(c.forward_s + c.backward_s for c in costs.stages)
        lay = layout.with_warmups(hapt_warmups(layout.shapes, cuts, cap, m, layout.schedule))
        lay, r = refine_warmups(problem, lay)
    except CostModelError:  # groups the gradient ring cannot cross
        return None
    if not r.feasible:
        return None
    if refine_budget > 0 and r.iteration_s < best_s * _REFINE_WITHIN:
        lay, r = refine_boundaries(problem, lay, r, refine_budget)
    return lay, r


def _merged(problem: SearchProblem, layout: Layout, i: int,
            in_flight: tuple[int, ...]) -> Layout | None:
    """``layout`` with stages i and i + 1 as one stage over both's GPUs and layers."""
    cm, mbs = problem.cost_model, layout.micro_batch_size
    left, right = layout.stages[i], layout.stages[i + 1]
    a, b = left.layers[0], right.layers[1]
    shape = speed_shape(cm, _gpus(cm, left.replicas) + _gpus(cm, right.replicas), mbs, a, b)
    if shape is None:
        return None
    got = stage_state(cm, shape, mbs, a, b, max(in_flight[i], in_flight[i + 1]),
                      problem.allow_recompute, problem.allow_sharded)
    if got is None:
        return None
    merged = replace(left, layers=(a, b), replicas=shape, recompute=got[0], optimizer=got[1])
    later = tuple(replace(s, index=s.index - 1) for s in layout.stages[i + 2:])
    return replace(layout, stages=layout.stages[:i] + (merged,) + later)


def merge_boundaries(problem: SearchProblem, layout: Layout,
                     sim: SimResult) -> tuple[Layout, SimResult]:
    """Merge, one at a time, the two stages at a group boundary of ``layout`` (replayed as
    ``sim``) while the replay improves."""
    improved = True
    while improved:
        improved = False
        best = None
        inflight = sim.peak_in_flight or layout.warmups
        for i in range(layout.num_stages - 1):
            left, right = layout.stages[i], layout.stages[i + 1]
            if set(left.groups) == set(right.groups):
                continue  # inside one group: an even stage of both is the search's own
            cand = _merged(problem, layout, i, tuple(inflight))
            got = cand and _finish(problem, cand, 0)
            if got and better(got[1], sim) and (best is None or better(got[1], best[1])):
                best = got
        if best is not None:
            layout, sim = best
            improved = True
    return layout, sim


def _columns(cluster_groups, k: int) -> list[list[tuple[GpuGroup, int]]] | None:
    """``k`` slices of every group, as equal as its size allows, or None where a group has
    fewer than ``k`` GPUs."""
    if any(g.size < k for g in cluster_groups):
        return None
    cols: list[list[tuple[GpuGroup, int]]] = [[] for _ in range(k)]
    for g in cluster_groups:
        off = 0
        for j in range(k):
            w = g.size // k + (j < g.size % k)
            cols[j] += [(g, off + x) for x in range(w)]
            off += w
    return cols


def _column_partition(problem: SearchProblem, shapes: list[tuple[Replica, ...]], mbs: int,
                      in_flight: list[int]):
    """Min-max contiguous layers over ``shapes`` (each stage's replicas, timed by its slowest)
    under every replica's memory: (bounds, recompute, optimizer), or None."""
    cm = problem.cost_model
    allow_rc, allow_sharded = problem.allow_recompute, problem.allow_sharded
    n, L = len(shapes), cm.model.num_layers
    kinds = []
    for sh in shapes:
        p = cm.placement(sh)
        kinds.append(list({(g.name, r.samples): (g, r.samples)
                           for g, r in zip(p.group_of, p.replicas)}.values()))

    def reach(i: int, a: int, cap: float, limit: int):
        b = limit
        for g, samples in kinds[i]:
            t = cm.table(g, samples)
            b = min(b, cm.max_layers_fitting(t.fb_rc if allow_rc else t.fb, a, cap))
        while b > a:
            got = stage_state(cm, shapes[i], mbs, a, b, in_flight[i], allow_rc, allow_sharded)
            if got is not None:
                if got[0]:  # recomputing: its backward repeats the forward, so check the cap
                    if max(sum(cm.compute_s(g, s, a, b, True)) for g, s in kinds[i]) <= cap:
                        return b, got
                else:
                    return b, got
            b -= 1
        return a, None

    def greedy(cap: float):
        a, bounds, states = 0, [], []
        for i in range(n):
            b, got = reach(i, a, cap, L - (n - i - 1))
            if b <= a:
                return None
            bounds.append((a, b))
            states.append(got)
            a = b
        return (tuple(bounds), tuple(s[0] for s in states),
                tuple(s[1] for s in states)) if a == L else None

    top = max(sum(cm.compute_s(g, s, 0, L, True)) for ks in kinds for g, s in ks)
    hi = top * 1.001
    got = greedy(hi)
    if got is None:
        return None
    return smallest_feasible_cap(greedy, 0.0, hi, got, 1e-3)[1]


def _could_fit(problem: SearchProblem, cols: list[list[tuple[GpuGroup, int]]], k: int) -> bool:
    """Whether ``k`` columns can hold the model at all: some column holds ``ceil(L / k)``
    layers or more, and every column holds a GPU of the least memory, so the lightest such
    run of layers' weights and state (sharded over the widest column where allowed: the
    least it can take) must fit that GPU; a quick necessary test before any partition."""
    cm = problem.cost_model
    L = cm.model.num_layers
    run = -(-L // k)
    state = SHARDED if problem.allow_sharded else REPLICATED
    widest = max(len(c) for c in cols)
    least = min(cm.capacity_bytes(g) for g in cm.cluster.groups)
    return min(cm.static_bytes(a, a + run, state, widest)
               for a in range(L - run + 1)) <= least


def column_layouts(problem: SearchProblem) -> list[Layout]:
    """Column layouts over every group of the problem's cluster: each column count up to the
    smallest group, at the first few micro-batch sizes giving every GPU a sample, partitioned,
    best analytic estimate first."""
    cm, options = problem.cost_model, problem.options
    groups = cm.cluster.groups
    if len(groups) < 2:
        return []
    L = cm.model.num_layers
    top_k = min(min(g.size for g in groups), L, options.max_stages or L)
    scored = []
    for k in range(2, top_k + 1):
        cols = _columns(groups, k)
        if cols is None:
            continue
        width = max(len(c) for c in cols)
        if not _could_fit(problem, cols, k):
            continue
        sizes = [mb for mb in divisors(problem.global_batch_size) if mb >= width and
                 (options.micro_batch_sizes is None or mb in options.micro_batch_sizes)]
        for mbs in sizes[:_COLUMN_MBS]:
            m = problem.num_microbatches(mbs)
            shapes = [speed_shape(cm, c, mbs, 0, L) for c in cols]
            try:
                inflight = in_flight_guess(shapes, mbs, m, options.schedule, cm, 1.0)
                part = _column_partition(problem, shapes, mbs, inflight)
                if part is None:
                    continue
                lay = Layout.build(shapes, part[0], part[1], mbs, inflight, options.schedule,
                                   part[2])
                scored.append((estimate_s(cm, lay, m), k, mbs, lay))
            except CostModelError:  # its stages span groups with no link between them
                return []
    scored.sort(key=lambda s: s[:3])
    return [s[3] for s in scored]


def mixed_candidate(problem: SearchProblem, layout: Layout,
                    sim: SimResult) -> tuple[Layout, SimResult] | None:
    """The fastest layout with mixed stages found from the search's best ``layout`` (merged
    boundaries) and from column layouts, or None where none replays faster than ``sim``."""
    options = problem.options
    best_l, best_r = merge_boundaries(problem, layout, sim)
    for lay in column_layouts(problem)[:options.simulate_top]:
        got = _finish(problem, lay, options.max_refine_simulations // options.simulate_top,
                      best_r.iteration_s)
        if got and better(got[1], best_r):
            best_l, best_r = got
    if best_l is layout:
        return None
    return best_l, best_r

