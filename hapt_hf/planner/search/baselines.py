"""The splits other systems make, built in the same code and scored by the same simulator.

* ``uniform`` (Megatron-LM / torchtitan default): the blocks split evenly over the stages, the
  embedding on the first stage and the head on the last;
* ``param_balanced`` (DeepSpeed ``partition_method="parameters"``): stages with as equal
  parameter counts as contiguous ranges allow;
* ``speed_proportional`` (Whale-like): each stage's share of the forward + backward FLOPs in
  proportion to its GPUs' speed;
* ``hapt_recipe`` (HAPT's published recipe): the groups in file order (a fixed chain), stages
  of a power-of-two number of GPUs inside one node, layers by the min-max partition under
  memory, the configuration chosen by HAPT's pipeline formula, and H-1F1B warm-ups from its
  1/2/3 thresholds;
* ``zero1_ddp`` (DeepSpeed ZeRO stage 1, torch's ``ZeroRedundancyOptimizer`` under DDP): no
  pipeline, one stage holding the whole model on every GPU with its Adam moments sharded among
  them and every micro-batch split evenly; only where the model fits every GPU so.
* ``ddp`` (equal-share data parallelism, what ``accelerate launch`` does): one stage, the
  whole model on every GPU, every GPU the same share of each micro-batch, at the micro-batch
  size it runs fastest with; only where the model fits every GPU
  (:mod:`~hapt_hf.planner.search.data_parallel`).

The first three run plain 1F1B with the same data-parallel width on every stage (what those
frameworks require: world = pipeline x data parallel), the groups in file order; each gets the
width and micro-batch size its own estimate likes best (the two best are replayed and the
faster kept), and recompute on the stages that do not fit without it.
"""
from __future__ import annotations

import itertools
import math
from bisect import bisect_left

from hapt_hf.core.layers import num_blocks
from hapt_hf.core.precision import SHARDED
from hapt_hf.core.schedules import ScheduleKind
from hapt_hf.errors import CostModelError

from ..cost_model import CostModel
from .options import BaselineResult, Layout
from .partition import (balanced_step_s, cut_times, estimate_s, partition_layers,
                        recompute_flags, smallest_feasible_cap)
from .data_parallel import data_parallel
from .plans import layout_to_plan
from .problem import SearchProblem
from .replays import simulate_layout
from .shapes import divisors, micro_batch_options, shapes_for
from .warmups import hapt_warmups, in_flight_guess

__all__ = ["BASELINES", "baseline_plans", "equal_share_ddp"]

BASELINES = ("uniform", "param_balanced", "speed_proportional", "hapt_recipe", "ddp", "zero1_ddp")


def _uniform(cm: CostModel, shapes, mbs: int) -> list[int] | None:
    """Cut points: blocks split evenly, embedding first, head last."""
    n, L = len(shapes), cm.model.num_layers
    blocks = num_blocks(L)
    if n > blocks:
        return None
    q, r = divmod(blocks, n)
    cuts, at = [], 1
    for i in range(n - 1):
        at += q + (1 if i < r else 0)
        cuts.append(at)
    return cuts


def _balanced_by(prefix: list[float], n: int) -> list[int] | None:
    """Cut points of the min-max contiguous partition of weights (given as prefix sums)."""
    L = len(prefix) - 1
    if n > L:
        return None

    def greedy(cap: float):
        cuts, a = [], 0
        for i in range(n - 1):
            b = a + 1
            while b < L - (n - i - 2) - 1 and prefix[b + 1] - prefix[a] <= cap:
                b += 1
            cuts.append(b)
            a = b
        return cuts if prefix[L] - prefix[a] <= cap else None

    return smallest_feasible_cap(greedy, 0.0, prefix[L], greedy(prefix[L]))[1]


def _param_balanced(cm: CostModel, shapes, mbs: int) -> list[int] | None:
    return _balanced_by(list(cm.params), len(shapes))


def _speed_proportional(cm: CostModel, shapes, mbs: int) -> list[int] | None:
    n, L = len(shapes), cm.model.num_layers
    if n > L:
        return None
    flops = [0.0]
    for l in cm.model.layers:
        flops.append(flops[-1] + l.fwd_flops + l.bwd_flops)
    speed = [sh.width / cm.sample_time_s(sh.group, mbs // sh.width, sh.tp)
             for sh in map(cm.placement, shapes)]
    total, acc, cuts, prev = sum(speed), 0.0, [], 0
    for i in range(n - 1):
        acc += speed[i]
        target = flops[-1] * acc / total
        b = bisect_left(flops, target)
        if b > 0 and target - flops[b - 1] < flops[b] - target:
            b -= 1
        b = max(prev + 1, min(b, L - (n - 1 - i)))
        cuts.append(b)
        prev = b
    return cuts


_SPLITS = {"uniform": _uniform, "param_balanced": _param_balanced,
           "speed_proportional": _speed_proportional}


def _with_memory(cm: CostModel, shapes, cuts: list[int], mbs: int, warm, allow_rc: bool):
    """Bounds and recompute flags (on only where needed), or None if a stage cannot fit."""
    edges = [0, *cuts, cm.model.num_layers]
    bounds = tuple(zip(edges, edges[1:]))
    rcs = recompute_flags(cm, shapes, bounds, mbs, warm, allow_rc)
    return None if rcs is None else (bounds, rcs)


def _framework_layouts(problem: SearchProblem, name: str):
    cm, options = problem.cost_model, problem.options
    groups = cm.cluster.groups
    common = math.gcd(*(g.size for g in groups))
    for w in divisors(common):
        if problem.global_batch_size % w:
            continue
        widths = {g.name: (w,) * (g.size // w) for g in groups}
        for mbs in micro_batch_options(problem.global_batch_size, [w],
                                       options.micro_batch_sizes):
            shapes = shapes_for(cm, groups, widths, mbs)
            m = problem.num_microbatches(mbs)
            cuts = _SPLITS[name](cm, shapes, mbs)
            if cuts is None:
                continue
            warm = hapt_warmups(shapes, [0.0] * (len(shapes) - 1), 1.0, m,
                                ScheduleKind.ONE_F_ONE_B)
            got = _with_memory(cm, shapes, cuts, mbs, warm, problem.allow_recompute)
            if got is not None:
                yield Layout.build(shapes, got[0], got[1], mbs, warm, ScheduleKind.ONE_F_ONE_B)


def _hapt_layouts(problem: SearchProblem):
    cm = problem.cost_model
    groups = cm.cluster.groups
    per_group = []
    for g in groups:
        ws = [w for w in (1 << k for k in range(12)) if w <= g.gpus_per_node
              and g.gpus_per_node % w == 0 and problem.global_batch_size % w == 0]
        per_group.append(ws)
    for combo in itertools.product(*per_group):
        widths = {g.name: (w,) * (g.size // w) for g, w in zip(groups, combo)}
        for mbs in micro_batch_options(problem.global_batch_size, list(combo),
                                       problem.options.micro_batch_sizes):
            shapes = shapes_for(cm, groups, widths, mbs)
            m = problem.num_microbatches(mbs)
            inflight = in_flight_guess(shapes, mbs, m, ScheduleKind.H1F1B, cm,
                                       balanced_step_s(cm, shapes, mbs))
            part = partition_layers(cm, shapes, mbs, inflight, problem.allow_recompute)
            if part is None:
                continue
            warm = hapt_warmups(shapes, cut_times(cm, shapes, part.bounds, mbs), part.cap_s, m,
                                ScheduleKind.H1F1B)
            yield Layout.build(shapes, part.bounds, part.recompute, mbs, warm,
                               ScheduleKind.H1F1B)


def _zero1_ddp(problem: SearchProblem) -> BaselineResult:
    """One stage over every GPU, equal shares, sharded optimizer state, or why there is none."""
    dp = data_parallel(problem, even=True, optimizers=(SHARDED,))
    if dp.layout is None:
        return BaselineResult("zero1_ddp", None, None, dp.reason)
    return BaselineResult("zero1_ddp", layout_to_plan(problem, dp.layout, dp.sim), dp.sim)


def _best(problem: SearchProblem, layouts, name: str) -> BaselineResult:
    cm = problem.cost_model
    ranked = sorted(((estimate_s(cm, l, problem.num_microbatches(l.micro_batch_size)), i, l)
                     for i, l in enumerate(layouts)), key=lambda x: (x[0], x[1]))
    if not ranked:
        return BaselineResult(name, None, None, "no configuration of this split fits the "
                              "GPUs' memory (or the global batch allows no common width)")
    # HAPT picks by its formula alone; the framework baselines get the better of their two best
    keep = ranked[:1] if name == "hapt_recipe" else ranked[:2]
    best = None
    for _, _, lay in keep:
        r = simulate_layout(cm, lay, problem.num_microbatches(lay.micro_batch_size), exact=True)
        if best is None or (r.feasible, -r.iteration_s) > (best[0].feasible, -best[0].iteration_s):
            best = (r, lay)
    r, lay = best
    if not r.feasible:
        return BaselineResult(name, None, r, r.reason)
    return BaselineResult(name, layout_to_plan(problem, lay, r), r)


def equal_share_ddp(problem: SearchProblem) -> BaselineResult:
    """The ``ddp`` baseline: one stage of every GPU, equal shares, where the model fits."""
    dp = data_parallel(problem, even=True)
    if dp.layout is None:
        return BaselineResult("ddp", None, None, dp.reason)
    return BaselineResult("ddp", layout_to_plan(problem, dp.layout, dp.sim), dp.sim)


def baseline_plans(problem: SearchProblem) -> dict[str, BaselineResult]:
    """Every baseline's plan for this problem, scored by the simulator (exact replay)."""
    out = {}
    for name in BASELINES:
        if name == "zero1_ddp":
            out[name] = _zero1_ddp(problem)
            continue
        if name == "ddp":
            out[name] = equal_share_ddp(problem)
            continue
        try:
            layouts = (list(_hapt_layouts(problem)) if name == "hapt_recipe"
                       else list(_framework_layouts(problem, name)))
            out[name] = _best(problem, layouts, name)
        except CostModelError as e:
            # these splits keep the groups in file order; unlinked neighbours rule them out
            out[name] = BaselineResult(name, None, None, f"groups in file order: {e}")
    return out
