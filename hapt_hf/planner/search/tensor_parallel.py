"""Tensor-parallel degrees: which degree each group's replicas take.

A group of ``n`` GPUs whose replicas are ``t`` GPUs each looks to the rest of the search like
``n / t`` GPUs, each with ``t`` times the memory for the blocks' sharded projections and
``t x tp_efficiency(t)`` times the speed on the blocks, less the all-reduces
(:class:`~hapt_hf.planner.cost_model.CostModel` with ``tp``): the search over stage shapes,
layer ranges, micro-batch sizes and warm-ups runs unchanged on that view, and its replicas
come out as ``t`` consecutive ranks of one node.

The degrees are searched per group around that search, then per stage: every group at the same degree first
(1, 2, 4, 8 as the group and the model allow, capped by ``max_tp``), then, from the best of
those where it has a degree above 1 (or where nothing fits without), one group at a time moved
to a neighbouring degree while the plan improves (coordinate descent). An assignment is
not weighed where its own limit (:func:`tp_limit_s`: the physical limit with every GPU at its
speed inside a replica of its degree) is no faster than the best plan so far: where the
blocks are narrow (tensor parallelism's efficiency is low) this rules out every degree above
1 and costs nothing. Each weighing is a shortened search (the finest layer unit allowed, fewer
replays; the screen), whose replayed plan is kept; the caller may search the winner again with
the user's options. Degree 1 everywhere is the search without tensor parallelism, exactly: a
degree above it is kept only where the simulator finds it faster.

Stages of one group may then differ (:func:`refine_stage_degrees`): from the winner, each
group's GPUs are cut again into stages of the same width at two neighbouring degrees, the
first ``j`` stages at the higher (the early stages of a pipeline hold the most micro-batches in
flight, so they gain the most memory from it) and the rest at the lower (cheaper
all-reduces, a shorter head on the last stage). Every such mix of every group is partitioned
and scored by HAPT's formula (cheap), the best few are replayed, and the best replay is kept
(its boundaries refined) where, at the schedule kind it would keep, it beats the winner's own;
then again from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from hapt_hf.core.tp import TP_DEGREES

from ..cluster import GpuGroup
from ..cost_model import tp_unfit
from ..model_spec import ModelSpec
from ..simulate import SimResult
from .candidates import layout_on
from .kinds import kept_kind_s
from .options import Layout
from .problem import SearchProblem
from .refine import refine_boundaries
from .replays import better, simulate_layout

__all__ = ["TpChoice", "node_degrees", "group_degrees", "choose_degrees", "degree_mixes",
           "refine_stage_degrees", "STAGE_MIX_REPLAYS"]

Weigh = Callable[[SearchProblem], "tuple[float, object] | None"]
"""A screen of one assignment of degrees: its best plan's time and what the caller keeps of
it, None where nothing fits."""


@dataclass(frozen=True)
class TpChoice:
    """One assignment of tensor-parallel degrees weighed, and what the screen found."""

    tp: tuple[tuple[str, int], ...]
    """(group, degree) of every group, in file order."""
    iteration_s: float | None
    """The screen's best plan time; None where nothing fits."""


def node_degrees(model: ModelSpec, group: GpuGroup, max_tp: int = TP_DEGREES[-1]) -> list[int]:
    """The degrees a replica of ``group`` may take for ``model``: up to ``max_tp``, dividing
    its GPUs per node, and allowed by the model (:func:`~hapt_hf.planner.cost_model.tp_unfit`)."""
    return [t for t in TP_DEGREES if t <= max_tp and group.gpus_per_node % t == 0
            and tp_unfit(model, t) is None]


def group_degrees(problem: SearchProblem, group: GpuGroup) -> list[int]:
    """The degrees ``group``'s replicas may take in ``problem`` (:func:`node_degrees` up to
    the options' ``max_tp``)."""
    return node_degrees(problem.model, group, problem.options.max_tp)


def tp_limit_s(problem: SearchProblem) -> float:
    """The physical limit of the problem's degrees: the global batch's work over the summed
    speed of every GPU, each at its speed inside a replica of its group's degree (a replica
    of ``t`` GPUs puts a sample through the model in ``sample_time_s(.., t)``, every layer
    priced as the cost model prices it). No plan at these degrees beats it."""
    cm = problem.cost_model
    rate = 0.0
    for g in problem.hardware.groups:
        t = cm.tp[g.name]
        sizes = {1}
        if cm.profile is not None:
            sizes.update(cm.profile.micro_batches(g.gpu.name))
        rate += g.size / (t * min(cm.sample_time_s(g, s, t) for s in sorted(sizes)))
    return problem.global_batch_size / rate


def choose_degrees(problem: SearchProblem, weigh: Weigh, base_s: float | None
                   ) -> tuple[dict[str, int] | None, object, tuple[TpChoice, ...]]:
    """The assignment of degrees (group -> t) the screen finds fastest, if any beats
    ``base_s`` (the plan at degree 1 everywhere; None: none fits), what ``weigh`` returned
    for it, and every assignment weighed (at most ``tp_screens``, in a fixed order, so the
    choice does not depend on the machine's speed)."""
    groups = problem.hardware.groups
    options = {g.name: group_degrees(problem, g) for g in groups}
    if all(o == [1] for o in options.values()):
        return None, None, ()
    screens = problem.options.tp_screens
    seen: dict[tuple[tuple[str, int], ...], float | None] = {}
    kept: dict[tuple[tuple[str, int], ...], object] = {}
    ones = tuple((g.name, 1) for g in groups)
    seen[ones] = base_s
    best = {g.name: 1 for g in groups}
    best_s = float("inf") if base_s is None else base_s

    def score(tp: dict[str, int]) -> float:
        key = tuple((g.name, tp[g.name]) for g in groups)
        if key not in seen:
            sub = problem.with_tp(tp)
            if len(seen) - 1 >= screens or tp_limit_s(sub) >= best_s:
                return float("inf")
            got = weigh(sub)
            seen[key] = None if got is None else got[0]
            if got is not None:
                kept[key] = got[1]
        got = seen[key]
        return float("inf") if got is None else got

    for t in (2, 4, 8):
        tp = {n: max(d for d in o if d <= t) for n, o in options.items()}
        s = score(tp)
        if s < best_s:
            best, best_s = tp, s
    # the descent starts from a degree above 1 that beat the plan without (or where nothing
    # fits without): one group alone at a higher degree rarely wins where every group at it
    # does not, and each try costs a search
    improved = base_s is None or any(t > 1 for t in best.values())
    while improved:
        improved = False
        for g in groups:
            o = options[g.name]
            i = o.index(best[g.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(o):
                    tp = {**best, g.name: o[j]}
                    s = score(tp)
                    if s < best_s * (1 - 1e-9):
                        best, best_s, improved = tp, s, True
    choices = tuple(TpChoice(k, v) for k, v in seen.items() if k != ones)
    if all(t == 1 for t in best.values()):
        return None, None, choices
    return best, kept[tuple((g.name, best[g.name]) for g in groups)], choices


STAGE_MIX_REPLAYS = 3
"""Mixes of stage degrees replayed each round (the best by HAPT's formula)."""


def degree_mixes(problem: SearchProblem, layout: Layout
                 ) -> Iterator[tuple[tuple[str, int, int, int, int], tuple]]:
    """Each group's stages cut again at two neighbouring degrees: ``(group, high, j, low, k)``
    and the stages' replicas, where the group's first ``j`` stages hold replicas of ``high``
    GPUs and the next ``k`` of ``low``, every stage as wide as before and the group's GPUs
    as before (the other groups' stages unchanged). A group is left as it is where its stages
    are not consecutive, alike (one group, equal shares) and of one width."""
    cm, mbs = problem.cost_model, layout.micro_batch_size
    stages = layout.stages
    runs: dict[str, list[int]] = {}
    for i, s in enumerate(stages):
        runs.setdefault(s.replicas[0].group, []).append(i)
    for name, idx in runs.items():
        reps = [stages[i].replicas for i in idx]
        if idx != list(range(idx[0], idx[-1] + 1)) or \
                any(len({r.group for r in x}) > 1 or len({r.samples for r in x}) > 1
                    for x in reps) or len({len(x) for x in reps}) > 1:
            continue
        g, w = cm.group(name), len(reps[0])
        first = cm.first_gpu(reps[0])
        gpus = sum(len(x) * x[0].tp for x in reps)
        now = tuple(x[0].tp for x in reps)
        degrees = group_degrees(problem, g)
        for low, high in zip(degrees, degrees[1:]):
            for j in range(gpus // (w * high) + 1):
                rest = gpus - j * w * high
                if rest % (w * low):
                    continue
                k = rest // (w * low)
                if (high,) * j + (low,) * k == now:
                    continue
                mine = [cm.replicas_at(g, first + q * w * high, w, high, mbs) for q in range(j)]
                mine += [cm.replicas_at(g, first + j * w * high + q * w * low, w, low, mbs)
                         for q in range(k)]
                shapes = (tuple(s.replicas for s in stages[:idx[0]]) + tuple(mine)
                          + tuple(s.replicas for s in stages[idx[-1] + 1:]))
                yield (name, high, j, low, k), shapes


def refine_stage_degrees(problem: SearchProblem, layout: Layout,
                         budget: int) -> tuple[Layout, SimResult] | None:
    """A layout whose stages of one group may differ in degree (:func:`degree_mixes`) that
    the simulator finds faster than ``layout`` at the schedule kind each would keep
    (:func:`~.kinds.kept_kind_s`), or None: every mix scored by HAPT's formula, the best
    :data:`STAGE_MIX_REPLAYS` replayed (shortened, under H-1F1B), the best replay's boundaries
    refined (``budget`` replays), for ``options.tp_stage_rounds`` rounds (each from the last
    one's winner)."""
    if problem.options.tp_stage_rounds == 0:
        return None
    cm, mbs = problem.cost_model, layout.micro_batch_size
    m = problem.num_microbatches(mbs)
    cap = min(problem.num_layers, problem.options.max_stages or problem.num_layers)
    o = problem.options

    def kind_s(lay: Layout) -> float:
        return kept_kind_s(cm, lay, simulate_layout(cm, lay, m, exact=True), m, o.schedule,
                           o.weigh_kinds, o.virtual_stages)
    best_l, best_r = layout, simulate_layout(cm, layout, m)
    best_k = kind_s(layout)
    found = False
    for _ in range(problem.options.tp_stage_rounds):
        scored = []
        for key, shapes in degree_mixes(problem, best_l):
            if len(shapes) > cap:
                continue
            got = layout_on(problem, shapes, mbs)
            if got is not None:
                scored.append((got[0], key, got[1]))
        scored.sort(key=lambda x: x[:2])
        round_best: tuple[Layout, SimResult] | None = None
        for _, _, lay in scored[:STAGE_MIX_REPLAYS]:
            r = simulate_layout(cm, lay, m)
            if r.feasible and (round_best is None or better(r, round_best[1])):
                round_best = (lay, r)
        if round_best is None:
            break
        lay, r = refine_boundaries(problem, *round_best, budget)
        k = kind_s(lay)
        if k >= best_k * (1 - 1e-9):
            break
        best_l, best_r, best_k, found = lay, r, k, True
    return (best_l, best_r) if found else None

