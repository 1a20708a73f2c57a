"""plan_job: the search over each layer unit, the baselines as candidates, the final plan."""
from __future__ import annotations

import time
from dataclasses import replace

from hapt_hf.core.layers import BLOCK, HALF, block_boundary_in_halves
from hapt_hf.core.precision import REPLICATED, SHARDED
from hapt_hf.core.schedules import ScheduleKind
from hapt_hf.core.tp import TP_DEGREES
from hapt_hf.errors import PlanningError

from ..cluster import Cluster
from ..cost_model import CostModel
from ..model_spec import ModelSpec
from ..plan import Plan
from ..profile import Profile
from ..simulate import SimResult
from .baselines import baseline_plans
from .candidates import search_layouts
from .data_parallel import data_parallel
from .infeasible import does_not_fit
from .kinds import best_kind, kept_kind_s
from .mixed import mixed_candidate
from .options import BaselineResult, Layout, PlannerOptions, PlanResult
from .plans import cluster_profile, layout_of_plan, layout_to_plan, physical_limit_s
from .problem import SearchProblem
from .refine import as_schedule, refine_boundaries
from .replays import simulate_layout
from .shapes import require_chain
from .state import sharding_reasons
from .subsets import choose_groups
from .tensor_parallel import choose_degrees, group_degrees, refine_stage_degrees
from .warmups import refine_warmups

__all__ = ["plan_job"]


def plan_job(model: ModelSpec, cluster: Cluster, global_batch_size: int,
             profile: Profile | None = None,
             options: PlannerOptions = PlannerOptions()) -> PlanResult:
    """Search the plan with the least simulated iteration time that fits every GPU's memory.

    ``options.layer_unit`` says whether stages may end inside a block (its attention half on one
    stage, its MLP half on the next); baselines always cut whole blocks, as frameworks do.
    Unless ``options.all_groups``, sets of groups with the others idle are weighed too
    (:mod:`~hapt_hf.planner.search.subsets`); the plan names the groups it leaves idle, and its
    ranks are numbered over the groups it uses. Up to ``options.max_tp``, each group's
    replicas may be several GPUs of one node (tensor parallelism,
    :mod:`~hapt_hf.planner.search.tensor_parallel`), kept where the simulator finds that
    faster or where nothing fits without."""
    t0 = time.perf_counter()
    if global_batch_size < 1:
        raise PlanningError(f"global_batch_size {global_batch_size} must be >= 1")
    if not cluster.groups:
        raise PlanningError(f"cluster {cluster.name!r} has no groups; list at least one")
    if options.micro_batch_sizes is not None and \
            not any(global_batch_size % m == 0 for m in options.micro_batch_sizes):
        raise PlanningError(f"micro_batch_sizes {list(options.micro_batch_sizes)}: none divides "
                            f"global_batch_size {global_batch_size}; give a divisor of it")
    # a cluster whose groups form no chain is a mistake in its file, not a reason to idle some
    require_chain(cluster)
    profile = profile if profile is not None else cluster_profile(cluster, model)
    problem = SearchProblem.build(model, cluster, global_batch_size, profile, options)
    best, idle, choices, whole = choose_groups(
        cluster, lambda sub: _plan_on(problem.on(sub)), lambda sub: _limit_if_fits(problem, sub),
        options.all_groups or cluster.world_size > options.weigh_groups_max_gpus)
    plan, baselines = best.plan, best.baselines
    if idle:
        if whole is not None:
            # the baselines are what other systems make of the whole cluster: the plan is set
            # beside those, not beside their splits of the groups it keeps
            baselines = whole.baselines
            plan = replace(plan, baselines=whole.plan.baselines)
        plan = replace(plan, idle_groups=idle).validate()
    # the limit stays the whole cluster's: idle GPUs are GPUs the job could have used
    return replace(best, plan=plan, baselines=baselines,
                   search_time_s=time.perf_counter() - t0,
                   physical_limit_s=physical_limit_s(problem),
                   group_choices=choices if len(cluster.groups) > 1 else ())


def _limit_if_fits(problem: SearchProblem, sub: Cluster) -> float | None:
    """The physical limit of a set of groups, or None where even one stage per GPU cannot
    hold the model's weights and optimizer state (every stage holds its layers' share)."""
    cm = problem.cost_model
    if sum(cm.capacity_bytes(g) * g.size for g in sub.groups) < \
            cm.static_bytes(0, cm.model.num_layers):
        return None
    return physical_limit_s(problem.on(sub))


def _plan_on(problem: SearchProblem) -> PlanResult:
    """The search on every group of the problem's cluster: each layer unit, the baselines as
    candidates, then tensor-parallel degrees per group where they are faster (or where only
    they fit)."""
    t0 = time.perf_counter()
    asked = problem.options.schedule
    if asked in _AFTER_SEARCH:  # the pipeline is searched under H-1F1B, the kind set on it
        problem = problem.with_options(schedule=ScheduleKind.H1F1B.value)
    options = problem.options
    baselines: dict[str, BaselineResult] = {}
    if options.include_baselines:
        baselines = baseline_plans(problem)
    # above weigh_groups_max_gpus, where tensor parallelism may win, the plan without it is
    # first found by a shortened search like each degree screen's (one search there costs
    # several screens), and searched in full only where it wins
    screened = options.max_tp > 1 and \
        problem.hardware.world_size > options.weigh_groups_max_gpus and \
        any(group_degrees(problem, g) != [1] for g in problem.hardware.groups)
    failure = None
    try:
        best = _best_layout(problem.with_options(**_SCREEN) if screened else problem, baselines)
    except PlanningError as e:
        best, failure = None, e
    pipelines = []
    if options.max_tp > 1:
        base_s = _kind_s(best, asked) if best else None
        got = _tensor_parallel(problem, base_s, asked)
        if got is not None and (best is None or _kind_s(got[0], asked) < base_s):
            before = best[3] if best else 0
            pipelines = [(g[0], g[1], g[2], g[3] + before) for g in got]
    if not pipelines and best is None:
        raise failure
    if not pipelines and screened:
        best = _best_layout(problem, baselines)
    pipelines = pipelines or [best]
    final, unit, lay, tried = pipelines[0]
    weighed: tuple = ()
    if asked in _AFTER_SEARCH or (asked == ScheduleKind.H1F1B and options.weigh_kinds):
        # the kinds weighed on each finalist (the stages at their own degrees and, where that
        # refined it, the screen's pipeline they came from): a pipeline a little slower under
        # H-1F1B can fill its bubbles better
        kinds = []
        for i, (f, u, l, _) in enumerate(pipelines):
            try:
                got_k = best_kind(u.cost_model, l, f, u.num_microbatches(l.micro_batch_size),
                                  asked, options.virtual_stages)
            except PlanningError:
                if i == 0:  # the kind asked for cannot run the search's pipeline
                    raise
                continue
            kinds.append((got_k[1].iteration_s, i, u, got_k))
        _, i, unit, (lay, final, weighed) = min(kinds, key=lambda k: k[:2])
    base_times = {k: b.sim.iteration_s for k, b in baselines.items()
                  if b.sim is not None and b.sim.feasible}
    plan = layout_to_plan(unit, lay, final, base_times).validate()
    return PlanResult(plan, final, baselines, time.perf_counter() - t0,
                      physical_limit_s(problem), tried,
                      sharding=sharding_reasons(unit.cost_model, plan, final.peak_in_flight),
                      schedule_kinds=weighed)


_AFTER_SEARCH = (ScheduleKind.ZERO_BUBBLE, ScheduleKind.INTERLEAVED)
"""Kinds set on the pipeline the search finds under H-1F1B (:mod:`.kinds`)."""


def _kind_s(found: tuple[SimResult, SearchProblem, Layout, int], asked: str) -> float:
    """What a pipeline the search found replays in at the schedule kind the plan will keep:
    where the kinds are weighed (``asked`` H-1F1B and ``weigh_kinds``), the fastest of them
    (:func:`~.kinds.best_kind`, a few full replays), so the tensor-parallel screen and the
    choice between degrees compare pipelines as the plan will run them (a pipeline H-1F1B
    likes may fill its bubbles worse under zero_bubble); else its own replay."""
    sim, unit, lay, _ = found
    return kept_kind_s(unit.cost_model, lay, sim, unit.num_microbatches(lay.micro_batch_size),
                       asked, unit.options.weigh_kinds, unit.options.virtual_stages)


_SCREEN = dict(simulate_top=2, simulate_top_cheap=2, max_refine_simulations=16, patience=100,
               max_expansions=400)


def _tensor_parallel(problem: SearchProblem, base_s: float | None, asked: str
                     ) -> list[tuple[SimResult, SearchProblem, Layout, int]] | None:
    """The best plan with tensor-parallel degrees above 1 in some group, where the screen
    finds one faster than ``base_s`` (the plan without at the kind it keeps; None: nothing
    fits without): its stages at their own degrees first, then the screen's pipeline where
    that differs. Each assignment of degrees is weighed at the schedule kind its pipeline
    keeps (:func:`_kind_s`)."""
    units = [problem.options.layer_unit]
    cm = problem.cost_model
    if units[0] != HALF and problem.options.allow_sequence_parallel and \
            any(cm.sp_allowed(t) for t in TP_DEGREES) and cm.model.layer_unit == BLOCK:
        # sequence parallelism runs whole blocks only, and where it is allowed it is what
        # lets a replica hold more of them; halves where whole blocks do not fit
        units = [BLOCK, HALF] if problem.model.can_split_blocks else [BLOCK]
    elif units[0] != BLOCK and problem.model.can_split_blocks:
        # with t GPUs a replica holds few blocks: halves balance them; where halves do not
        # fit (recomputed halves keep twice the inputs), whole blocks
        units = [HALF] if units[0] == HALF else [HALF, BLOCK]

    def weigh(p: SearchProblem):
        for unit in units:
            try:
                got = _best_layout(p.with_options(layer_unit=unit, **_SCREEN), {})
            except PlanningError:
                continue
            return _kind_s(got, asked), got
        return None

    tp, screened, _ = choose_degrees(problem, weigh, base_s)
    if tp is None:
        return None
    best = screened
    # the winner searched again with the user's options, where a search is cheap (above
    # weigh_groups_max_gpus a search costs several screens: there the screen's plan stands)
    if problem.hardware.world_size <= problem.options.weigh_groups_max_gpus:
        try:
            full = _best_layout(problem.with_tp(tp), {})
        except PlanningError:
            full = None
        if full is not None and _kind_s(full, asked) <= _kind_s(screened, asked):
            best = full
    return _stage_degrees(best, asked)


def _stage_degrees(best: tuple[SimResult, SearchProblem, Layout, int], asked: str
                   ) -> list[tuple[SimResult, SearchProblem, Layout, int]]:
    """``best`` with its stages of one group at degrees of their own, where the simulator
    finds that faster at the kind it would keep (:func:`~.tensor_parallel.refine_stage_degrees`),
    then ``best``."""
    final, unit, lay, tried = best
    got = refine_stage_degrees(unit, lay, unit.options.max_refine_simulations)
    if got is None:
        return [best]
    r = simulate_layout(unit.cost_model, got[0],
                        unit.num_microbatches(got[0].micro_batch_size), exact=True,
                        record_events=True)
    if r.feasible and _kind_s((r, unit, got[0], tried), asked) < _kind_s(best, asked):
        return [(r, unit, got[0], tried), best]
    return [best]


def _best_layout(problem: SearchProblem, baselines: dict[str, BaselineResult]
                 ) -> tuple[SimResult, SearchProblem, Layout, int]:
    """(full replay, problem of its layer unit, layout, partitions tried) of the best plan at
    the problem's tensor-parallel degrees: each layer unit's search, stages that mix groups
    and one data-parallel stage where the options allow them; raises where nothing fits."""
    options = problem.options
    one_degree = len(set(problem.tp.values())) == 1
    found, tried, failure = [], 0, None
    for unit_model in _unit_models(problem.model, options.layer_unit):
        unit = problem.with_model(unit_model)
        try:
            lay, final, n = _search_unit(unit, baselines)
        except PlanningError as e:  # the other unit may still fit
            failure = failure or e
            continue
        tried += n
        found.append((final.iteration_s, len(found), unit, lay, final))
    if options.allow_mixed_stages and found and set(problem.tp.values()) == {1}:
        # stages over several groups, shares by speed: from the best pipeline (its group
        # boundaries merged) and column layouts; after the pipelines, so they win a tie
        _, _, unit, lay, final = min(found, key=lambda f: f[:2])
        got = mixed_candidate(unit, lay, final)
        if got is not None:
            r = simulate_layout(unit.cost_model, got[0],
                                unit.num_microbatches(got[0].micro_batch_size), exact=True,
                                record_events=True)
            if r.feasible:
                found.append((r.iteration_s, len(found), unit, got[0], r))
    dp_at = -1
    if options.allow_uneven_dp and one_degree:
        # one stage of every GPU, shares by speed: a candidate of its own, never cut, so it
        # skips the partition and refinements; last in line, so a pipeline wins a tie
        states = (REPLICATED, SHARDED) if options.allow_sharded_optimizer else (REPLICATED,)
        dp = data_parallel(problem, even=False, optimizers=states)
        if dp.layout is not None:
            dp_at = len(found)
            found.append((dp.sim.iteration_s, dp_at, problem, dp.layout, dp.sim))
    if not found:
        raise failure
    _, i, unit, lay, final = min(found, key=lambda f: f[:2])
    if i == dp_at:  # its full replay with events, as the search's own final plans have
        final = simulate_layout(problem.cost_model, lay,
                                problem.num_microbatches(lay.micro_batch_size), exact=True,
                                record_events=True)
    return final, unit, lay, tried


def _unit_models(model: ModelSpec, layer_unit: str) -> list[ModelSpec]:
    """The layer sequences to search: whole blocks, halves, or both (blocks first)."""
    if model.layer_unit == HALF or layer_unit == BLOCK:
        return [model]
    if layer_unit == HALF:
        try:
            return [model.split_blocks()]
        except ValueError as e:
            raise PlanningError(str(e)) from None
    return [model, model.split_blocks()] if model.can_split_blocks else [model]


def _in_units(cm: CostModel, plan: Plan) -> Layout:
    """A whole-block (baseline) plan as a layout over ``cm``'s layer sequence."""
    lay = layout_of_plan(cm, plan)
    if cm.model.layer_unit == plan.layer_unit:
        return lay
    half = {b: block_boundary_in_halves(b, plan.num_blocks()) for bnd in lay.bounds for b in bnd}
    return lay.with_layers([(half[a], half[b]) for a, b in lay.bounds], lay.recompute,
                           lay.optimizers)


def _within(plan: Plan | None, options: PlannerOptions) -> bool:
    """Whether a baseline's plan may stand as the planner's: the user's limits hold for it
    (the baselines are scored whatever they are, for comparison)."""
    return plan is not None and \
        (options.max_stages is None or plan.num_stages <= options.max_stages) and \
        (options.allow_sharded_optimizer or all(s.optimizer == REPLICATED for s in plan.stages))


def _search_unit(problem: SearchProblem,
                 baselines: dict[str, BaselineResult]) -> tuple[Layout, SimResult, int]:
    """The best layout over the problem's layer sequence, never slower than a baseline's."""
    cm, options = problem.cost_model, problem.options
    top, tried = search_layouts(problem)
    scored: list[tuple[SimResult, Layout]] = []
    # the analytic ranking is rough: replay more candidates when replays are cheap
    top = [sc for i, sc in enumerate(top) if i < options.simulate_top or
           sc.layout.num_stages * problem.num_microbatches(sc.layout.micro_batch_size) <= 512]
    for sc in top:
        lay, r = refine_warmups(problem, sc.layout)
        scored.append((r, lay))
    usable = [b for b in baselines.values() if _within(b.plan, options)]
    for b in usable:
        lay = as_schedule(_in_units(cm, b.plan), options.schedule, b.plan.num_microbatches)
        scored.append((simulate_layout(cm, lay, b.plan.num_microbatches), lay))
    own = len(top)
    feasible = [(r.iteration_s, i, lay, r) for i, (r, lay) in enumerate(scored) if r.feasible]
    if not feasible:
        raise does_not_fit(problem)
    feasible.sort(key=lambda x: x[:2])
    # the partition balances compute only; moving boundaries by simulation also weighs
    # transfers, all-reduce and the optimizer step, so every finalist gets a share of it:
    # the search's own candidates and the best baseline
    finalists = [(r, lay) for _, i, lay, r in feasible if i < own]
    finalists += [(r, lay) for _, i, lay, r in feasible if i >= own][:1]
    share = max(options.max_refine_simulations // len(finalists), 8)
    refined = []
    for r, lay in finalists:
        lay, r = refine_boundaries(problem, lay, r, share)
        lay, r = refine_warmups(problem, lay, r)
        refined.append((r.iteration_s, len(refined), lay))
    _, _, lay = min(refined)
    final = simulate_layout(cm, lay, problem.num_microbatches(lay.micro_batch_size), exact=True,
                            record_events=True)
    if not final.feasible:  # extrapolation cannot change feasibility; guard anyway
        raise PlanningError(f"the chosen plan cannot run: {final.reason}")
    # never return a plan slower than a baseline's (the extrapolated ranking could err)
    for b in usable:
        if b.sim is None or not b.sim.feasible or \
                b.sim.iteration_s >= final.iteration_s:
            continue
        blay = as_schedule(_in_units(cm, b.plan), options.schedule, b.plan.num_microbatches)
        r = simulate_layout(cm, blay, b.plan.num_microbatches, exact=True, record_events=True)
        if r.feasible and r.iteration_s < final.iteration_s:
            lay, final = blay, r
    return lay, final, tried
