"""Brute-force search for tiny jobs: the yardstick the planner is checked against.

Enumerates every order of the groups (neighbours linked), every way to cut each group into
stages of any widths (ordered compositions of its size), every contiguous layer partition with
no empty stage, every micro-batch size the widths allow, and every warm-up depth per stage
(H-1F1B: depths that fall strictly along the pipeline by 1 to ``max_warmup_step`` per stage,
ending at 1), and replays each candidate in the simulator. Recompute is switched on for a stage
only when it does not fit without. Exponential: meant for a handful of layers and GPUs.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hapt_hf.core.schedules import default_warmups, plan_sets_warmups, warmups_from_steps
from hapt_hf.errors import PlanningError

from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Plan
from hapt_hf.planner.profile import Profile
from hapt_hf.planner.search import (Layout, PlannerOptions, SearchProblem, compositions, divisors, group_cuts,
                                    group_orders, layout_to_plan, recompute_flags, shapes_for, simulate_layout)
from hapt_hf.planner.simulate import SimResult

__all__ = ["ExhaustiveResult", "exhaustive_plan"]


@dataclass(frozen=True)
class ExhaustiveResult:
    plan: Plan
    sim: SimResult
    candidates: int
    """How many feasible candidates were replayed."""


def _warmup_choices(n: int, m: int, schedule: str, max_step: int):
    if not plan_sets_warmups(schedule):
        yield tuple(default_warmups(schedule, n, m))
        return
    seen = set()
    for steps in itertools.product(range(1, max_step + 1), repeat=n - 1):
        clamped = warmups_from_steps(steps, m)  # depths beyond M all behave as M
        if clamped not in seen:
            seen.add(clamped)
            yield clamped


def exhaustive_plan(model: ModelSpec, cluster: Cluster, global_batch_size: int,
                    profile: Profile | None = None, options: PlannerOptions = PlannerOptions(),
                    max_warmup_step: int = 3, max_candidates: int = 200_000) -> ExhaustiveResult:
    """The fastest feasible plan over the whole (small) space; PlanningError if none fits."""
    problem = SearchProblem.build(model, cluster, global_batch_size, profile, options)
    cm = problem.cost_model
    L = model.num_layers
    best: tuple[float, int, Layout, SimResult] | None = None
    count = 0
    for order in group_orders(cluster):
        for split in itertools.product(*(list(group_cuts(g.size)) for g in order)):
            widths = {g.name: ws for g, ws in zip(order, split)}
            n = sum(len(ws) for ws in split)
            if n > L or (options.max_stages and n > options.max_stages):
                continue
            lcm = math.lcm(*(w for ws in split for w in ws))
            for mbs in divisors(global_batch_size):
                if mbs % lcm or (options.micro_batch_sizes and mbs not in
                                 options.micro_batch_sizes):
                    continue
                shapes = shapes_for(cm, order, widths, mbs)
                m = problem.num_microbatches(mbs)
                for sizes in compositions(L, n):
                    edges = list(itertools.accumulate(sizes, initial=0))
                    bounds = tuple(zip(edges, edges[1:]))
                    for warm in _warmup_choices(n, m, options.schedule, max_warmup_step):
                        rc = recompute_flags(cm, shapes, bounds, mbs, warm,
                                              options.allow_recompute)
                        if rc is None:
                            continue
                        lay = Layout.build(shapes, bounds, rc, mbs, warm, options.schedule)
                        r = simulate_layout(cm, lay, m, exact=True)
                        count += 1
                        if count > max_candidates:
                            raise PlanningError(f"more than {max_candidates} candidates: this "
                                                "case is too large to enumerate")
                        if r.feasible and (best is None or r.iteration_s < best[0]):
                            best = (r.iteration_s, count, lay, r)
    if best is None:
        raise PlanningError(f"no plan of model {model.name!r} fits cluster {cluster.name!r}")
    _, _, lay, r = best
    return ExhaustiveResult(layout_to_plan(problem, lay, r).validate(), r, count)
