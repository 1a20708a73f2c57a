"""Pipeline schedules as data: per-stage action lists (GPipe, 1F1B, H-1F1B).

As in torch.distributed.pipelining, a schedule is a list of actions per pipeline stage, printed
as ``"1F3"`` (stage 1, forward, micro-batch 3) or ``"2RECV_B0"``. Every rank of a stage (its
data-parallel replicas) runs that stage's list. The same lists are validated here, replayed with
durations by :mod:`hapt_hf.planner.simulate`, drawn, and executed by the runtime.

Semantics the runtime and the simulator share:

* ``F``/``B`` compute one micro-batch; they wait for the receive that feeds them.
* ``RECV_F``/``RECV_B`` *post* a non-blocking receive (activation from stage-1 / gradient from
  stage+1); posting never blocks. The communication pass posts each receive one compute action
  ahead, so the transfer overlaps the compute before it.
* ``SEND_F``/``SEND_B`` post a non-blocking send of what the preceding compute produced.

No torch here: the planner, the simulator and the runtime all read these objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hapt_hf.core.schedules import (COMPUTE, SCHEDULES, ActionKind, clamp_warmup,
                                    default_warmups, stage_actions, warmup_rule)
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
    """Per-stage action lists for one iteration."""

    name: str
    num_stages: int
    num_microbatches: int
    warmups: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    """``actions[s]`` is the list every rank of stage ``s`` executes, in order."""

    def compute_only(self, stage: int) -> list[Action]:
        return [a for a in self.actions[stage] if a.is_compute]

    def to_dict(self) -> dict:
        return {"name": self.name, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches, "warmups": list(self.warmups),
                "actions": [[str(a) for a in lst] for lst in self.actions]}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(d["name"], int(d["num_stages"]), int(d["num_microbatches"]),
                   tuple(int(w) for w in d["warmups"]),
                   tuple(tuple(Action.parse(a) for a in lst) for lst in d["actions"]))


def build_schedule(kind: str, num_stages: int, num_microbatches: int,
                   warmups: list[int] | tuple[int, ...] | None = None,
                   validate: bool = True, early_receives: bool = False) -> Schedule:
    """Build GPipe, 1F1B or H-1F1B (1F1B with per-stage warm-up depths) action lists.

    ``early_receives``: post each receive as soon as its sender may send instead of one
    compute action ahead (see :func:`~hapt_hf.core.schedules.stage_actions`; the runtime
    asks for it)."""
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one stage and one micro-batch, got {num_stages} "
                            f"stages and {num_microbatches} micro-batches")
    if warmups is None:
        warmups = default_warmups(kind, num_stages, num_microbatches)
    elif kind not in SCHEDULES:
        warmup_rule(kind)  # raises ScheduleError naming the known kinds
    if len(warmups) != num_stages:
        raise ScheduleError(f"{len(warmups)} warm-up depths given for {num_stages} stages; "
                            "give one per stage")
    warm = tuple(clamp_warmup(w, num_microbatches) for w in warmups)
    actions = tuple(
        tuple(Action(s, kind_, mb)
              for kind_, mb in stage_actions(
                  s, num_stages, warm[s], num_microbatches,
                  neighbour_warmups=(warm[s - 1] if s > 0 else 1,
                                     warm[s + 1] if s < num_stages - 1 else 1)
                  if early_receives else None))
        for s in range(num_stages))
    sched = Schedule(kind, num_stages, num_microbatches, warm, actions)
    if validate:
        validate_schedule(sched)
    return sched


# -- validation ----------------------------------------------------------------------------

def format_grid(sched: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Stage-by-step grid of the action lists; ``mark=(stage, step)`` is bracketed."""
    width = max((len(str(a)) for lst in sched.actions for a in lst), default=3) + 2
    steps = max((len(lst) for lst in sched.actions), default=0)
    head = "stage | " + " ".join(f"{i:>{width}}" for i in range(steps))
    rows = [head]
    for s, lst in enumerate(sched.actions):
        cells = []
        for j in range(steps):
            txt = str(lst[j]) if j < len(lst) else ""
            if mark == (s, j):
                txt = f"[{txt}]"
            cells.append(f"{txt:>{width}}")
        rows.append(f"{s:>5} | " + " ".join(cells))
    return "\n".join(rows)


def _fail(sched: Schedule, stage: int, step: int, why: str) -> None:
    raise ScheduleError(f"{why}\n{format_grid(sched, (stage, step))}")


def _check_static(sched: Schedule) -> None:
    n, m = sched.num_stages, sched.num_microbatches
    for s, lst in enumerate(sched.actions):
        seen: dict[tuple[ActionKind, int], int] = {}
        for j, a in enumerate(lst):
            if a.stage != s:
                _fail(sched, s, j, f"action {a} sits in the list of stage {s}")
            if not 0 <= a.microbatch < m:
                _fail(sched, s, j, f"{a}: micro-batch out of range 0..{m - 1}")
            if (a.kind, a.microbatch) in seen:
                _fail(sched, s, j, f"{a} appears twice on stage {s}")
            seen[(a.kind, a.microbatch)] = j
            if a.kind is ActionKind.B and (ActionKind.F, a.microbatch) not in seen:
                _fail(sched, s, j, f"{a}: backward before its forward on stage {s}")
            if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) and s == 0:
                _fail(sched, s, j, f"{a}: the first stage has no upstream stage")
            if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and s == n - 1:
                _fail(sched, s, j, f"{a}: the last stage has no downstream stage")
        for k in range(m):
            for kind in COMPUTE:
                if (kind, k) not in seen:
                    _fail(sched, s, len(lst) - 1,
                          f"stage {s} never runs {kind.value} of micro-batch {k}")
        # every compute that needs input has its receive posted before it
        for j, a in enumerate(lst):
            need = None
            if a.kind is ActionKind.F and s > 0:
                need = ActionKind.RECV_F
            elif a.kind is ActionKind.B and s < n - 1:
                need = ActionKind.RECV_B
            if need is not None and seen.get((need, a.microbatch), j + 1) > j:
                _fail(sched, s, j, f"{a} runs before its {need.value} is posted")
            prod = {ActionKind.F: ActionKind.SEND_F, ActionKind.B: ActionKind.SEND_B}[a.kind] \
                if a.is_compute else None
            if prod is not None and (prod, a.microbatch) in seen and seen[(prod, a.microbatch)] < j:
                _fail(sched, s, j, f"{prod.value} of micro-batch {a.microbatch} is posted before "
                      f"{a} computes it")
    # every send matched by a receive on the neighbour
    for s, lst in enumerate(sched.actions):
        kinds = {(a.kind, a.microbatch) for a in lst}
        for j, a in enumerate(lst):
            if a.kind is ActionKind.SEND_F and (ActionKind.RECV_F, a.microbatch) not in \
                    {(b.kind, b.microbatch) for b in sched.actions[s + 1]}:
                _fail(sched, s, j, f"{a} has no matching RECV_F on stage {s + 1}")
            if a.kind is ActionKind.SEND_B and (ActionKind.RECV_B, a.microbatch) not in \
                    {(b.kind, b.microbatch) for b in sched.actions[s - 1]}:
                _fail(sched, s, j, f"{a} has no matching RECV_B on stage {s - 1}")
        del kinds


def validate_schedule(sched: Schedule) -> None:
    """Check order, matching and freedom from deadlock; raise ScheduleError with the grid.

    Deadlock is found by replaying the lists: receives and sends are posted at once, a compute
    waits until the neighbour has computed (and posted the send of) what it consumes.
    """
    _check_static(sched)
    n = sched.num_stages
    pos = [0] * n
    posted_send: set[tuple[int, ActionKind, int]] = set()
    total = sum(len(lst) for lst in sched.actions)
    done = 0
    while done < total:
        progressed = False
        for s in range(n):
            lst = sched.actions[s]
            while pos[s] < len(lst):
                a = lst[pos[s]]
                if a.kind is ActionKind.F and s > 0 and \
                        (s - 1, ActionKind.SEND_F, a.microbatch) not in posted_send:
                    break
                if a.kind is ActionKind.B and s < n - 1 and \
                        (s + 1, ActionKind.SEND_B, a.microbatch) not in posted_send:
                    break
                if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    posted_send.add((s, a.kind, a.microbatch))
                pos[s] += 1
                done += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {s} waits at {sched.actions[s][pos[s]]}"
                              for s in range(n) if pos[s] < len(sched.actions[s]))
            s0 = next(s for s in range(n) if pos[s] < len(sched.actions[s]))
            _fail(sched, s0, pos[s0], f"deadlock: {stuck}")
