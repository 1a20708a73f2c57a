"""Pipeline schedules as data: each pipeline rank's action list (every kind of
:mod:`hapt_hf.core.schedules`).

As in torch.distributed.pipelining, a schedule is a list of actions per pipeline rank (a
position along the pipeline), each action naming its (virtual) stage, kind and micro-batch,
printed as ``"1F3"`` (stage 1, forward, micro-batch 3) or ``"2RECV_B0"``; the schedule's
``placement`` says which pipeline rank holds each stage. Every global rank holding a replica of
a position's stage runs that position's list. The same lists are validated here, replayed with
durations by :mod:`hapt_hf.planner.simulate`, drawn, and executed by the runtime.

Semantics the runtime and the simulator share:

* ``F``/``B`` compute one micro-batch; they wait for the receive that feeds them. A split
  backward runs ``I`` (the input gradient: it waits for the gradient from stage+1, and its
  result is sent to stage-1, as ``B``'s) then ``W`` (the weight gradient: it waits for nothing
  but its own ``I`` and sends nothing).
* ``RECV_F``/``RECV_B`` *post* a non-blocking receive (activation from stage-1 / gradient from
  stage+1); posting never blocks. The communication pass posts each receive one compute action
  ahead, so the transfer overlaps the compute before it.
* ``SEND_F``/``SEND_B`` post a non-blocking send of what the preceding compute produced.

No torch here: the planner, the simulator and the runtime all read these objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hapt_hf.core.schedules import (BACKWARDS, COMPUTE, ActionKind, default_warmups,
                                    schedule_generator)
from hapt_hf.errors import ScheduleError

__all__ = [
    "ActionKind", "Action", "Schedule", "ScheduleError",
    "default_warmups", "build_schedule", "validate_schedule", "format_grid",
]


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"1RECV_F3"`` -> Action(1, RECV_F, 3)."""
        i = 0
        while i < len(text) and text[i].isdigit():
            i += 1
        j = len(text)
        while j > i and text[j - 1].isdigit():
            j -= 1
        if i == 0 or j == len(text):
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F3'")
        return cls(int(text[:i]), ActionKind(text[i:j]), int(text[j:]))


@dataclass(frozen=True)
class Schedule:
    """Each pipeline rank's action list for one iteration, and where each stage sits."""

    name: str
    num_stages: int
    num_microbatches: int
    warmups: tuple[int, ...]
    """Each stage's warm-up depth as the lists run it."""
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    """``actions[p]`` is the list every global rank at pipeline rank ``p`` executes, in order;
    each action names its stage."""
    placement: tuple[int, ...] = ()
    """``placement[s]``: the pipeline rank holding stage ``s`` (empty: stage ``s`` on rank
    ``s``)."""

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", tuple(range(self.num_stages)))

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks: positions along the pipeline, one action list each."""
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank (1 but for interleaved schedules)."""
        return self.num_stages // max(self.num_ranks, 1)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` holds, in pipeline order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return self.placement[stage]

    def stage_actions(self, stage: int) -> tuple[Action, ...]:
        """The actions of ``stage`` in the order its rank runs them."""
        return tuple(a for a in self.actions[self.placement[stage]] if a.stage == stage)

    def compute_only(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def to_dict(self) -> dict:
        return {"name": self.name, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches, "warmups": list(self.warmups),
                "placement": list(self.placement),
                "actions": [[str(a) for a in lst] for lst in self.actions]}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(d["name"], int(d["num_stages"]), int(d["num_microbatches"]),
                   tuple(int(w) for w in d["warmups"]),
                   tuple(tuple(Action.parse(a) for a in lst) for lst in d["actions"]),
                   tuple(int(p) for p in d.get("placement", ())))


def build_schedule(kind: str, num_stages: int, num_microbatches: int,
                   warmups: list[int] | tuple[int, ...] | None = None,
                   validate: bool = True, early_receives: bool = False,
                   num_ranks: int | None = None,
                   deferrals: list[int | None] | tuple[int | None, ...] | None = None
                   ) -> Schedule:
    """The per-rank lists of ``kind`` from its generator
    (:data:`~hapt_hf.core.schedules.GENERATORS`), with the given warm-up depths (the kind's own
    by default; a kind that fixes its depths runs the ones given all the same, as a plan
    written by hand asks).

    ``early_receives``: post each receive as soon as its sender may send instead of one
    compute action ahead (the runtime asks for it). ``num_ranks``: pipeline ranks the stages
    are placed on (None: one per stage; fewer for an interleaved schedule). ``deferrals``:
    ``zero_bubble``'s, one per stage (None, or None for a stage: the kind's rule)."""
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one stage and one micro-batch, got {num_stages} "
                            f"stages and {num_microbatches} micro-batches")
    gen = schedule_generator(kind)
    gen.place(num_stages, num_stages if num_ranks is None else num_ranks)
    if warmups is None:
        warmups = default_warmups(kind, num_stages, num_microbatches, num_ranks)
    if len(warmups) != num_stages:
        raise ScheduleError(f"{len(warmups)} warm-up depths given for {num_stages} stages; "
                            "give one per stage")
    warm = gen.run_depths(warmups, num_microbatches,
                          num_stages if num_ranks is None else num_ranks)
    extra = {} if deferrals is None else {"deferrals": tuple(deferrals)}
    lists, placement = gen.generate(num_stages, num_microbatches, warm,
                                    early_receives=early_receives, num_ranks=num_ranks, **extra)
    actions = tuple(tuple(Action(s, k, mb) for k, s, mb in lst) for lst in lists)
    sched = Schedule(kind, num_stages, num_microbatches, warm, actions, placement)
    if validate:
        validate_schedule(sched)
    return sched


# -- validation ----------------------------------------------------------------------------

def format_grid(sched: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Rank-by-step grid of the action lists; ``mark=(rank, step)`` is bracketed."""
    width = max((len(str(a)) for lst in sched.actions for a in lst), default=3) + 2
    steps = max((len(lst) for lst in sched.actions), default=0)
    head = " rank | " + " ".join(f"{i:>{width}}" for i in range(steps))
    rows = [head]
    for r, lst in enumerate(sched.actions):
        cells = []
        for j in range(steps):
            txt = str(lst[j]) if j < len(lst) else ""
            if mark == (r, j):
                txt = f"[{txt}]"
            cells.append(f"{txt:>{width}}")
        rows.append(f"{r:>5} | " + " ".join(cells))
    return "\n".join(rows)


def _fail(sched: Schedule, rank: int, step: int, why: str) -> None:
    raise ScheduleError(f"{why}\n{format_grid(sched, (rank, step))}")


_NEEDS = {ActionKind.F: ActionKind.RECV_F, ActionKind.B: ActionKind.RECV_B,
          ActionKind.I: ActionKind.RECV_B}
_SENDS = {ActionKind.F: ActionKind.SEND_F, ActionKind.B: ActionKind.SEND_B,
          ActionKind.I: ActionKind.SEND_B}
_AFTER = {ActionKind.B: ActionKind.F, ActionKind.I: ActionKind.F, ActionKind.W: ActionKind.I}
"""A compute and the compute of the same stage and micro-batch it must follow."""


def _check_static(sched: Schedule) -> None:
    n, m = sched.num_stages, sched.num_microbatches
    if sorted(set(sched.placement)) != list(range(sched.num_ranks)) or \
            len(sched.placement) != n:
        raise ScheduleError(f"placement {list(sched.placement)} must give each of the {n} stages "
                            f"one of the pipeline ranks 0..{sched.num_ranks - 1}, every rank "
                            "holding at least one stage")
    seen: dict[tuple[int, ActionKind, int], int] = {}  # (stage, kind, mb) -> step on its rank
    for r, lst in enumerate(sched.actions):
        for j, a in enumerate(lst):
            s = a.stage
            if not 0 <= s < n or sched.placement[s] != r:
                _fail(sched, r, j, f"action {a} sits in the list of pipeline rank {r}, which "
                      f"does not hold stage {s}")
            if not 0 <= a.microbatch < m:
                _fail(sched, r, j, f"{a}: micro-batch out of range 0..{m - 1}")
            if (s, a.kind, a.microbatch) in seen:
                _fail(sched, r, j, f"{a} appears twice")
            seen[(s, a.kind, a.microbatch)] = j
            first = _AFTER.get(a.kind)
            if first is not None and (s, first, a.microbatch) not in seen:
                _fail(sched, r, j, f"{a}: runs before its {first.value} on stage {s}")
            if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) and s == 0:
                _fail(sched, r, j, f"{a}: the first stage has no upstream stage")
            if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and s == n - 1:
                _fail(sched, r, j, f"{a}: the last stage has no downstream stage")
    for s in range(n):
        r = sched.placement[s]
        for k in range(m):
            whole = (s, ActionKind.B, k) in seen
            split = [(s, x, k) in seen for x in (ActionKind.I, ActionKind.W)]
            if whole and any(split):
                _fail(sched, r, seen[(s, ActionKind.B, k)], f"stage {s} runs micro-batch {k}'s "
                      "backward both whole (B) and split (I, W); give it one or the other")
            need = [ActionKind.F] + ([] if whole else [ActionKind.I, ActionKind.W]
                                     if any(split) else [ActionKind.B])
            for kind in need:
                if (s, kind, k) not in seen:
                    _fail(sched, r, len(sched.actions[r]) - 1,
                          f"stage {s} never runs {kind.value} of micro-batch {k}")
    for r, lst in enumerate(sched.actions):
        for j, a in enumerate(lst):
            s = a.stage
            if a.kind in _SENDS:  # its receive posted before it, its send after it
                if (a.kind is ActionKind.F and s > 0) or (a.kind in BACKWARDS and s < n - 1):
                    need = _NEEDS[a.kind]
                    if seen.get((s, need, a.microbatch), j + 1) > j:
                        _fail(sched, r, j, f"{a} runs before its {need.value} is posted")
                prod = _SENDS[a.kind]
                if seen.get((s, prod, a.microbatch), j + 1) < j:
                    _fail(sched, r, j, f"{prod.value} of micro-batch {a.microbatch} is posted "
                          f"before {a} computes it")
            if a.kind is ActionKind.SEND_F and (s + 1, ActionKind.RECV_F, a.microbatch) not in seen:
                _fail(sched, r, j, f"{a} has no matching RECV_F on stage {s + 1}")
            if a.kind is ActionKind.SEND_B and (s - 1, ActionKind.RECV_B, a.microbatch) not in seen:
                _fail(sched, r, j, f"{a} has no matching RECV_B on stage {s - 1}")


def validate_schedule(sched: Schedule) -> None:
    """Check order, matching and freedom from deadlock; raise ScheduleError with the grid.

    Deadlock is found by replaying the lists, one clock per pipeline rank: receives and sends
    are posted at once, a compute waits until the neighbour stage has computed (and posted the
    send of) what it consumes.
    """
    _check_static(sched)
    n, ranks = sched.num_stages, sched.num_ranks
    pos = [0] * ranks
    posted_send: set[tuple[int, ActionKind, int]] = set()
    total = sum(len(lst) for lst in sched.actions)
    done = 0
    while done < total:
        progressed = False
        for r in range(ranks):
            lst = sched.actions[r]
            while pos[r] < len(lst):
                a = lst[pos[r]]
                s = a.stage
                if a.kind is ActionKind.F and s > 0 and \
                        (s - 1, ActionKind.SEND_F, a.microbatch) not in posted_send:
                    break
                if a.kind in BACKWARDS and s < n - 1 and \
                        (s + 1, ActionKind.SEND_B, a.microbatch) not in posted_send:
                    break
                if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    posted_send.add((s, a.kind, a.microbatch))
                pos[r] += 1
                done += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} waits at {sched.actions[r][pos[r]]}"
                              for r in range(ranks) if pos[r] < len(sched.actions[r]))
            r0 = next(r for r in range(ranks) if pos[r] < len(sched.actions[r]))
            _fail(sched, r0, pos[r0], f"deadlock: {stuck}")
