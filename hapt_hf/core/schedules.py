"""Schedule kinds and the one registry of their generators: each kind's per-rank action lists.

A schedule is a list of actions per *pipeline rank* (a position along the pipeline; every
global rank holding a replica of that position's stage runs its list), each action naming the
(virtual) stage it runs, its kind and its micro-batch, plus a *placement*: the pipeline rank
each stage sits on. The kinds here place stage ``s`` on pipeline rank ``s``; a kind that puts
several virtual stages on one rank (interleaved schedules) only needs its own generator.

A stage's *warm-up depth* is the number of forward micro-batches it runs before its first
backward; after it the stage alternates one backward, one forward. The depths are a parameter
of the generator, not its definition:

* ``gpipe``: every forward, then every backward (its own depth is the number of micro-batches);
* ``1f1b``: stage ``i`` of ``n`` runs ``min(n - i, M)`` forwards first;
* ``h1f1b``: HAPT's H-1F1B, the same order with a depth per stage chosen by the plan (deeper
  before a slow link); its default is 1F1B's.

:data:`GENERATORS` maps each kind to its :class:`ScheduleGenerator`; the planner's schedules
(:mod:`hapt_hf.planner.schedule`), the simulator's replay and the runtime all read its lists.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from hapt_hf.errors import ScheduleError

__all__ = ["ScheduleKind", "SCHEDULES", "ScheduleGenerator", "GENERATORS", "schedule_generator",
           "plan_sets_warmups", "default_warmups", "schedule_warmups", "warmups_from_steps",
           "clamp_warmup", "ActionKind", "COMPUTE", "RankLists"]


class ScheduleKind(str, enum.Enum):
    """A pipeline schedule; compares equal to its name (``ScheduleKind.GPIPE == "gpipe"``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    H1F1B = "h1f1b"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


SCHEDULES = tuple(k.value for k in ScheduleKind)
"""The schedule names a plan, a hapt config or the CLI may give."""


RankLists = tuple[tuple[tuple[tuple[object, int, int], ...], ...], tuple[int, ...]]
"""What a generator returns: each pipeline rank's list of ``(kind, stage, micro-batch)`` and
the placement (``placement[stage]`` is the pipeline rank holding it)."""


@dataclass(frozen=True)
class ScheduleGenerator:
    """One schedule kind: its own warm-up depths and the generator of its per-rank lists."""

    kind: "ScheduleKind"
    plan_sets_warmups: bool
    """True: the plan chooses every stage's depth (the kind's own depths are its default);
    False: the kind's own depths are the only ones it runs."""
    own_depth: Callable[[int, int, int], int]
    """(stage, stages, micro-batches) -> the kind's own warm-up depth of that stage."""
    generate: Callable[..., "RankLists"]
    """(stages, micro-batches, warm-ups, receives=, tokens=, early_receives=) -> RankLists."""


def schedule_generator(kind: str) -> "ScheduleGenerator":
    """The generator of ``kind``; ScheduleError naming the known kinds if there is none."""
    try:
        return GENERATORS[ScheduleKind(kind)]
    except ValueError:
        raise ScheduleError(f"schedule {kind!r} is unknown; use gpipe, 1f1b or h1f1b") from None


def plan_sets_warmups(kind: str) -> bool:
    """Whether a plan of ``kind`` chooses its stages' warm-up depths (H-1F1B)."""
    return schedule_generator(kind).plan_sets_warmups


def default_warmups(kind: str, num_stages: int, num_microbatches: int) -> list[int]:
    """The kind's own depth for every stage."""
    depth = schedule_generator(kind).own_depth
    return [depth(i, num_stages, num_microbatches) for i in range(num_stages)]


def schedule_warmups(kind: str, warmups: Sequence[int], num_microbatches: int) -> tuple[int, ...]:
    """The depths a schedule of ``kind`` runs over ``num_microbatches``: the given ones where
    the kind lets the plan choose, the kind's own otherwise."""
    if plan_sets_warmups(kind):
        return tuple(warmups)
    return tuple(default_warmups(kind, len(warmups), num_microbatches))


def warmups_from_steps(steps: Sequence[int], num_microbatches: int) -> tuple[int, ...]:
    """Depths that fall along the pipeline: the last stage runs 1, each stage before it its
    successor's depth plus its step (at least 1); depths beyond M all behave as M."""
    n = len(steps) + 1
    warm = [1] * n
    for i in range(n - 2, -1, -1):
        warm[i] = warm[i + 1] + max(steps[i], 1)
    return tuple(min(w, num_microbatches) for w in warm)


def clamp_warmup(warmup: int, num_microbatches: int) -> int:
    """A depth as a schedule runs it: at least 1 and at most the number of micro-batches."""
    return max(1, min(int(warmup), num_microbatches))


class ActionKind(str, enum.Enum):
    """One step of a stage's list, printed as in torch.distributed.pipelining (``1F3``)."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = (ActionKind.F, ActionKind.B)


def _forward_order(warmup: int, num_microbatches: int) -> list[tuple[bool, int]]:
    """(is forward, micro-batch) of each compute step, in order."""
    m = num_microbatches
    w = clamp_warmup(warmup, m)
    out = [(True, k) for k in range(w)]
    nxt = w
    for k in range(m):
        out.append((False, k))
        if nxt < m:
            out.append((True, nxt))
            nxt += 1
    return out


_AS_IS = {k: k for k in ActionKind}


def _stage_list(stage: int, num_stages: int, warmup: int, num_microbatches: int,
                  receives: bool = True, tokens: dict | None = None,
                  neighbour_warmups: tuple[int, int] | None = None
                  ) -> list[tuple[object, int, int]]:
    """Stage ``stage``'s whole list of ``(kind, stage, micro-batch)``: each compute followed by
    the send of what it produced, and (``receives``) each receive posted ahead of its
    consumer, so the transfer overlaps the compute before it. The simulator leaves receives
    out (posting one costs nothing there) and passes ``tokens``, what to write for each
    ActionKind (its integer codes): the search builds thousands of these lists.

    A receive is posted one compute action ahead of its consumer, or, given
    ``neighbour_warmups`` (the warm-up depths of the stages before and after), as soon as its
    sender may send: the activation of micro-batch ``k`` leaves the stage before after its
    backward of ``k - w_before``, which waits for this stage's gradient of that micro-batch;
    the gradient of ``j`` leaves the stage after once its forward of ``j + w_after - 1`` is
    done. A Gloo transfer moves only once its receive is posted, so a receive posted one
    action ahead holds up what H-1F1B's deeper warm-ups sent early (traced on the testbed:
    the activations reached a slow stage later and later, 0.49 s into a step the schedule
    had them in at 0.36 s). On NCCL, which pairs transfers in posting order on one stream per
    communicator, they are safe as the runtime posts them, each boundary's each direction on
    a group of its own (`benchmarks/stream_order.py` replays them)."""
    t = _AS_IS if tokens is None else tokens
    first, last = stage == 0, stage == num_stages - 1
    f, b = t[ActionKind.F], t[ActionKind.B]
    send_f = None if last else t[ActionKind.SEND_F]
    send_b = None if first else t[ActionKind.SEND_B]
    recv_f = None if first or not receives else t[ActionKind.RECV_F]
    recv_b = None if last or not receives else t[ActionKind.RECV_B]
    m = num_microbatches
    order = _forward_order(warmup, m)
    body: list[tuple[object, int, int]] = []  # (kind, stage, mb) of computes and sends
    at_compute: list[int] = []            # index in body of each compute
    after_send: dict[tuple[bool, int], int] = {}  # (forward?, mb) -> index after its send
    for fwd, mb in order:
        at_compute.append(len(body))
        body.append((f if fwd else b, stage, mb))
        snd = send_f if fwd else send_b
        if snd is not None:
            body.append((snd, stage, mb))
            after_send[(fwd, mb)] = len(body)
    if not receives:
        return body
    if neighbour_warmups is not None:
        before, after = (clamp_warmup(w, m) for w in neighbour_warmups)
    posts: list[tuple[int, int, object, int]] = []  # (insert before body index, order, kind, mb)
    for i, (fwd, mb) in enumerate(order):
        r = recv_f if fwd else recv_b
        if r is None:
            continue
        where = at_compute[i - 1] if i > 0 else 0  # one compute action ahead
        if neighbour_warmups is not None:
            if fwd:  # the stage before sends F(mb) after its B(mb - before)
                dep = 0 if mb < before else after_send.get((False, mb - before), where)
            else:    # the stage after sends B(mb) after its F(mb + after - 1)
                dep = after_send.get((True, min(mb + after - 1, m - 1)), where)
            where = min(where, dep)
        posts.append((where, i, r, mb))
    posts.sort()
    out: list[tuple[object, int, int]] = []
    j = 0
    for idx, item in enumerate(body):
        while j < len(posts) and posts[j][0] <= idx:
            out.append((posts[j][2], stage, posts[j][3]))
            j += 1
        out.append(item)
    out.extend((p[2], stage, p[3]) for p in posts[j:])
    return out


def _one_stage_per_rank(num_stages: int, num_microbatches: int, warmups: Sequence[int],
                        receives: bool = True, tokens: dict | None = None,
                        early_receives: bool = False) -> RankLists:
    """GPipe, 1F1B and H-1F1B: stage ``s`` on pipeline rank ``s``, each list of the 1F1B shape
    with the stage's warm-up depth (clamped to ``[1, M]``). ``early_receives``: each receive
    posted as soon as its sender may send (see :func:`_stage_list`; the runtime's lists)."""
    n, m = num_stages, num_microbatches
    warm = [clamp_warmup(w, m) for w in warmups]
    lists = []
    for s in range(n):
        nb = (warm[s - 1] if s > 0 else 1, warm[s + 1] if s < n - 1 else 1) \
            if early_receives else None
        lists.append(tuple(_stage_list(s, n, warm[s], m, receives=receives, tokens=tokens,
                                       neighbour_warmups=nb)))
    return tuple(lists), tuple(range(n))


GENERATORS: dict[ScheduleKind, ScheduleGenerator] = {
    ScheduleKind.GPIPE: ScheduleGenerator(ScheduleKind.GPIPE, False, lambda i, n, m: m,
                                          _one_stage_per_rank),
    ScheduleKind.ONE_F_ONE_B: ScheduleGenerator(ScheduleKind.ONE_F_ONE_B, False,
                                                lambda i, n, m: min(n - i, m),
                                                _one_stage_per_rank),
    ScheduleKind.H1F1B: ScheduleGenerator(ScheduleKind.H1F1B, True,
                                          lambda i, n, m: min(n - i, m), _one_stage_per_rank),
}
"""Every schedule kind's generator: the one registry the planner, simulator and runtime read."""
