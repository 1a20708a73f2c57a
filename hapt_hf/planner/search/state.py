"""Optimizer state per stage: replicated, or sharded among the stage's replicas (ZeRO-1).

A sharded stage keeps its fp32 weights and gradients whole on every replica and splits only
the Adam moments (``8 + 8/d`` bytes per parameter instead of 16), updates ``1/d`` of the
parameters on each replica and then all-gathers the updated weights. The search takes, per
stage, the least recompute that fits, and among the states that fit with it the faster
optimizer step (update plus all-gather): replicated unless only sharded fits, or sharding's
cheaper update outweighs its all-gather.
"""
from __future__ import annotations

from hapt_hf.core.layers import layer_name
from hapt_hf.core.precision import REPLICATED, SHARDED

from ..cost_model import CostModel
from ..plan import Plan, Replica

__all__ = ["state_options", "faster_state", "stage_state", "partial_recompute",
           "fewest_recomputed", "sharding_reason", "sharding_reasons"]


def state_options(width: int, allow_sharded: bool) -> tuple[str, ...]:
    """The optimizer states a stage of ``width`` replicas may keep: sharding needs two."""
    return (REPLICATED, SHARDED) if allow_sharded and width > 1 else (REPLICATED,)


def faster_state(cm: CostModel, replicas: tuple[Replica, ...], samples: int, a: int, b: int,
                 states) -> str:
    """The state among ``states`` whose optimizer step is the shorter (replicated on a tie)."""
    return min(states, key=lambda o: (cm.optimizer_step_s(replicas, samples, a, b, o),
                                      o != REPLICATED))


def stage_state(cm: CostModel, replicas: tuple[Replica, ...], mbs: int, a: int, b: int,
                in_flight: int, allow_rc: bool, allow_sharded: bool,
                allow_sp: bool = False) -> tuple[bool, str, bool] | None:
    """(recompute, optimizer, sequence parallel) that lets the stage hold layers [a, b) with
    ``in_flight`` micro-batches: recompute only where nothing fits without, then sequence
    parallelism only where nothing fits without (``allow_sp`` and the model allowing it),
    then the faster step among the states that fit; None when nothing fits."""
    p = cm.placement(replicas)
    # every kind of replica against its own GPU (a mixed stage's shares and GPUs differ)
    kinds = {(g.name, r.samples): (g, r.samples)
             for g, r in zip(p.group_of, p.replicas)}.values()
    sps = (False, True) if allow_sp and cm.sp_allowed(p.tp) else (False,)
    for rc in ((False, True) if allow_rc else (False,)):
        for sp in sps:
            fits = [o for o in state_options(p.width, allow_sharded)
                    if all(cm.memory_bytes(s, a, b, in_flight, rc, o, p.width, p.tp, sp)
                           <= cm.capacity_bytes(g) for g, s in kinds)]
            if fits:
                return rc, faster_state(cm, replicas, mbs // p.width, a, b, fits), sp
    return None


def fewest_recomputed(fits, units: int) -> int:
    """The fewest block units from a stage's first whose recompute lets it fit: ``fits(k)``
    says whether ``k`` of its ``units`` recomputing fit (more recomputed, less memory: the
    answer is found by bisection), ``units`` where only all of them do."""
    lo, hi = 0, units  # fits(hi) is the caller's premise; fits(lo) is not known yet
    if fits(0):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def partial_recompute(cm: CostModel, replicas: tuple[Replica, ...], mbs: int, a: int, b: int,
                      in_flight: int, allow_sharded: bool,
                      allow_sp: bool = False) -> tuple[int, str, bool] | None:
    """Where a stage holding layers [a, b) with ``in_flight`` micro-batches must recompute:
    (how many of its block units, from its first, recompute (``Stage.recompute_layers``; all
    of them where only that fits), optimizer state, sequence parallelism), the fewest units,
    then no sequence parallelism, then the faster step; None where not even all of them fit.
    A recomputed block keeps only its input and runs its forward again in the backward, so
    the fewest that fit cost the least."""
    p = cm.placement(replicas)
    units = max(min(b, cm.model.num_layers - 1) - max(a, 1), 0)
    kinds = {(g.name, r.samples): (g, r.samples)
             for g, r in zip(p.group_of, p.replicas)}.values()
    sps = (False, True) if allow_sp and cm.sp_allowed(p.tp) else (False,)
    best: tuple[int, bool, list[str]] | None = None
    for sp in sps:
        opts = state_options(p.width, allow_sharded)

        def fits(k: int, o: str, sp: bool = sp) -> bool:
            return all(cm.memory_bytes(s, a, b, in_flight, k >= units, o, p.width, p.tp, sp,
                                       k if k < units else 0) <= cm.capacity_bytes(g)
                       for g, s in kinds)
        found = [(fewest_recomputed(lambda k, o=o: fits(k, o), units), o)
                 for o in opts if fits(units, o)]
        if not found:
            continue
        k = min(x for x, _ in found)
        if best is None or k < best[0]:
            best = (k, sp, [o for x, o in found if x == k])
    if best is None:
        return None
    k, sp, states = best
    return k, faster_state(cm, replicas, mbs // p.width, a, b, states), sp


def _layers_fitting(cm: CostModel, replicas: tuple[Replica, ...], samples: int, a: int,
                    in_flight: int, rc: bool, optimizer: str, sp: bool = False) -> int:
    """How many layers from ``a`` one GPU of the stage holds with this state."""
    p = cm.placement(replicas)
    cap, b = cm.capacity_bytes(p.group), a
    while b < cm.model.num_layers and cm.memory_bytes(samples, a, b + 1, in_flight, rc,
                                                      optimizer, p.width, p.tp, sp) <= cap:
        b += 1
    return b - a


def sharding_reason(cm: CostModel, replicas: tuple[Replica, ...], mbs: int, a: int, b: int,
                    in_flight: int, recompute: bool, sp: bool = False) -> str:
    """Why a stage holding layers [a, b) with ``in_flight`` micro-batches (sequence parallel
    where ``sp``) keeps its optimizer state sharded: how much less it would hold replicated,
    or its faster step."""
    p = cm.placement(replicas)
    s, w, cap = mbs // p.width, p.width, cm.capacity_bytes(p.group)
    if cm.memory_bytes(s, a, b, in_flight, recompute, REPLICATED, w, p.tp, sp) <= cap:
        rep = cm.optimizer_step_s(replicas, s, a, b, REPLICATED)
        shd = cm.optimizer_step_s(replicas, s, a, b, SHARDED)
        return (f"faster optimizer step: {shd * 1e3:.1f} ms (update of 1/{w} of the "
                f"parameters, then all-gather) against {rep * 1e3:.1f} ms replicated")
    fit_r = _layers_fitting(cm, replicas, s, a, in_flight, recompute, REPLICATED, sp)
    fit_s = _layers_fitting(cm, replicas, s, a, in_flight, recompute, SHARDED, sp)
    text = (f"fits {fit_s} layers per {p.group.gpu.name} from "
            f"{layer_name(a, cm.model.num_layers, cm.model.layer_unit)} instead of {fit_r}")
    if not recompute and \
            cm.memory_bytes(s, a, b, in_flight, True, REPLICATED, w, p.tp, sp) <= cap:
        text += " (replicated, these layers would need recompute)"
    return text


def sharding_reasons(cm: CostModel, plan: Plan, in_flight=()) -> dict[int, str]:
    """Stage index -> why it shards its optimizer state, for every sharded stage of ``plan``
    (``cm`` over the plan's layer sequence; ``in_flight``: the most micro-batches each stage
    holds, by default its warm-up depth)."""
    depth = tuple(in_flight) or plan.warmups()
    return {s.index: sharding_reason(cm, s.replicas, plan.micro_batch_size, *s.layers,
                                     depth[s.index], s.recompute, s.sequence_parallel)
            for s in cm.stages_of(plan) if s.optimizer == SHARDED}
