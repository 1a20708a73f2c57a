"""Event-driven replay of a pipeline schedule: iteration time, bubbles, memory, deadlock.

Rules of the replay (the same ones the runtime follows), one clock per pipeline rank:

* each pipeline rank runs its compute actions (``F``, ``B``, or a split backward's ``I`` and
  ``W``) one after another in list order, each priced by the stage it names; a split backward
  is priced from the stage's backward by :func:`backward_split`, but for the first stage of
  several, which has no input gradient to send: its ``I`` is empty and its ``W`` its whole
  backward (as the runtime runs it);
* a forward waits for its activation to arrive from the previous stage, a backward (``B`` or
  ``I``) for its gradient from the next stage; ``W`` waits only for its rank;
* a ``SEND`` starts when the stage reaches it in its list and the link direction is free: sends
  are eager (the receiver buffers), they overlap compute, and the transfers of one direction of
  one link between two pipeline ranks go one at a time, in the order they were posted (an
  interleaved rank pair's chunk boundaries share their link). A transfer holds the link for its
  bytes over the bandwidth and arrives the link's latency later: the next transfer goes on the
  link while the last one is in flight. ``RECV`` actions only post buffers and cost nothing;
* a stage all-reduces its gradients among its replicas in buckets that start during its last
  backward (the cost model's ``allreduce_lead_s`` before its end) and may run past it
  (``allreduce_after_s``); the optimizer step follows (on a stage with sharded optimizer state,
  then the all-gather of the updated weights), and the iteration ends when the last stage
  finishes.

A stage whose next action waits for something no stage will ever produce is a deadlock; the
result is then infeasible and ``reason`` says where every stage is stuck.

Memory: a stage holds a micro-batch's activations from its forward to the backward that ends
it (``B``, or ``W`` where the backward is split: the weight gradient needs the layers' inputs).
A rank holding several stages (interleaved) holds all of theirs at once: its peak is taken over
the sum of its stages' activations as the replay runs, plus their weights and state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hapt_hf.core.defaults import DEFAULT_MEMORY_HEADROOM
from hapt_hf.core.schedules import ActionKind, RankLists, schedule_generator

from .cluster import Cluster
from .cost_model import CostModel, StageCost, StageCosts
from .model_spec import ModelSpec
from .plan import Plan
from .profile import Profile, load_sailor_profiles
from .schedule import Schedule, build_schedule

__all__ = ["SimEvent", "SimResult", "simulate_schedule", "simulate_plan", "replay",
           "encode_schedule", "backward_split", "WEIGHT_GRADIENT_SHARE"]

WEIGHT_GRADIENT_SHARE = 0.5
"""The share of a stage's backward (its recomputed forward left out) that is the weight
gradient ``W``, where the cost model gives no split: a block's matmuls cost as much for the
gradient of their input as for that of their weight (each is one matmul of the forward's
size); the rest (``I``) carries the norms, activations and attention core, which have no
weights, so the true share is a little under one half."""


def backward_split(cost: StageCost, weight_share: float | None = None
                   ) -> tuple[float, float]:
    """(input-gradient ``I``, weight-gradient ``W``) seconds of one micro-batch's backward on
    a stage. Of the backward less the recomputed forward of an activation-checkpointed stage
    (which runs before ``I``): with ``weight_share`` given, that share is ``W`` and the rest
    ``I`` (``I + W = B``); left None, the stage's measured split where it has one
    (``StageCost.split_ratios``: ``I`` and ``W`` each its ratio of it, which may sum above
    ``B``), else :data:`WEIGHT_GRADIENT_SHARE`."""
    recomputed = cost.forward_s if cost.recompute else cost.recompute_s
    rest = max(cost.backward_s - recomputed, 0.0)
    if weight_share is None and cost.split_ratios is not None:
        ri, rw = cost.split_ratios
        return recomputed + ri * rest, rw * rest
    share = WEIGHT_GRADIENT_SHARE if weight_share is None else weight_share
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"weight_share must lie in [0, 1], got {share}")
    w = rest * share
    return cost.backward_s - w, w


@dataclass(frozen=True)
class SimEvent:
    stage: int
    kind: str
    """'F', 'B', 'I', 'W', 'SEND_F', 'SEND_B', 'ALLREDUCE', 'UPDATE' or 'ALLGATHER' (the
    updated weights of a sharded optimizer state)."""
    microbatch: int
    """-1 for ALLREDUCE, UPDATE and ALLGATHER."""
    start: float
    end: float
    rank: int = -1
    """The pipeline rank the stage sits on (-1: not recorded; the stage's own index where
    each rank holds one stage)."""


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    bubble_fraction: float
    stage_busy_s: tuple[float, ...]
    """Forward + backward compute seconds of each stage (one replica)."""
    peak_memory_bytes: tuple[float, ...]
    """Per stage, one GPU (a rank holding several stages: that rank's GPU, all of them)."""
    events: tuple[SimEvent, ...]
    feasible: bool
    reason: str = ""
    """Why the plan cannot run (deadlock, memory), empty when feasible."""
    peak_in_flight: tuple[int, ...] = ()
    """Most micro-batches whose activations a stage held at once (until their ``B``, or their
    ``W`` where the backward is split)."""


_F, _B, _SF, _SB, _RECV, _I, _W = 0, 1, 2, 3, 4, 5, 6
_CODE = {ActionKind.F: _F, ActionKind.B: _B, ActionKind.SEND_F: _SF, ActionKind.SEND_B: _SB,
         ActionKind.RECV_F: _RECV, ActionKind.RECV_B: _RECV, ActionKind.I: _I,
         ActionKind.W: _W}
_NAME = {_F: "F", _B: "B", _SF: "SEND_F", _SB: "SEND_B", _RECV: "RECV", _I: "I", _W: "W"}
_COMPUTES = tuple(c in (_F, _B, _I, _W) for c in range(max(_NAME) + 1))
"""Indexed by code: whether the action computes (``F``, ``B``, ``I``, ``W``)."""


def _encode(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    return [[(_CODE[a.kind], a.stage, a.microbatch) for a in lst] for lst in schedule.actions]


def encode_schedule(kind: str, num_stages: int, num_microbatches: int,
                    warmups: tuple[int, ...] | list[int],
                    num_ranks: int | None = None,
                    deferrals: tuple[int | None, ...] | None = None) -> RankLists:
    """The replay's view of ``build_schedule(kind, n, m, warmups, num_ranks=, deferrals=)``
    without building Action objects (the search replays thousands of candidates): each
    pipeline rank's list of ``(code, stage, micro-batch)`` from the kind's generator, receives
    left out because posting one costs nothing here, and the placement (the pipeline rank of
    each stage)."""
    gen = schedule_generator(kind)
    p = num_stages if num_ranks is None else num_ranks
    extra = {} if deferrals is None else {"deferrals": deferrals}
    return gen.generate(num_stages, num_microbatches, gen.run_depths(warmups, num_microbatches, p),
                        receives=False, tokens=_CODE, num_ranks=num_ranks, **extra)


def simulate_schedule(schedule: Schedule, costs: StageCosts,
                      record_events: bool = True) -> SimResult:
    """Replay ``schedule`` with the durations of ``costs`` (one StageCost per stage; a split
    backward priced by :func:`backward_split`)."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"the schedule has {schedule.num_stages} stages but "
                         f"{costs.num_stages} stage costs were given; give one per stage")
    return replay(_encode(schedule), schedule.placement, costs, record_events)


def replay(lists, placement: Sequence[int], costs: StageCosts,
           record_events: bool = True,
           weight_share: float | Sequence[float | None] | None = None) -> SimResult:
    """The event loop over encoded per-rank lists of ``(code, stage, micro-batch)`` (see
    :func:`encode_schedule`), ``placement[stage]`` the pipeline rank holding each stage: one
    clock per pipeline rank; arrivals, links, memory and the all-reduce per stage.
    ``weight_share``: how a split backward divides (:func:`backward_split`), one share for
    every stage or one per stage; None: each stage's measured split where the cost model has
    one, else :data:`WEIGHT_GRADIENT_SHARE`."""
    ranks = len(lists)
    st = costs.stages
    n = len(st)
    pos = [0] * ranks
    clock = [0.0] * ranks
    busy = [0.0] * n
    in_flight = [0] * n
    peak = [0] * n
    act_arr: list[dict[int, float]] = [{} for _ in range(n)]   # activation arrived at stage s
    grad_arr: list[dict[int, float]] = [{} for _ in range(n)]  # gradient arrived at stage s
    last_b = [0.0] * n     # end of the stage's last backward so far
    # each link direction between two pipeline ranks is one queue: an interleaved rank's
    # chunks send over the same link (v stage boundaries per pair of ranks), one at a time
    fl, bl = _link_ids(placement, n)
    fwd_free = [0.0] * (max(fl) + 1)   # link direction rank(s) -> rank(s+1) free from
    bwd_free = [0.0] * (max(bl) + 1)   # link direction rank(s) -> rank(s-1) free from
    events: list[SimEvent] = []
    remaining = sum(len(l) for l in lists)
    last = n - 1
    # each stage's durations as plain lists: the loop below runs once per action
    fwd_s = [c.forward_s for c in st]
    bwd_s = [c.backward_s for c in st]
    sf_s = [c.send_forward_s for c in st]
    sf_lat = [c.send_forward_latency_s for c in st]
    sb_s = [c.send_backward_s for c in st]
    sb_lat = [c.send_backward_latency_s for c in st]
    shares = [weight_share] * n if weight_share is None or isinstance(weight_share, (int, float)) \
        else list(weight_share)
    if len(shares) != n:
        raise ValueError(f"{len(shares)} weight shares given for {n} stages; give one, or one "
                         "per stage")
    split = [backward_split(c, w) for c, w in zip(st, shares)]
    if n > 1:  # the first stage has no input gradient to send: its W is its whole backward
        split[0] = (0.0, st[0].backward_s)
    in_s = [x[0] for x in split]
    wgt_s = [x[1] for x in split]
    # a rank holding several stages: the activations of all of them at once
    multi = len(set(placement)) < n
    if multi:
        act_b = [c.memory_use(1)[0] - c.memory_use(0)[0] for c in st]
        held_b = [0.0] * ranks
        peak_b = [0.0] * ranks
    while remaining:
        progressed = False
        for r in range(ranks):
            lst, p = lists[r], pos[r]
            t = clock[r]
            stop = len(lst)
            while p < stop:
                code, s, mb = lst[p]
                if _COMPUTES[code]:
                    if code == _F:
                        ready = act_arr[s].get(mb) if s > 0 else 0.0
                        dur = fwd_s[s]
                    elif code == _W:  # after its own I, which the list orders before it
                        ready = 0.0
                        dur = wgt_s[s]
                    else:
                        ready = grad_arr[s].get(mb) if s < last else 0.0
                        dur = bwd_s[s] if code == _B else in_s[s]
                    if ready is None:
                        break
                    start = t if t > ready else ready
                    t = start + dur
                    busy[s] += dur
                    if code == _F:
                        in_flight[s] += 1
                        if in_flight[s] > peak[s]:
                            peak[s] = in_flight[s]
                        if multi:
                            held_b[r] += act_b[s]
                            if held_b[r] > peak_b[r]:
                                peak_b[r] = held_b[r]
                    elif code != _I:  # B or W: the micro-batch's activations are freed
                        in_flight[s] -= 1
                        last_b[s] = t
                        if multi:
                            held_b[r] -= act_b[s]
                    if record_events:
                        events.append(SimEvent(s, _NAME[code], mb, start, t, r))
                elif code == _SF:
                    link = fl[s]
                    start = t if t > fwd_free[link] else fwd_free[link]
                    end = start + sf_s[s]
                    fwd_free[link] = end - sf_lat[s]
                    act_arr[s + 1][mb] = end
                    if record_events:
                        events.append(SimEvent(s, "SEND_F", mb, start, end, r))
                elif code == _SB:
                    link = bl[s]
                    start = t if t > bwd_free[link] else bwd_free[link]
                    end = start + sb_s[s]
                    bwd_free[link] = end - sb_lat[s]
                    grad_arr[s - 1][mb] = end
                    if record_events:
                        events.append(SimEvent(s, "SEND_B", mb, start, end, r))
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r] = p
                clock[r] = t
                progressed = True
        if not progressed:
            stuck = "; ".join(f"stage {lists[r][pos[r]][1]} waits at {lists[r][pos[r]][1]}"
                              f"{_NAME[lists[r][pos[r]][0]]}{lists[r][pos[r]][2]}"
                              for r in range(ranks) if pos[r] < len(lists[r]))
            return SimResult(float("inf"), 1.0, tuple(busy), _peaks(st, peak, placement),
                             tuple(events),
                             False, f"deadlock: {stuck}; give every stage a warm-up depth "
                             "no smaller than the next stage's", tuple(peak))
    ends = []
    free = list(clock)  # a rank holding several stages updates them one after another
    for s in range(n):
        c, r = st[s], placement[s]
        # the buckets overlap the last backward; the step waits for the last one
        reduced = last_b[s] + c.allreduce_after_s
        t1 = max(free[r], reduced)
        t2 = t1 + c.update_s
        if record_events:
            events.append(SimEvent(s, "ALLREDUCE", -1, last_b[s] - c.allreduce_lead_s,
                                   reduced if multi else t1, r))
            events.append(SimEvent(s, "UPDATE", -1, t1, t2, r))
        if c.allgather_s > 0:  # sharded state: the updated weights reach every replica
            if record_events:
                events.append(SimEvent(s, "ALLGATHER", -1, t2, t2 + c.allgather_s, r))
            t2 += c.allgather_s
        free[r] = t2
        ends.append(max(t2, fwd_free[fl[s]], bwd_free[bl[s]]))
    iteration = max(ends)
    bubble = 1.0 - (sum(busy) / ranks) / iteration if iteration > 0 else 0.0
    if multi:
        peaks, reason = _rank_memory(st, placement, peak_b)
    else:
        peaks = _peaks(st, peak, placement)
        reason = _memory_reason(st, peaks, peak)
    return SimResult(iteration, bubble, tuple(busy), peaks, tuple(events), not reason, reason,
                     tuple(peak))


def _link_ids(placement: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """Each stage's forward and backward link as an index into one queue per direction of a
    pair of pipeline ranks (one stage per rank: stage ``s``'s own links, numbered ``s``)."""
    if len(set(placement)) == n:
        return list(range(n)), list(range(n))
    ids: dict[tuple[int, int], int] = {}
    fl = [ids.setdefault((placement[s], placement[s + 1]), len(ids)) if s + 1 < n else -1
          for s in range(n)]
    bl = [ids.setdefault((placement[s], placement[s - 1]), len(ids)) if s > 0 else -1
          for s in range(n)]
    spare = len(ids)  # the first stage's backward and the last's forward link: never used
    return [spare if x < 0 else x for x in fl], [spare if x < 0 else x for x in bl]


def _peaks(st, peak: list[int], placement: Sequence[int]) -> tuple[float, ...]:
    # a stage whose replicas differ: its GPU with the least memory to spare
    if len(set(placement)) < len(st):  # deadlocked interleaved replay: an upper bound
        per_rank: dict[int, float] = {}
        for c, k, r in zip(st, peak, placement):
            per_rank[r] = per_rank.get(r, 0.0) + c.memory_use(k)[0]
        return tuple(per_rank[r] for r in placement)
    return tuple(c.memory_use(k)[0] for c, k in zip(st, peak))


def _rank_memory(st, placement: Sequence[int],
                 peak_b: list[float]) -> tuple[tuple[float, ...], str]:
    """Each stage's GPU where ranks hold several stages: the rank's stages' weights, state and
    working memory (each stage's ``memory_use(0)``; their working memory counted for every
    stage, an upper bound) plus its peak of their activations together; the reason why a rank
    does not fit, or empty."""
    static: dict[int, float] = {}
    cap: dict[int, float] = {}
    for c, r in zip(st, placement):
        use, usable = c.memory_use(0)
        static[r] = static.get(r, 0.0) + use
        cap[r] = min(cap.get(r, usable), usable) if usable > 0 else cap.get(r, 0.0)
    total = {r: static[r] + peak_b[r] for r in static}
    over = [r for r in sorted(total) if cap.get(r, 0.0) > 0 and total[r] > cap[r]]
    reason = "; ".join(
        f"pipeline rank {r} (stages {[s for s, q in enumerate(placement) if q == r]}) needs "
        f"{total[r] / 1e9:.2f} GB per GPU but {cap[r] / 1e9:.2f} GB are usable" for r in over)
    return tuple(total[r] for r in placement), reason


def _memory_reason(st, peaks: tuple[float, ...], in_flight: list[int]) -> str:
    caps = [c.memory_use(k)[1] for c, k in zip(st, in_flight)]
    over = [(i, p, cap) for i, (p, cap) in enumerate(zip(peaks, caps))
            if cap > 0 and p > cap]
    if not over:
        return ""
    return "; ".join(f"stage {i} needs {p / 1e9:.2f} GB per GPU but {cap / 1e9:.2f} GB are usable"
                     for i, p, cap in over)


def simulate_plan(plan: Plan, model: ModelSpec, cluster: Cluster, profile: Profile | None = None,
                  record_events: bool = True,
                  memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                  cost_model: CostModel | None = None) -> SimResult:
    """Price ``plan`` with the cost model and replay its schedule."""
    if cost_model is None and profile is None and cluster.profiles is not None:
        profile = load_sailor_profiles(cluster.profiles, model)
    cm = cost_model or CostModel(model, cluster, profile, memory_headroom=memory_headroom)
    if plan.num_layers != model.num_layers:
        raise ValueError(f"the plan covers {plan.num_layers} layers but model {model.name!r} has "
                         f"{model.num_layers}; plan again for this model")
    costs = cm.plan_costs(plan)
    sched = build_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                           plan.warmups(), validate=False, num_ranks=plan.num_pipeline_ranks,
                           deferrals=plan.deferrals())
    return simulate_schedule(sched, costs, record_events)
