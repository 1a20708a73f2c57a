"""Layer ranges: the min-max partition under memory, and HAPT's formula that scores it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from hapt_hf.core.precision import REPLICATED

from ..cost_model import CostModel, Placement
from .options import Layout
from .state import faster_state, state_options

_R = TypeVar("_R")

__all__ = ["Partition", "partition_layers", "recompute_flags", "cut_times", "balanced_step_s",
           "estimate_s"]


@dataclass(frozen=True)
class Partition:
    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    cap_s: float
    optimizer: tuple[str, ...] = ()
    """Each stage's optimizer state (see :mod:`~hapt_hf.planner.search.state`)."""
    sequence_parallel: tuple[bool, ...] = ()
    """Each stage's sequence parallelism (on only where it lets the stage reach farther)."""


def _stage_reach(cm: CostModel, sh: Placement, samples: int, t, a: int, cap: float,
                 limit: int, allow_rc: bool, mem_pre: dict, memo: dict,
                 record: list | None = None) -> tuple[int, bool, str, bool]:
    """Farthest end b (<= limit) of a stage of alike replicas starting at a, with its recompute
    flag, optimizer state and sequence parallelism (the least recompute, then no sequence
    parallelism, then the faster step, among those reaching as far); (a, _, _, _) when nothing
    fits. ``t`` is the replicas' layer table, ``mem_pre`` maps (recompute, state, sequence
    parallel) to memory prefixes.

    The cap enters only through how far the compute reaches under it: memory's reach from
    ``a`` (the same for every cap of a bisection) is kept in ``memo``, one per stage and
    partition (:func:`_memory_reach`). ``record`` gets, per recompute setting, what another
    cap must keep for the same answer (:func:`_same_reach`)."""
    by_rc = memo.get(a)
    if by_rc is None:
        by_rc = memo[a] = [(rc, t.fb_rc if rc else t.fb, options, max(b for b, _, _ in options))
                           for rc, options in _memory_reach(cm, sh, samples, a, limit, allow_rc,
                                                            mem_pre)]
    best = (a, False, REPLICATED, False)
    for rc, pre, options, most in by_rc:
        reach_t = cm.max_layers_fitting(pre, a, cap)
        if reach_t >= most:  # past every state's memory reach: the stage ends where memory does
            if record is not None:
                record.append((pre, a, most, None))
            reach = options
        else:
            if record is not None:
                record.append((pre, a, reach_t, reach_t + 1))
            reach = [(min(reach_t, b), sp, opt) for b, sp, opt in options]
        b = max(r for r, _, _ in reach)
        if b > best[0]:
            sp = min(p for r, p, _ in reach if r == b)
            ties = [o for r, p, o in reach if r == b and p == sp]
            if len(ties) == 1:
                opt = ties[0]
            else:
                key = (a, b, tuple(ties))
                opt = memo.get(key)
                if opt is None:
                    opt = memo[key] = faster_state(cm, sh.replicas, samples, a, b, ties)
            best = (b, rc, opt, sp)
    return best


def _same_reach(record: list, cap: float) -> bool:
    """Whether ``cap`` gives every stage of a greedy pass the compute reach (or, past what
    memory holds, the memory reach) that ``record`` kept: for each, its compute prefix, its
    start, the end ``cap`` must reach and the first end it must not (None: any)."""
    for pre, a, lo, hi in record:
        x = pre[a] + cap  # as :meth:`~hapt_hf.planner.cost_model.CostModel.max_layers_fitting`
        if pre[lo] > x or (hi is not None and pre[hi] <= x):
            return False
    return True


def _memory_reach(cm: CostModel, sh: Placement, samples: int, a: int, limit: int,
                  allow_rc: bool, mem_pre: dict) -> list[tuple[bool, list[tuple[int, bool, str]]]]:
    """Per recompute setting, each (state, sequence parallel)'s farthest end from ``a`` (at
    most ``limit``) that memory holds, as ``(b, sp, state)``: weights, state and micro-batches
    (the prefix) plus the working set. Both grow with ``b``, so every end short of it fits
    too, and a compute reach ``r`` ends such a stage at ``min(r, b)``."""
    capacity = cm.capacity_bytes(sh.group)
    out = []
    for rc in ((False, True) if allow_rc else (False,)):
        options = []
        for opt, sp in ((o, p) for r, o, p in mem_pre if r == rc):
            mp = mem_pre[rc, opt, sp]
            b = min(limit, cm.max_layers_fitting(mp, a, capacity))
            while b > a and \
                    mp[b] - mp[a] + cm.working_bytes(samples, a, b, sh.tp, sp) > capacity:
                b -= 1
            options.append((b, sp, opt))
        out.append((rc, options))
    return out


def _mem_prefixes(cm: CostModel, sh: Placement, samples: int, in_flight: int, allow_rc: bool,
                  allow_sharded: bool, allow_sp: bool = False) -> dict:
    sps = (False, True) if allow_sp and cm.sp_allowed(sh.tp) else (False,)
    return {(rc, o, sp): cm.memory_prefix(samples, in_flight, rc, o, sh.width, sh.tp, sp)
            for rc in ((False, True) if allow_rc else (False,))
            for o in state_options(sh.width, allow_sharded) for sp in sps}


def smallest_feasible_cap(feasible: Callable[[float], _R | None], lo: float, hi: float, got: _R,
                          rel_tol: float = 0.0, max_halvings: int = 60) -> tuple[float, _R]:
    """Bisect for the smallest stage cap in (lo, hi] that ``feasible`` accepts (it returns the
    partition it found, or None), given ``got = feasible(hi)``; stop within ``rel_tol`` or after
    ``max_halvings``. Returns (cap, partition)."""
    for _ in range(max_halvings):
        if hi - lo <= rel_tol * hi:
            break
        mid = (lo + hi) / 2
        g = feasible(mid)
        if g is None:
            lo = mid
        else:
            hi, got = mid, g
    return hi, got


def partition_layers(cm: CostModel, shapes, mbs: int, in_flight: list[int],
                     allow_recompute: bool, rel_tol: float = 1e-3,
                     lower_bound_s: float = 0.0, allow_sharded: bool = False,
                     allow_sp: bool = False, reuse: bool = True) -> Partition | None:
    """Min-max contiguous partition of the layers over ``shapes`` (each stage's replicas, alike
    in each stage; no empty stage) under every stage's memory; None if no partition fits.
    ``allow_sharded``: a stage of several replicas may shard its optimizer state to hold more
    layers; ``allow_sp``: a stage of replicas of several GPUs may run sequence parallel
    (where the model allows it) to hold more. ``reuse``: a greedy pass whose every reach a cap
    leaves as the last pass on its side did gives that pass's answer without running (the
    same partition; False runs every pass, for the tests)."""
    n, L = len(shapes), cm.model.num_layers
    if n > L:
        return None
    info = []
    for reps, k in zip(shapes, in_flight):
        sh = cm.placement(reps)
        s = mbs // sh.width
        info.append((sh, s, cm.table(sh.group, s, sh.tp),
                     _mem_prefixes(cm, sh, s, k, allow_recompute, allow_sharded, allow_sp), {}))

    def reached(cap: float, record: list):
        a, bounds, rcs, opts, sps = 0, [], [], [], []
        for i, (sh, s, t, mp, memo) in enumerate(info):
            limit = L - (n - i - 1)
            b, rc, opt, sp = _stage_reach(cm, sh, s, t, a, cap, limit, allow_recompute, mp,
                                          memo, record)
            if b <= a:
                return None
            bounds.append((a, b))
            rcs.append(rc)
            opts.append(opt)
            sps.append(sp)
            a = b
        return (tuple(bounds), tuple(rcs), tuple(opts), tuple(sps)) if a == L else None

    # a bisection's caps often leave every stage's reach as the last cap on the same side left
    # it: then its answer stands (exactly), and the greedy is not run again
    last: dict[bool, tuple[list, object]] = {}

    def greedy(cap: float):
        for record, got in last.values() if reuse else ():
            if _same_reach(record, cap):
                return got
        record: list = []
        got = reached(cap, record)
        last[got is not None] = (record, got)
        return got

    # no partition beats the perfectly balanced step, so start there and double until it fits
    top = max(t.fb_rc[-1] for _, _, t, *_ in info) * 1.001
    lo = min(lower_bound_s, top) if lower_bound_s > 0 else 0.0
    hi = max(lo * 1.25, top * 1e-3)
    got = greedy(hi)
    while got is None and hi < top:
        lo, hi = hi, min(hi * 2, top)
        got = greedy(hi)
    if got is None:
        return None
    hi, got = smallest_feasible_cap(greedy, lo, hi, got, rel_tol)
    return Partition(got[0], got[1], hi, got[2], got[3])


def recompute_flags(cm: CostModel, shapes, bounds, mbs: int, warm, allow_rc: bool):
    """Per stage: recompute off if it fits without, on if only that fits; None if one cannot."""
    rcs = []
    for reps, (a, b), w in zip(shapes, bounds, warm):
        sh = cm.placement(reps)
        s, cap = mbs // sh.width, cm.capacity_bytes(sh.group)
        if cm.memory_bytes(s, a, b, w, False, tp=sh.tp) <= cap:
            rcs.append(False)
        elif allow_rc and cm.memory_bytes(s, a, b, w, True, tp=sh.tp) <= cap:
            rcs.append(True)
        else:
            return None
    return tuple(rcs)


def cut_times(cm: CostModel, shapes, bounds, mbs: int) -> list[float]:
    return [cm.cut_s(shapes[i], shapes[i + 1], bounds[i][1] - 1, mbs)
            for i in range(len(shapes) - 1)]


def balanced_step_s(cm: CostModel, shapes, mbs: int) -> float:
    """Per-micro-batch time if every stage carried work in proportion to its speed."""
    rate = sum(cm.replica_rate(sh.group, mbs // sh.width, sh.tp) * sh.width
               for sh in map(cm.placement, shapes))
    return mbs / rate


def estimate_s(cm: CostModel, layout: Layout, num_microbatches: int) -> float:
    """HAPT's pipeline formula: fill and drain plus (M - 1) times the slowest stage or cut."""
    st = cm.stage_costs(layout.stages, layout.micro_batch_size).stages
    steps = [c.forward_s + c.backward_s for c in st]
    cuts = [c.send_forward_s for c in st[:-1]]
    # in the steady state a cut passes one micro-batch a period each way: its link is held
    # for the transfer, and the latency of one overlaps the next (a cut costs the same both
    # ways, so the forward sends stand for it)
    period = max(steps + [c.send_forward_busy_s for c in st[:-1]])
    # the drain runs upstream: stage i's last backward ends the earlier by the backward and
    # cut times of the stages before it, so its all-reduce and step overlap theirs (the part
    # of its all-reduce that its own last backward hides adds nothing)
    tail, ahead = 0.0, 0.0
    for i, c in enumerate(st):
        tail = max(tail, c.allreduce_after_s + c.update_s + c.allgather_s - ahead)
        ahead += c.backward_s + (cuts[i - 1] if i > 0 else 0.0)
    return sum(steps) + 2 * sum(cuts) + (num_microbatches - 1) * period + tail
