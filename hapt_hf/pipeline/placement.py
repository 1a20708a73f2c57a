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
  share: activations downstream, gradients back upstream over the same pieces.
"""
from __future__ import annotations

from dataclasses import dataclass

from hapt_hf.core.shares import slices
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.core.schedules import ActionKind
from hapt_hf.planner.schedule import Action, Schedule, build_schedule

__all__ = ["Piece", "RankWork", "replica_slice", "pieces_between", "rank_work", "max_in_flight"]


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
    """Position of this rank among its stage's replicas."""
    samples: tuple[int, int]
    """This rank's slice of every micro-batch, ``[lo, hi)`` relative to the micro-batch."""
    upstream: tuple[Piece, ...]
    """Where activations come from and gradients go back to (empty on the first stage)."""
    downstream: tuple[Piece, ...]
    """Where activations go and gradients come from (empty on the last stage)."""
    actions: tuple[Action, ...]
    tied_ranks: tuple[int, ...]
    """Ranks of the first and last stage (tied embeddings sum their gradients across them)."""

    @property
    def is_first(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        return self.stage.index == self.num_stages - 1


def replica_slice(micro_batch_size: int, stage: Stage, replica: int) -> tuple[int, int]:
    """Samples ``[lo, hi)`` of a micro-batch owned by ``replica`` of ``stage``."""
    return slices(stage.shares(micro_batch_size))[replica]


def pieces_between(micro_batch_size: int, mine: tuple[int, int],
                   neighbour: Stage) -> tuple[Piece, ...]:
    """The overlaps of my slice ``mine`` with each replica of ``neighbour``, in sample order
    (what :func:`hapt_hf.core.shares.overlaps` counts for the planner's price of the cut)."""
    out = []
    for peer, (lo, hi) in zip(neighbour.ranks, slices(neighbour.shares(micro_batch_size))):
        a, b = max(lo, mine[0]), min(hi, mine[1])
        if a < b:
            out.append(Piece(peer, a - mine[0], b - mine[0]))
    return tuple(out)


def rank_work(plan: Plan, rank: int, schedule: Schedule | None = None) -> RankWork:
    """This rank's stage, slice, neighbours and action list under ``plan``: by default the
    list the runtime runs, each receive posted as soon as its sender may send."""
    if schedule is None:
        schedule = build_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                                  plan.warmups(), early_receives=True)
    stage = plan.stage_of_rank(rank)
    replica = stage.ranks.index(rank)
    mbs = plan.micro_batch_size
    mine = replica_slice(mbs, stage, replica)
    s = stage.index
    up = pieces_between(mbs, mine, plan.stages[s - 1]) if s > 0 else ()
    down = pieces_between(mbs, mine, plan.stages[s + 1]) if s < plan.num_stages - 1 else ()
    tied = tuple(sorted(set(plan.stages[0].ranks) | set(plan.stages[-1].ranks)))
    return RankWork(rank, stage, plan.num_stages, replica, mine, up, down,
                    schedule.actions[schedule.rank_of(s)], tied)


def max_in_flight(actions: tuple[Action, ...] | list[Action]) -> int:
    """Most forwards whose backward has not run yet, at any point of an action list."""
    live = peak = 0
    for a in actions:
        if a.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind is ActionKind.B:
            live -= 1
    return peak
