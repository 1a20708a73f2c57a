"""Placement: which samples of each micro-batch a rank holds and with which ranks it trades them.

The action lists themselves are built and validated by :mod:`hapt_hf.planner.schedule`, one per
pipeline rank (the schedule's placement says which pipeline rank holds each stage); every
replica of a stage runs the list of the pipeline rank holding it. What this module adds is the
mapping onto global ranks when stages have several replicas and neighbouring stages differ in
width (8 GPUs then 4, 2 then 3):

* micro-batch ``k`` is samples ``[k*mbs, (k+1)*mbs)`` of the global batch;
* replica ``r`` of a stage owns the contiguous slice ``r`` of it: the replicas' shares
  (:meth:`Stage.shares`, even unless the plan gives each replica its ``samples``) laid end
  to end, ``[s_0 + .. + s_{r-1}, s_0 + .. + s_r)``;
* a rank exchanges with each rank of a neighbouring stage exactly the samples their two slices
  share: activations downstream, gradients back upstream over the same samples.

A replica held by ``t`` ranks together (tensor parallelism, its ``ranks`` in TP order) holds its
activations whole on each of them. A transfer between replicas of ``t_src`` ranks (the sender of
that direction) and ``t_dst`` ranks pairs each receiving TP rank ``d`` with sending TP rank
``d mod t_src``: activations reach receiver TP rank ``j`` from sender TP rank ``j mod t_s``;
gradients reach sender TP rank ``i`` from receiver TP rank ``i mod t_r``. With one rank per
replica both directions pair the same ranks, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from hapt_hf.core.shares import slices
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.core.schedules import ActionKind
from hapt_hf.planner.schedule import Action, Schedule, build_schedule

__all__ = ["Piece", "RankWork", "replica_slice", "pieces_between", "rank_work", "rank_works",
           "runtime_schedule", "max_in_flight", "replica_of_rank"]


@dataclass(frozen=True)
class Piece:
    """Samples of a micro-batch that this rank exchanges with one rank of a neighbouring stage."""

    peer: int
    """Global rank of the neighbour."""
    start: int
    """First sample, counted from the start of this rank's own slice."""
    stop: int
    """One past the last sample, counted from the start of this rank's own slice."""

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RankWork:
    """Everything one rank needs to run its part of an iteration."""

    rank: int
    stage: Stage
    num_stages: int
    replica: int
    """Position of this rank's replica among its stage's replicas."""
    samples: tuple[int, int]
    """This rank's slice of every micro-batch, ``[lo, hi)`` relative to the micro-batch (its
    replica's: every rank of a replica computes the same samples)."""
    upstream: tuple[Piece, ...]
    """Where activations come from (empty on the first stage)."""
    downstream: tuple[Piece, ...]
    """Where activations go (empty on the last stage)."""
    actions: tuple[Action, ...]
    tied_ranks: tuple[int, ...]
    """Ranks of the first and last stage (tied embeddings sum their gradients across them)."""
    upstream_grads: tuple[Piece, ...] = ()
    """Where the input's gradients go back to (the ``upstream`` samples; other ranks of the
    stage before when it is tensor-parallel)."""
    downstream_grads: tuple[Piece, ...] = ()
    """Where the output's gradients come from (the ``downstream`` samples)."""
    tp_ranks: tuple[int, ...] = ()
    """The ranks holding this rank's replica together, in tensor-parallel order (one: itself)."""

    @property
    def tp_rank(self) -> int:
        """This rank's position in its replica (0 without tensor parallelism)."""
        return self.tp_ranks.index(self.rank) if self.tp_ranks else 0

    @property
    def tp(self) -> int:
        """Ranks holding this rank's replica together."""
        return max(1, len(self.tp_ranks))

    @property
    def is_first(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        return self.stage.index == self.num_stages - 1


def replica_slice(micro_batch_size: int, stage: Stage, replica: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of a micro-batch owned by ``replica`` of ``stage``."""
    return slices(stage.shares(micro_batch_size))[replica]


def pieces_between(micro_batch_size: int, mine: tuple[int, int], neighbour: Stage, *,
                   tp_rank: int = 0, tp: int = 1, incoming: bool = True) -> tuple[Piece, ...]:
    """The overlaps of my slice ``mine`` with each replica of ``neighbour``, in sample order
    (what :func:`hapt_hf.core.shares.overlaps` counts for the planner's price of the cut),
    each with the rank of that replica this rank trades it with.

    ``tp_rank`` / ``tp``: my position in my replica and its size. ``incoming``: the samples
    come to me; TP rank ``d`` receives from the neighbour's TP rank ``d mod t_neighbour``.
    Outgoing: I send to each of the neighbour's TP ranks ``d`` with ``d mod tp == tp_rank``
    (none where ``tp_rank`` is past the neighbour's ranks)."""
    out = []
    for rep, (lo, hi) in zip(neighbour.replicas, slices(neighbour.shares(micro_batch_size))):
        a, b = max(lo, mine[0]), min(hi, mine[1])
        if a >= b:
            continue
        t = len(rep.ranks)
        peers = ([rep.ranks[tp_rank % t]] if incoming
                 else [rep.ranks[d] for d in range(t) if d % tp == tp_rank])
        out += [Piece(peer, a - mine[0], b - mine[0]) for peer in peers]
    return tuple(out)


def replica_of_rank(stage: Stage, rank: int) -> int:
    """Position, among ``stage``'s replicas, of the replica ``rank`` helps hold."""
    for i, rep in enumerate(stage.replicas):
        if rank in rep.ranks:
            return i
    raise ValueError(f"rank {rank} holds no replica of stage {stage.index}")


def runtime_schedule(plan: Plan) -> Schedule:
    """The lists the runtime runs for ``plan``: its kind, warm-ups, deferrals and pipeline
    ranks, each receive posted as soon as its sender may send."""
    return build_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmups(),
                          early_receives=True, num_ranks=plan.num_pipeline_ranks,
                          deferrals=plan.deferrals())


def rank_work(plan: Plan, rank: int, schedule: Schedule | None = None,
              stage: int | None = None) -> RankWork:
    """This rank's stage, slice, neighbours and action list under ``plan``: by default the
    list the runtime runs (:func:`runtime_schedule`). ``stage``: which of the rank's stages
    (an interleaved rank holds several; None: its only one)."""
    if schedule is None:
        schedule = runtime_schedule(plan)
    st = plan.stage_of_rank(rank) if stage is None else plan.stages[stage]
    replica = replica_of_rank(st, rank)
    tp_ranks = st.replicas[replica].ranks
    mbs = plan.micro_batch_size
    mine = replica_slice(mbs, st, replica)
    s = st.index
    me = {"tp_rank": tp_ranks.index(rank), "tp": len(tp_ranks)}
    up = up_grads = down = down_grads = ()
    if s > 0:
        up = pieces_between(mbs, mine, plan.stages[s - 1], incoming=True, **me)
        up_grads = pieces_between(mbs, mine, plan.stages[s - 1], incoming=False, **me)
    if s < plan.num_stages - 1:
        down = pieces_between(mbs, mine, plan.stages[s + 1], incoming=False, **me)
        down_grads = pieces_between(mbs, mine, plan.stages[s + 1], incoming=True, **me)
    tied = tuple(sorted(set(plan.stages[0].ranks) | set(plan.stages[-1].ranks)))
    return RankWork(rank, st, plan.num_stages, replica, mine, up, down,
                    schedule.actions[schedule.rank_of(s)], tied, up_grads, down_grads, tp_ranks)


def rank_works(plan: Plan, rank: int, schedule: Schedule | None = None) -> tuple[RankWork, ...]:
    """A :class:`RankWork` for each stage ``rank`` holds, in pipeline order (one but under an
    interleaved schedule); every one carries the rank's whole list."""
    if schedule is None:
        schedule = runtime_schedule(plan)
    return tuple(rank_work(plan, rank, schedule, st.index) for st in plan.stages_of_rank(rank))


def max_in_flight(actions: tuple[Action, ...] | list[Action]) -> int:
    """Most forwards whose backward has not ended yet (``B``, or ``W`` of a split backward: a
    deferred weight gradient keeps its micro-batch's activations), at any point of an action
    list, over all the stages it names."""
    live = peak = 0
    for a in actions:
        if a.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in (ActionKind.B, ActionKind.W):
            live -= 1
    return peak
