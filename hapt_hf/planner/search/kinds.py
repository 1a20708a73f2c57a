"""The schedule kind, weighed on the search's best pipeline: ``zero_bubble`` and ``interleaved``.

The search finds its partition, replicas and warm-ups under H-1F1B. On that pipeline this
step replays the other kinds the runtime runs and keeps the fastest that fits memory:

* ``zero_bubble`` with the same warm-ups and each stage's deferral cut to what its GPU holds
  (:func:`~hapt_hf.core.schedules.fitting_deferrals` over
  :meth:`~hapt_hf.planner.cost_model.StageCost.most_held`): the weight gradients fill the
  bubbles, a deferred one keeping its micro-batch's activations until its ``W``;
* ``interleaved`` with ``v`` chunks per pipeline rank (2 and 3 by default): each stage's layers
  cut into ``v`` chunks (:meth:`~hapt_hf.planner.plan.Plan.interleave`), the fill about ``v``
  times shorter, ``v`` times the stage-boundary transfers on each link (the replay queues a
  link's transfers of every chunk one after another) and a rank holding its chunks'
  activations together.

Each candidate is replayed in full with the same cost model, memory included; a plan keeps
its H-1F1B schedule unless another kind is faster by more than :data:`MIN_GAIN`.
"""
from __future__ import annotations

from dataclasses import replace

from hapt_hf.core.schedules import ScheduleKind, fitting_deferrals
from hapt_hf.errors import CostModelError, PlanError, PlanningError

from ..cost_model import CostModel
from ..plan import Plan
from ..simulate import SimResult, encode_schedule, replay
from .options import Layout

__all__ = ["MIN_GAIN", "VIRTUAL_STAGES", "replay_kind", "zero_bubble_layout",
           "interleaved_layout", "best_kind", "kept_kind_s"]

VIRTUAL_STAGES = (2, 3)
"""The chunks per rank weighed for ``interleaved`` unless the user names one."""
MIN_GAIN = 0.005
"""Another kind replaces H-1F1B only where its replay is this much faster (a split backward
and v times the transfers cost the runtime more than the replay sees: a graph walk per
micro-batch, a message per chunk)."""


def replay_kind(cm: CostModel, layout: Layout, num_microbatches: int,
                record_events: bool = False) -> SimResult:
    """The full replay of ``layout`` under its own kind: its pipeline ranks (an interleaved
    layout's stages on ``n / v`` ranks, ranks told apart by their replicas) and the deferrals
    its stages set."""
    stages = layout.stages
    ranks = len({frozenset(r for rep in s.replicas for r in rep.ranks) for s in stages})
    deferrals = None
    if any(s.deferral is not None for s in stages):
        deferrals = tuple(s.deferral for s in stages)
    lists, placement = encode_schedule(layout.schedule, len(stages), num_microbatches,
                                       layout.warmups, num_ranks=ranks, deferrals=deferrals)
    return replay(lists, placement, cm.stage_costs(stages, layout.micro_batch_size),
                  record_events)


def zero_bubble_layout(cm: CostModel, layout: Layout, num_microbatches: int) -> Layout:
    """``layout`` (one stage per rank) under ``zero_bubble``: the same warm-ups, each stage's
    deferral the rule's cut to the micro-batches its GPU holds."""
    m = num_microbatches
    costs = cm.stage_costs(layout.stages, layout.micro_batch_size)
    held = [c.most_held(m) for c in costs.stages]
    fit = fitting_deferrals(layout.warmups, m, held)
    return Layout(tuple(replace(s, deferral=d) for s, d in zip(layout.stages, fit)),
                  layout.micro_batch_size, ScheduleKind.ZERO_BUBBLE.value)


def interleaved_layout(layout: Layout, num_microbatches: int, virtual: int) -> Layout | None:
    """``layout`` (one stage per rank) as ``virtual`` chunks per rank, each stage's layers cut
    as evenly as they go, the interleaved kind's own warm-ups; None where a stage holds fewer
    layers than chunks."""
    try:
        plan = _as_plan(layout, num_microbatches).interleave(virtual)
    except PlanError:
        return None
    return Layout(plan.stages, layout.micro_batch_size, plan.schedule)


def _as_plan(layout: Layout, m: int) -> Plan:
    # Plan.interleave only reads the stages, the schedule and the micro-batches
    n = sum(s.num_layers for s in layout.stages)
    return Plan(model_name="", num_layers=n, seq_len=1,
                global_batch_size=m * layout.micro_batch_size,
                micro_batch_size=layout.micro_batch_size, num_microbatches=m,
                schedule=layout.schedule, stages=layout.stages)


def best_kind(cm: CostModel, layout: Layout, sim: SimResult, num_microbatches: int,
              schedule: str, virtual_stages: int | None = None
              ) -> tuple[Layout, SimResult, tuple[tuple[str, float | None], ...]]:
    """The fastest of ``layout`` (its full replay ``sim``) and its other kinds that fits:
    (layout, full replay with events, every kind weighed with its time or None where it
    does not fit or cannot be built; ``layout``'s own first where it is weighed too).

    ``schedule`` is the kind the user asked for: ``h1f1b`` weighs ``zero_bubble`` and
    ``interleaved`` at each of :data:`VIRTUAL_STAGES` (or ``virtual_stages``) beside the
    layout's own; ``zero_bubble`` or ``interleaved`` returns that kind (the search ran
    H-1F1B), or raises where it cannot run the plan; any other kind returns ``layout``."""
    m = num_microbatches
    if layout.num_stages < 2 or schedule not in (ScheduleKind.H1F1B, ScheduleKind.ZERO_BUBBLE,
                                                 ScheduleKind.INTERLEAVED):
        return layout, sim, ()
    own = schedule == ScheduleKind.H1F1B
    # no kind makes a rank's compute shorter: where the layout's idle time is under MIN_GAIN
    # of its iteration, none can win (a cheap bound; replays of thousands of micro-batches
    # are not)
    if own and sim.iteration_s - max(sim.stage_busy_s) < MIN_GAIN * sim.iteration_s:
        return layout, sim, ()
    vs = (virtual_stages,) if virtual_stages else VIRTUAL_STAGES
    cands: list[tuple[str, Layout | None]] = []
    if schedule in (ScheduleKind.H1F1B, ScheduleKind.ZERO_BUBBLE):
        cands.append(("zero_bubble", zero_bubble_layout(cm, layout, m)))
    if schedule in (ScheduleKind.H1F1B, ScheduleKind.INTERLEAVED):
        cands += [(f"interleaved v={v}", interleaved_layout(layout, m, v)) for v in vs]
    weighed: list[tuple[str, float | None]] = [("h1f1b", sim.iteration_s)] if own else []
    best: tuple[Layout, SimResult] | None = (layout, sim) if own else None
    unbuilt: dict[str, str] = {}
    for name, lay in cands:
        # with events: the winner's replay is the plan's (a second replay costs as much)
        try:
            r = replay_kind(cm, lay, m, record_events=True) if lay is not None else None
        except CostModelError as e:
            # e.g. an interleaved layout's wrap from its last rank to its first, between
            # groups the cluster does not link: this kind cannot run the pipeline
            r, unbuilt[name] = None, str(e)
        ok = r is not None and r.feasible
        weighed.append((name, r.iteration_s if ok else None))
        if not ok:
            continue
        bar = best[1].iteration_s * ((1 - MIN_GAIN) if best[0] is layout else 1.0) \
            if best is not None else float("inf")
        if r.iteration_s < bar:
            best = (lay, r)
    if best is None:
        why = "".join(f"; {n}: {e}" for n, e in unbuilt.items())
        raise PlanningError(f"schedule {schedule!r} does not fit the search's best pipeline of "
                            f"{layout.num_stages} stages ({', '.join(n for n, _ in weighed)} "
                            f"weighed{why}); plan with schedule 'h1f1b', or more memory "
                            "headroom")
    return best[0], best[1], tuple(weighed)


def kept_kind_s(cm: CostModel, layout: Layout, sim: SimResult, num_microbatches: int,
                schedule: str, weigh: bool, virtual_stages: int | None = None) -> float:
    """What ``layout`` (its H-1F1B replay ``sim``) replays in at the kind its plan would keep:
    where the kinds are weighed (``schedule`` H-1F1B and ``weigh``), the fastest that fits
    (:func:`best_kind`: a few full replays); else ``sim``'s time. The tensor-parallel screen
    and the degrees per stage compare pipelines by it: one that H-1F1B likes may fill its
    bubbles worse than another under ``zero_bubble``."""
    if schedule != ScheduleKind.H1F1B or not weigh or not sim.feasible:
        return sim.iteration_s
    try:
        got = best_kind(cm, layout, sim, num_microbatches, schedule, virtual_stages)
    except PlanningError:
        return sim.iteration_s
    return got[1].iteration_s
