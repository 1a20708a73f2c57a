"""Schedule kinds and the one registry of their generators: each kind's per-rank action lists.

A schedule is a list of actions per *pipeline rank* (a position along the pipeline; every
global rank holding a replica of that position's stage runs its list), each action naming the
(virtual) stage it runs, its kind and its micro-batch, plus a *placement*: the pipeline rank
each stage sits on. Every kind but ``interleaved`` places stage ``s`` on pipeline rank ``s``;
``interleaved`` places ``v`` virtual stages on each of ``p`` ranks, stage ``s`` on rank
``s mod p``.

A stage's *warm-up depth* is the number of forward micro-batches it runs before its first
backward; after it the stage alternates one backward, one forward. The depths are a parameter
of the generator, not its definition:

* ``gpipe``: every forward, then every backward (its own depth is the number of micro-batches);
* ``1f1b``: stage ``i`` of ``n`` runs ``min(n - i, M)`` forwards first;
* ``h1f1b``: HAPT's H-1F1B, the same order with a depth per stage chosen by the plan (deeper
  before a slow link); its default is 1F1B's;
* ``zero_bubble``: H-1F1B's order and depths with each backward split, as in ZB-H1 (Qi et al.
  2024, torch's ``ScheduleInterleavedZeroBubble`` on one chunk per rank), into the input
  gradient ``I`` (where the backward was: it feeds the stage before) and the weight gradient
  ``W``, which nothing waits for: stage ``s`` defers its ``W`` s by ``d_s = w_0 - w_s``
  micro-batches (the first stage's depth less its own; ``s`` for 1F1B's depths, torch's
  choice), so they fill the drain in which it would otherwise wait for the stages before it.
  A deferred ``W`` keeps its micro-batch's activations until it runs: stage ``s`` holds at
  most ``min(w_s + d_s, M)`` micro-batches (:func:`zero_bubble_deferrals`,
  :func:`peak_held`); a plan may set each stage's deferral itself, e.g. the most its memory
  holds (:func:`fitting_deferrals`);
* ``interleaved``: Megatron's interleaved 1F1B in torch's ``ScheduleInterleaved1F1B`` order:
  each rank runs its chunks' forwards round by round (``max(1, M // p)`` rounds of at least
  ``p`` micro-batches; within a round chunk 0's, then chunk 1's...) and its backwards in the
  same rounds with the chunks reversed. A rank's *warm-up* is the number of forwards, over
  all its chunks, before its first backward; every stage of a rank carries its rank's. Its
  default is torch's, ``min((v - 1) r + 2 (p - 1 - k) + 1, v M)`` on rank ``k`` (``r`` the
  first round's micro-batches); the plan may choose others (:func:`interleaved_bounds`).

:data:`GENERATORS` maps each kind to its :class:`ScheduleGenerator`; the planner's schedules
(:mod:`hapt_hf.planner.schedule`), the simulator's replay and the runtime all read its lists.
The runtime runs the kinds of :data:`RUNTIME_KINDS` only (:func:`runtime_refusal`).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from hapt_hf.errors import ScheduleError

__all__ = ["ScheduleKind", "SCHEDULES", "ScheduleGenerator", "GENERATORS", "schedule_generator",
           "plan_sets_warmups", "default_warmups", "schedule_warmups", "warmups_from_steps",
           "clamp_warmup", "ActionKind", "COMPUTE", "BACKWARDS", "RankLists", "RUNTIME_KINDS",
           "runtime_refusal", "zero_bubble_deferrals", "fitting_deferrals", "interleaved_rounds",
           "interleaved_bounds", "peak_held"]


class ScheduleKind(str, enum.Enum):
    """A pipeline schedule; compares equal to its name (``ScheduleKind.GPIPE == "gpipe"``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    H1F1B = "h1f1b"
    ZERO_BUBBLE = "zero_bubble"
    INTERLEAVED = "interleaved"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


SCHEDULES = tuple(k.value for k in ScheduleKind)
"""The schedule names a plan, a hapt config or the CLI may give."""

RUNTIME_KINDS = (ScheduleKind.GPIPE.value, ScheduleKind.ONE_F_ONE_B.value,
                 ScheduleKind.H1F1B.value, ScheduleKind.ZERO_BUBBLE.value,
                 ScheduleKind.INTERLEAVED.value)
"""The kinds the runtime runs (every kind of the registry today); a kind left out is planned,
validated, replayed and drawn only."""


def runtime_refusal(kind: str) -> str | None:
    """Why the runtime cannot run a plan of schedule ``kind`` (one sentence), or None when it
    can. The runtime calls it where it validates a plan."""
    if kind in RUNTIME_KINDS:
        return None
    return (f"schedule {kind!r} can be planned, simulated and drawn but the runtime does not run "
            f"it yet; train with one of {', '.join(RUNTIME_KINDS)} (re-plan with --schedule "
            "h1f1b)")


RankLists = tuple[tuple[tuple[tuple[object, int, int], ...], ...], tuple[int, ...]]
"""What a generator returns: each pipeline rank's list of ``(kind, stage, micro-batch)`` and
the placement (``placement[stage]`` is the pipeline rank holding it)."""


@dataclass(frozen=True)
class ScheduleGenerator:
    """One schedule kind: its own warm-up depths, its placement and the generator of its
    per-rank lists."""

    kind: "ScheduleKind"
    plan_sets_warmups: bool
    """True: the plan chooses every stage's depth (the kind's own depths are its default);
    False: the kind's own depths are the only ones it runs."""
    own_depth: Callable[[int, int, int, int], int]
    """(stage, stages, micro-batches, pipeline ranks) -> the kind's own warm-up depth of that
    stage."""
    generate: Callable[..., "RankLists"]
    """(stages, micro-batches, warm-ups, receives=, tokens=, early_receives=, num_ranks=;
    a split backward's also deferrals=) -> RankLists."""
    place: Callable[[int, int], tuple[int, ...]]
    """(stages, pipeline ranks) -> the pipeline rank of each stage; ScheduleError where the
    kind cannot place that many stages on that many ranks."""
    run_depths: Callable[[Sequence[int], int, int], tuple[int, ...]] = \
        lambda warm, m, p: tuple(clamp_warmup(w, m) for w in warm)
    """(warm-ups, micro-batches, pipeline ranks) -> the depths the lists run (clamped to what
    the kind can run: ``[1, M]`` but for interleaved, :func:`interleaved_bounds`)."""
    split_backward: bool = False
    """True: each backward runs as ``I`` then ``W``; False: as one ``B``."""


def schedule_generator(kind: str) -> "ScheduleGenerator":
    """The generator of ``kind``; ScheduleError naming the known kinds if there is none."""
    try:
        return GENERATORS[ScheduleKind(kind)]
    except ValueError:
        raise ScheduleError(f"schedule {kind!r} is unknown; use one of "
                            f"{', '.join(SCHEDULES)}") from None


def plan_sets_warmups(kind: str) -> bool:
    """Whether a plan of ``kind`` chooses its stages' warm-up depths (H-1F1B and the kinds
    built on its depths)."""
    return schedule_generator(kind).plan_sets_warmups


def default_warmups(kind: str, num_stages: int, num_microbatches: int,
                    num_ranks: int | None = None) -> list[int]:
    """The kind's own depth for every stage (``num_ranks`` pipeline ranks; None: one per
    stage)."""
    depth = schedule_generator(kind).own_depth
    p = num_stages if num_ranks is None else num_ranks
    return [depth(i, num_stages, num_microbatches, p) for i in range(num_stages)]


def schedule_warmups(kind: str, warmups: Sequence[int], num_microbatches: int,
                     num_ranks: int | None = None) -> tuple[int, ...]:
    """The depths a schedule of ``kind`` runs over ``num_microbatches``: the given ones where
    the kind lets the plan choose, the kind's own otherwise."""
    if plan_sets_warmups(kind):
        return tuple(warmups)
    return tuple(default_warmups(kind, len(warmups), num_microbatches, num_ranks))


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
    """One step of a stage's list, printed as in torch.distributed.pipelining (``1F3``):
    ``F`` forward, ``B`` the whole backward, or split: ``I`` the input gradient (what the stage
    before waits for) and ``W`` the weight gradient."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    I = "I"  # noqa: E741  (torch's name for the input-gradient backward)
    W = "W"


COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
BACKWARDS = (ActionKind.B, ActionKind.I)
"""The backward that needs the next stage's gradient and sends one to the stage before."""

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def _forward_order(warmup: int, num_microbatches: int) -> list[tuple[ActionKind, int]]:
    """(kind, micro-batch) of each compute step of the 1F1B shape, in order."""
    m = num_microbatches
    w = clamp_warmup(warmup, m)
    out = [(_F, k) for k in range(w)]
    nxt = w
    for k in range(m):
        out.append((_B, k))
        if nxt < m:
            out.append((_F, nxt))
            nxt += 1
    return out


def zero_bubble_deferrals(warmups: Sequence[int], num_microbatches: int,
                          deferrals: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """By how many micro-batches each stage of a ``zero_bubble`` schedule defers its weight
    gradients: the given ``deferrals`` where not None, else the first stage's depth less its
    own (0 where deeper); each within ``[0, M]``. A stage then holds at most
    ``min(w_s + d_s, M)`` micro-batches' activations (its forwards' until their ``W``): by
    default the first stage's depth on every stage."""
    m = num_microbatches
    warm = [clamp_warmup(w, m) for w in warmups]
    given = list(deferrals) if deferrals is not None else [None] * len(warm)
    if len(given) != len(warm):
        raise ScheduleError(f"{len(given)} deferrals given for {len(warm)} stages; give one per "
                            "stage (None: the default)")
    return tuple(min(max(warm[0] - w if d is None else int(d), 0), m)
                 for w, d in zip(warm, given))


def fitting_deferrals(warmups: Sequence[int], num_microbatches: int,
                      max_held: Sequence[int]) -> tuple[int, ...]:
    """``zero_bubble`` deferrals no deeper than the default and within memory: stage ``s``
    holds at most ``max_held[s]`` micro-batches (what its GPU fits; the cost model knows), so
    it defers at most ``max_held[s] - w_s`` weight gradients (0 where its warm-up alone fills
    it)."""
    m = num_microbatches
    rule = zero_bubble_deferrals(warmups, m)
    return tuple(max(0, min(d, int(k) - clamp_warmup(w, m)))
                 for d, w, k in zip(rule, warmups, max_held))


def _zero_bubble_order(warmup: int, deferral: int,
                       num_microbatches: int) -> list[tuple[ActionKind, int]]:
    """The 1F1B shape with each ``B`` as ``I``, then the ``W`` of the micro-batch
    ``deferral`` before it (torch's ZB order: ``F``, ``I``, ``W`` per step), the ``W`` s left
    over at the end."""
    m = num_microbatches
    w = clamp_warmup(warmup, m)
    out = [(_F, k) for k in range(w)]
    nxt, done_w = w, 0
    for k in range(m):
        out.append((_I, k))
        if k >= deferral:
            out.append((_W, done_w))
            done_w += 1
        if nxt < m:
            out.append((_F, nxt))
            nxt += 1
    out.extend((_W, k) for k in range(done_w, m))
    return out


_AS_IS = {k: k for k in ActionKind}


def _rank_list(order: Sequence[tuple[ActionKind, int, int]], num_stages: int,
               receives: bool = True, tokens: dict | None = None,
               neighbour_warmups: tuple[int, int] | None = None,
               num_microbatches: int = 0,
               earliest: dict[tuple[bool, int, int], int] | None = None
               ) -> list[tuple[object, int, int]]:
    """A pipeline rank's whole list of ``(kind, stage, micro-batch)`` from its compute
    ``order`` of ``(kind, stage, micro-batch)``: each compute followed by the send of what it
    produced, and (``receives``) each receive posted ahead of its consumer, so the transfer
    overlaps the compute before it. The simulator leaves receives out (posting one costs
    nothing there) and passes ``tokens``, what to write for each ActionKind (its integer
    codes): the search builds thousands of these lists.

    A receive is posted one compute action ahead of its consumer, or, given
    ``neighbour_warmups`` (the warm-up depths of the stages before and after; a rank holding
    one stage), as soon as its sender may send: the activation of micro-batch ``k`` leaves the
    stage before after its backward of ``k - w_before``, which waits for this stage's gradient
    of that micro-batch; the gradient of ``j`` leaves the stage after once its forward of
    ``j + w_after - 1`` is done. A Gloo transfer moves only once its receive is posted, so a
    receive posted one action ahead holds up what H-1F1B's deeper warm-ups sent early (traced
    on the testbed: the activations reached a slow stage later and later, 0.49 s into a step
    the schedule had them in at 0.36 s). On NCCL, which pairs transfers in posting order on
    one stream per communicator, they are safe as the runtime posts them, each boundary's
    each direction on a group of its own (`benchmarks/stream_order.py` replays them).
    ``earliest`` gives the same for any lists: (forward?, stage, micro-batch) of a receive ->
    the body index it may be posted before (:func:`_earliest_receives`)."""
    t = _AS_IS if tokens is None else tokens
    last = num_stages - 1
    body: list[tuple[object, int, int]] = []  # (kind, stage, mb) of computes and sends
    # (kind, stage) -> (its token, the token of the send after it or None): looked up once
    tok: dict[tuple[ActionKind, int], tuple[object, object]] = {}
    for kind, s, mb in order:
        pair = tok.get((kind, s))
        if pair is None:
            snd = ActionKind.SEND_F if kind is _F and s != last else \
                ActionKind.SEND_B if kind in BACKWARDS and s != 0 else None
            pair = tok[(kind, s)] = (t[kind], None if snd is None else t[snd])
        body.append((pair[0], s, mb))
        if pair[1] is not None:
            body.append((pair[1], s, mb))
    if not receives:
        return body
    at_compute: list[int] = []            # index in body of each compute
    after_send: dict[tuple[bool, int], int] = {}  # (forward?, mb) -> index after its send
    j = 0
    for kind, s, mb in order:
        at_compute.append(j)
        j += 1
        if tok[(kind, s)][1] is not None:
            j += 1
            after_send[(kind is _F, mb)] = j
    m = num_microbatches
    if neighbour_warmups is not None:
        before, after = (clamp_warmup(w, m) for w in neighbour_warmups)
    posts: list[tuple[int, int, object, int, int]] = []  # (before body index, order, kind, ...)
    for i, (kind, s, mb) in enumerate(order):
        if kind is _F and s != 0:
            r = t[ActionKind.RECV_F]
        elif kind in BACKWARDS and s != last:
            r = t[ActionKind.RECV_B]
        else:
            continue
        where = at_compute[i - 1] if i > 0 else 0  # one compute action ahead
        if neighbour_warmups is not None:
            if kind is _F:  # the stage before sends F(mb) after its B(mb - before)
                dep = 0 if mb < before else after_send.get((False, mb - before), where)
            else:    # the stage after sends B(mb) after its F(mb + after - 1)
                dep = after_send.get((True, min(mb + after - 1, m - 1)), where)
            where = min(where, dep)
        if earliest is not None:
            where = min(where, earliest.get((kind is _F, s, mb), where))
        posts.append((where, i, r, s, mb))
    posts.sort()
    out: list[tuple[object, int, int]] = []
    j = 0
    for idx, item in enumerate(body):
        while j < len(posts) and posts[j][0] <= idx:
            out.append(posts[j][2:])
            j += 1
        out.append(item)
    out.extend(p[2:] for p in posts[j:])
    return out


def _one_per_rank(num_stages: int, num_ranks: int) -> tuple[int, ...]:
    if num_ranks != num_stages:
        raise ScheduleError(f"this schedule places one stage on each pipeline rank, but "
                            f"{num_stages} stages were given for {num_ranks} ranks; use "
                            "schedule 'interleaved' to hold several stages per rank")
    return tuple(range(num_stages))


def _one_stage_per_rank(num_stages: int, num_microbatches: int, warmups: Sequence[int],
                        receives: bool = True, tokens: dict | None = None,
                        early_receives: bool = False, num_ranks: int | None = None,
                        split_backward: bool = False,
                        deferrals: Sequence[int | None] | None = None) -> RankLists:
    """GPipe, 1F1B, H-1F1B and (``split_backward``) zero-bubble: stage ``s`` on pipeline rank
    ``s``, each list of the 1F1B shape with the stage's warm-up depth (clamped to ``[1, M]``).
    ``early_receives``: each receive posted as soon as its sender may send (see
    :func:`_rank_list`; the runtime's lists). ``deferrals``: a split backward's, per stage
    (None: :func:`zero_bubble_deferrals`' rule)."""
    n, m = num_stages, num_microbatches
    placement = _one_per_rank(n, n if num_ranks is None else num_ranks)
    warm = [clamp_warmup(w, m) for w in warmups]
    if deferrals is not None and not split_backward:
        raise ScheduleError("deferrals of weight gradients apply to schedule 'zero_bubble' "
                            "only; leave them out")
    defer = zero_bubble_deferrals(warm, m, deferrals) if split_backward else ()
    lists = []
    for s in range(n):
        deferral = defer[s] if split_backward else None
        if not receives:  # the simulator's lists: the same few over a search's replays
            lists.append(_compute_list(s, n, warm[s], deferral, m,
                                       None if tokens is None else tuple(tokens.items())))
            continue
        nb = (warm[s - 1] if s > 0 else 1, warm[s + 1] if s < n - 1 else 1) \
            if early_receives else None
        steps = _stage_order(warm[s], deferral, m)
        lists.append(tuple(_rank_list([(k, s, mb) for k, mb in steps], n, receives, tokens,
                                      nb, m)))
    return tuple(lists), placement


@functools.lru_cache(maxsize=64)
def _compute_list(stage: int, num_stages: int, warmup: int, deferral: int | None,
                  num_microbatches: int, tokens: tuple | None) -> tuple:
    """Stage ``stage``'s list without receives (:func:`_rank_list`) in the 1F1B shape with
    ``warmup``, its backward split with ``deferral`` where that is not None; ``tokens`` as
    :func:`_rank_list`'s, as pairs. Kept: the planner replays the same lists many times."""
    steps = _stage_order(warmup, deferral, num_microbatches)
    return tuple(_rank_list([(k, stage, mb) for k, mb in steps], num_stages, False,
                            None if tokens is None else dict(tokens), None, num_microbatches))


def _stage_order(warmup: int, deferral: int | None,
                 num_microbatches: int) -> list[tuple[ActionKind, int]]:
    """A stage's compute order in the 1F1B shape: its backward whole (``deferral`` None) or
    split with the weight gradients ``deferral`` micro-batches behind."""
    if deferral is None:
        return _forward_order(warmup, num_microbatches)
    return _zero_bubble_order(warmup, deferral, num_microbatches)


def _zero_bubble(*args, **kw) -> RankLists:
    return _one_stage_per_rank(*args, split_backward=True, **kw)


# -- interleaved ---------------------------------------------------------------------------

def _interleaved_place(num_stages: int, num_ranks: int) -> tuple[int, ...]:
    if num_ranks < 1 or num_stages % num_ranks:
        raise ScheduleError(f"schedule 'interleaved' puts the same number of virtual stages on "
                            f"every pipeline rank, but {num_stages} stages do not divide among "
                            f"{num_ranks} ranks; give a multiple of {max(num_ranks, 1)} stages")
    if num_ranks == 1 and num_stages > 1:
        raise ScheduleError(f"schedule 'interleaved' over one pipeline rank would pass every "
                            f"activation of its {num_stages} stages to itself; make them one "
                            "stage, or place them on two ranks or more")
    return tuple(s % num_ranks for s in range(num_stages))


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> list[range]:
    """The micro-batches of each round of an ``interleaved`` schedule: ``max(1, M // p)``
    rounds as equal as they come (the first ones one larger), so each holds at least ``p``
    where ``M >= p`` (torch's rounds where ``M`` is a multiple of their number)."""
    m = num_microbatches
    rounds = max(1, m // num_ranks)
    out, start = [], 0
    for i in range(rounds):
        size = m // rounds + (1 if i < m % rounds else 0)
        out.append(range(start, start + size))
        start += size
    return out


def interleaved_bounds(num_ranks: int, virtual: int, num_microbatches: int) -> tuple[int, int]:
    """The warm-ups an ``interleaved`` rank may run: at least every forward of its other
    chunks in the first round and one of its last chunk (its first backward is the last
    chunk's of micro-batch 0), at most all ``v M`` forwards. The generator clamps to these;
    the ranks' warm-ups must also not grow along the pipeline and, where ``v > 1``, the first
    rank's exceed the last's by at most twice the smallest round (else a rank's forward of a
    later chunk waits for the last rank, which waits for that rank's backward behind it; the
    validator names the deadlock). torch's depths keep both."""
    first = len(interleaved_rounds(num_ranks, num_microbatches)[0])
    return (virtual - 1) * first + 1, virtual * num_microbatches


def _interleaved_depth(stage: int, num_stages: int, num_microbatches: int,
                       num_ranks: int) -> int:
    p, m = num_ranks, num_microbatches
    v = num_stages // p
    first = len(interleaved_rounds(p, m)[0])
    return min((v - 1) * first + 2 * (p - 1 - stage % p) + 1, v * m)


def _interleaved_depths(warmups: Sequence[int], num_microbatches: int,
                        num_ranks: int) -> tuple[int, ...]:
    p = num_ranks
    lo, hi = interleaved_bounds(p, len(warmups) // max(p, 1), num_microbatches)
    return tuple(max(lo, min(int(w), hi)) for w in warmups)


def _interleaved(num_stages: int, num_microbatches: int, warmups: Sequence[int],
                 receives: bool = True, tokens: dict | None = None,
                 early_receives: bool = False, num_ranks: int | None = None,
                 deferrals: Sequence[int | None] | None = None) -> RankLists:
    """Interleaved 1F1B: rank ``k`` of ``p`` holds stages ``k, k + p, ...``; its forwards in
    rounds (chunk by chunk within each), its backwards in the same rounds with the chunks
    reversed; the rank's warm-up (every stage of the rank carries it) clamped to
    :func:`interleaved_bounds`. Receives are posted one compute action ahead, or
    (``early_receives``) as soon as their sender may send (:func:`_earliest_receives`)."""
    if deferrals is not None:
        raise ScheduleError("deferrals of weight gradients apply to schedule 'zero_bubble' "
                            "only; leave them out")
    n, m = num_stages, num_microbatches
    p = n if num_ranks is None else num_ranks
    placement = _interleaved_place(n, p)
    v = n // p
    lo, hi = interleaved_bounds(p, v, m)
    rounds = interleaved_rounds(p, m)
    orders = []
    for r in range(p):
        mine = [int(warmups[c * p + r]) for c in range(v)]
        if len(set(mine)) > 1:
            raise ScheduleError(f"the stages of pipeline rank {r} ({list(range(r, n, p))}) have "
                                f"warm-ups {mine}; in an interleaved schedule a rank's warm-up "
                                "counts its forwards over all its stages: give them one value")
        w = max(lo, min(mine[0], hi))
        fwd = [(c * p + r, mb) for rnd in rounds for c in range(v) for mb in rnd]
        bwd = [(c * p + r, mb) for rnd in rounds for c in reversed(range(v)) for mb in rnd]
        order = [(_F, s, mb) for s, mb in fwd[:w]]
        nxt = w
        for s, mb in bwd:
            order.append((_B, s, mb))
            if nxt < len(fwd):
                order.append((_F, *fwd[nxt]))
                nxt += 1
        orders.append(order)
    early = _earliest_receives(orders, n, placement) if receives and early_receives \
        else [None] * p
    lists = tuple(tuple(_rank_list(order, n, receives, tokens, None, m, early[r]))
                  for r, order in enumerate(orders))
    return lists, placement


def _earliest_receives(orders: Sequence[Sequence[tuple[ActionKind, int, int]]],
                       num_stages: int, placement: Sequence[int]
                       ) -> list[dict[tuple[bool, int, int], int] | None]:
    """For each rank, where each of its receives may be posted at the earliest: right after
    the last of its own actions that the matching send depends on (through every rank's
    list order and the transfers between them; vector clocks over a replay of the lists).
    Posting earlier could hold a buffer for nothing; posting later holds up a Gloo transfer,
    which moves only once its receive is posted. None for every rank where the lists
    deadlock (the validator then says where)."""
    bodies = [_rank_list(o, num_stages, receives=False) for o in orders]
    p, last = len(bodies), num_stages - 1
    pos = [0] * p
    clock = [[-1] * p for _ in range(p)]  # clock[r][q]: q's last action r's point depends on
    sent: dict[tuple[bool, int, int], list[int]] = {}  # (forward?, stage, mb) -> its clock
    remaining = sum(len(b) for b in bodies)
    while remaining:
        moved = False
        for r in range(p):
            body = bodies[r]
            while pos[r] < len(body):
                kind, s, mb = body[pos[r]]
                need = (True, s - 1, mb) if kind is _F and s > 0 else \
                    (False, s + 1, mb) if kind in BACKWARDS and s < last else None
                if need is not None:
                    got = sent.get(need)
                    if got is None:
                        break
                    clock[r] = [max(a, b) for a, b in zip(clock[r], got)]
                clock[r][r] = pos[r]
                if kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                    sent[(kind is ActionKind.SEND_F, s, mb)] = list(clock[r])
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            return [None] * p
    out: list[dict[tuple[bool, int, int], int] | None] = [{} for _ in range(p)]
    for (fwd, s, mb), c in sent.items():
        to = s + 1 if fwd else s - 1  # the receiving stage
        q = placement[to]
        out[q][(fwd, to, mb)] = c[q] + 1  # type: ignore[index]
    return out


def peak_held(kind: str, num_stages: int, num_microbatches: int, warmups: Sequence[int],
              num_ranks: int | None = None,
              deferrals: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """The most micro-batches whose activations each stage holds at once as its rank's list
    orders them: a forward adds one, the backward that ends its micro-batch (``B``, or
    ``W`` where the backward is split: a deferred weight gradient keeps its inputs) removes
    it. Independent of timing: a rank runs its list in order. What the cost model prices a
    stage's activation memory with."""
    gen = schedule_generator(kind)
    p = num_stages if num_ranks is None else num_ranks
    lists, _ = gen.generate(num_stages, num_microbatches,
                            gen.run_depths(warmups, num_microbatches, p), receives=False,
                            num_ranks=num_ranks, deferrals=deferrals)
    held = [0] * num_stages
    peak = [0] * num_stages
    for lst in lists:
        for k, s, _mb in lst:
            if k is _F:
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            elif k is _B or k is _W:
                held[s] -= 1
    return tuple(peak)


def _fixed(depth: Callable[[int, int, int], int]) -> Callable[[int, int, int, int], int]:
    return lambda i, n, m, p: depth(i, n, m)


_ONE_F_ONE_B_DEPTH = _fixed(lambda i, n, m: min(n - i, m))

GENERATORS: dict[ScheduleKind, ScheduleGenerator] = {
    ScheduleKind.GPIPE: ScheduleGenerator(ScheduleKind.GPIPE, False, _fixed(lambda i, n, m: m),
                                          _one_stage_per_rank, _one_per_rank),
    ScheduleKind.ONE_F_ONE_B: ScheduleGenerator(ScheduleKind.ONE_F_ONE_B, False,
                                                _ONE_F_ONE_B_DEPTH, _one_stage_per_rank,
                                                _one_per_rank),
    ScheduleKind.H1F1B: ScheduleGenerator(ScheduleKind.H1F1B, True, _ONE_F_ONE_B_DEPTH,
                                          _one_stage_per_rank, _one_per_rank),
    ScheduleKind.ZERO_BUBBLE: ScheduleGenerator(ScheduleKind.ZERO_BUBBLE, True,
                                                _ONE_F_ONE_B_DEPTH, _zero_bubble, _one_per_rank,
                                                split_backward=True),
    ScheduleKind.INTERLEAVED: ScheduleGenerator(ScheduleKind.INTERLEAVED, True,
                                                _interleaved_depth, _interleaved,
                                                _interleaved_place, _interleaved_depths),
}
"""Every schedule kind's generator: the one registry the planner, simulator and runtime read."""
