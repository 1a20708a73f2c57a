"""Schedule-free lower bounds: how fast any plan over a given layout could possibly be.

A *layout* here is the stages (each a slice of one group's GPUs, in pipeline order, and its layer
range) and the micro-batch size; what it leaves open is every warm-up depth and every recompute
flag.
:func:`lower_bound_s` gives a time no replay of the layout can beat, whatever those are, from
facts the simulator cannot avoid (stage ``i``, ``M`` micro-batches):

* it starts no earlier than the first micro-batch's forwards and cuts before it:
  ``start_i = sum_{j<i} (f_j + cut_j)``;
* it then computes ``M (f_i + b_i)`` one action after another;
* a micro-batch holds its activations on stage ``i`` from the start of its forward to the end of
  its backward, at least ``RTT_i = f_i + b_i + sum_{j>i} (f_j + b_j) + 2 sum_{j>=i} cut_j``, and
  memory holds at most ``k_i`` of them at once, so its last backward ends no earlier than
  ``start_i + ceil(M / k_i) RTT_i``;
* after its last backward come its exposed all-reduce and its optimizer step, and the last
  micro-batch's gradient still has to pass the stages before it
  (``sum_{j<i} (b_j + cut_j)``, then stage 0's own all-reduce and step).

Recompute lengthens ``b_i`` but raises ``k_i`` and shortens the exposed all-reduce, and sharded
optimizer state raises ``k_i`` for another step time, so each stage takes the smallest of its
bounds. :func:`layouts_below` enumerates every layout (every group
order, every way to cut each group into stages of any widths, optionally groups visited more
than once, every micro-batch size, every contiguous layer partition) whose bound is below a
target: a plan faster than the target can only be among them, so replaying those few settles
whether one exists (``benchmarks/plan_bound.py``).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hapt_hf.core.schedules import ScheduleKind, warmups_from_steps

from hapt_hf.planner.cluster import Cluster, GpuGroup
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.plan import Replica, Stage
from hapt_hf.planner.search import (Layout, SearchProblem, divisors, group_cuts, recompute_flags,
                                    simulate_layout)
from hapt_hf.planner.search.state import state_options
from hapt_hf.planner.simulate import SimResult

__all__ = ["BoundedLayout", "stage_sequences", "sequence_replicas", "lower_bound_s",
           "layouts_below", "best_warmup_replay"]


@dataclass(frozen=True)
class BoundedLayout:
    """A layout whose lower bound is below the target it was enumerated for: its stages
    (replicas and layer ranges; warm-ups, recompute and optimizer state left open)."""

    stages: tuple[Stage, ...]
    micro_batch_size: int
    lower_bound_s: float


def stage_sequences(cluster: Cluster, interleave: bool = False):
    """Every sequence of stages over all GPUs whose neighbours are linked, each stage as
    ``(group, width, offset)``: ``width`` GPUs of ``group`` from its ``offset``-th. Each group
    is cut into stages of any widths; the groups one after another or, with ``interleave``, a
    group's stages also split by another group's."""
    groups = cluster.groups
    linked = {frozenset((l.a, l.b)) for l in cluster.links}
    for split in itertools.product(*(list(group_cuts(g.size)) for g in groups)):
        owners = [gi for gi, ws in enumerate(split) for _ in ws]
        # each distinct order of owners, a group's stages keeping their widths' order
        for order in sorted(set(itertools.permutations(owners))):
            if not interleave and len([k for k, _ in itertools.groupby(order)]) != len(groups):
                continue
            if any(a != b and frozenset((groups[a].name, groups[b].name)) not in linked
                   for a, b in zip(order, order[1:])):
                continue
            nxt, off, seq = [0] * len(groups), [0] * len(groups), []
            for gi in order:
                w = split[gi][nxt[gi]]
                seq.append((groups[gi], w, off[gi]))
                nxt[gi] += 1
                off[gi] += w
            yield tuple(seq)


def sequence_replicas(cm: CostModel, sequence: tuple[tuple[GpuGroup, int, int], ...],
                      mbs: int) -> tuple[tuple[Replica, ...], ...]:
    """Each stage's replicas of a :func:`stage_sequences` sequence at micro-batch size ``mbs``."""
    return tuple(cm.slice_replicas(g, w, off, mbs) for g, w, off in sequence)


@dataclass(frozen=True)
class _Stage:
    """One stage's figures for the bound, per micro-batch, for one recompute setting."""

    f: float
    b: float
    tail: float
    slots: int


def _stage_options(cm: CostModel, replicas: tuple[Replica, ...], a: int, b: int, mbs: int,
                   m: int, allow_rc: bool) -> list[_Stage]:
    sh = cm.placement(replicas)
    s = mbs // sh.width
    cap = cm.capacity_bytes(sh.group)
    out = []
    # sharded optimizer state frees memory (more slots) for a different step: both are options
    for rc, opt in itertools.product((False, True) if allow_rc else (False,),
                                     state_options(sh.width, True)):
        f, bw = cm.compute_s(sh.group, s, a, b, rc, sh.tp)  # a replica's ranks at its degree
        act = cm.activation_bytes(s, a, b, rc, sh.tp)
        free = (cap - cm.static_bytes(a, b, opt, sh.width, sh.tp)
                - cm.working_bytes(s, a, b, sh.tp))
        slots = m if act <= 0 and free >= 0 else int(free // act) if act > 0 else 0
        if slots < 1:
            continue
        tail = (cm.allreduce_window(replicas, a, b, rc).exposed_s
                + cm.optimizer_step_s(replicas, s, a, b, opt))
        out.append(_Stage(f, bw, tail, min(slots, m)))
    return out


def _stage_bound(st: _Stage, m: int, start: float, rtt_rest: float, drain: float) -> float:
    """Stage end bound: ``rtt_rest`` is the round trip beyond the stage's own compute,
    ``drain`` what follows its last backward before the iteration can end."""
    last_b = start + max(m * (st.f + st.b), math.ceil(m / st.slots) * (st.f + st.b + rtt_rest))
    return last_b + max(st.tail, drain)


def lower_bound_s(cm: CostModel, stages, mbs: int, num_microbatches: int,
                  allow_recompute: bool = True) -> float:
    """No replay of these stages (their replicas and layer ranges), whatever their warm-ups and
    recompute flags, is faster; inf if no setting fits a stage's memory (see the module's
    docstring)."""
    m, n = num_microbatches, len(stages)
    shapes = [s.replicas for s in stages]
    bounds = [s.layers for s in stages]
    opts = [_stage_options(cm, sh, a, b, mbs, m, allow_recompute)
            for sh, (a, b) in zip(shapes, bounds)]
    if not all(opts):
        return math.inf
    cuts = [cm.cut_s(shapes[i], shapes[i + 1], bounds[i][1] - 1, mbs) for i in range(n - 1)]
    fast = [min(o, key=lambda s: s.b) for o in opts]  # recompute off where it fits
    tail0 = min(s.tail for s in opts[0])
    best = 0.0
    start = drain = 0.0
    for i in range(n):
        rest = sum(fast[j].f + fast[j].b for j in range(i + 1, n)) + 2 * sum(cuts[i:])
        after = drain + tail0 if i else 0.0
        best = max(best, min(_stage_bound(s, m, start, rest, after) for s in opts[i]))
        if i < n - 1:
            start += fast[i].f + cuts[i]
            drain += fast[i].b + cuts[i]
    return best


def layouts_below(problem: SearchProblem, target_s: float, interleave: bool = False
                  ) -> tuple[list[BoundedLayout], int]:
    """Every layout whose :func:`lower_bound_s` is below ``target_s``, lowest bound first, and
    how many stage sequences were looked at (the problem's ``allow_recompute`` and
    ``max_stages`` hold). Stages are pruned as they are placed: the bound of a stage's own
    start, compute, memory and tail only grows as later stages are added."""
    cm = problem.cost_model
    allow_recompute, max_stages = problem.allow_recompute, problem.options.max_stages
    L = cm.model.num_layers
    out, sequences = [], 0
    for sequence in stage_sequences(cm.cluster, interleave):
        sequences += 1
        n = len(sequence)
        if n > L or (max_stages and n > max_stages):
            continue
        lcm = math.lcm(*(w for _, w, _ in sequence))
        for mbs in divisors(problem.global_batch_size):
            if mbs % lcm:
                continue
            m = problem.num_microbatches(mbs)
            shapes = sequence_replicas(cm, sequence, mbs)
            for bounds in _partitions(cm, shapes, mbs, m, target_s, allow_recompute):
                stages = tuple(Stage(i, bnd, reps)
                               for i, (reps, bnd) in enumerate(zip(shapes, bounds)))
                lb = lower_bound_s(cm, stages, mbs, m, allow_recompute)
                if lb < target_s:
                    out.append(BoundedLayout(stages, mbs, lb))
    out.sort(key=lambda x: (x.lower_bound_s, len(x.stages), x.micro_batch_size,
                            tuple(s.layers for s in x.stages)))
    return out, sequences


def _partitions(cm: CostModel, shapes, mbs: int, m: int, target: float, allow_rc: bool):
    """Contiguous partitions whose every stage's partial bound stays below ``target``."""
    n, L = len(shapes), cm.model.num_layers

    def rec(i: int, a: int, start: float, acc: list):
        sh = shapes[i]
        p = cm.placement(sh)
        t = cm.table(p.group, mbs // p.width, p.tp)
        for b in ([L] if i == n - 1 else range(a + 1, L - (n - 1 - i) + 1)):
            if start + m * (t.fb[b] - t.fb[a]) >= target:
                break  # every later end only adds compute
            opts = _stage_options(cm, sh, a, b, mbs, m, allow_rc)
            cut = cm.cut_s(sh, shapes[i + 1], b - 1, mbs) if i < n - 1 else 0.0
            if not opts or min(_stage_bound(s, m, start, 2 * cut, 0.0) for s in opts) >= target:
                continue
            if i == n - 1:
                yield tuple(acc + [(a, b)])
            else:
                f = t.fwd[b] - t.fwd[a]
                yield from rec(i + 1, b, start + f + cut, acc + [(a, b)])

    yield from rec(0, 0, 0.0, [])


def best_warmup_replay(problem: SearchProblem, bl: BoundedLayout, max_replays: int = 4096
                       ) -> tuple[Layout, SimResult] | None:
    """The fastest full H-1F1B replay of ``bl`` over every warm-up depth whose steps along the
    pipeline are 1..k (k as large as ``max_replays`` replays allow, at most 8), each stage
    recomputing only where it does not fit without (and the problem's ``allow_recompute``
    lets it); None if no depth fits memory."""
    cm, allow_recompute = problem.cost_model, problem.allow_recompute
    n, m = len(bl.stages), problem.num_microbatches(bl.micro_batch_size)
    shapes = [s.replicas for s in bl.stages]
    bounds = [s.layers for s in bl.stages]
    k = 8 if n == 1 else max(1, min(8, int(round(max_replays ** (1 / (n - 1)), 6))))
    best = None
    seen = set()
    for steps in itertools.product(range(1, k + 1), repeat=n - 1):
        warm = warmups_from_steps(steps, m)
        if warm in seen:
            continue
        seen.add(warm)
        rc = recompute_flags(cm, shapes, bounds, bl.micro_batch_size, warm, allow_recompute)
        if rc is None:
            continue
        lay = Layout.build(shapes, bounds, rc, bl.micro_batch_size, warm,
                           ScheduleKind.H1F1B.value)
        r = simulate_layout(cm, lay, m, exact=True)
        if r.feasible and (best is None or r.iteration_s < best[1].iteration_s):
            best = (lay, r)
    return best
