"""When nothing fits: one message that says how short the GPUs are and what would fit.

Every figure comes from the cost model. A remedy is checked on the most favourable layout the
search can build: one GPU per stage, the largest GPUs first (they run the deepest warm-ups),
each stage taking as many layers as fit under the schedule's own warm-up depths, for each
micro-batch size allowed; with sharded optimizer state (ZeRO-1), also stages of 2, 4, 8...
replicas of one group, each holding its share of the Adam moments; where ``max_tp`` keeps
tensor parallelism out, also replicas of 2, 4 or 8 GPUs of one node (each GPU holding its
share of the blocks' projections), whose degree the advice names. Across group links the
search may run deeper warm-ups, so there the check is an estimate.
"""
from __future__ import annotations

import math

from hapt_hf.core.layers import layer_name
from hapt_hf.core.precision import ADAM_STATE_BYTES, REPLICATED, SHARDED
from hapt_hf.core.schedules import ScheduleKind, default_warmups
from hapt_hf.errors import PlanningError

from ..cluster import GpuGroup
from ..cost_model import CostModel, tp_unfit
from .problem import SearchProblem
from .shapes import divisors

__all__ = ["does_not_fit", "fit_advice"]

def _gb(nbytes: float) -> str:
    gb = nbytes / 1e9
    return f"{gb:.2f} GB" if gb >= 1 else f"{gb:.3g} GB"  # small GPUs still tell apart


def _largest(cm: CostModel) -> list[GpuGroup]:
    """The groups, the most usable memory first (ties by name)."""
    return sorted(cm.cluster.groups, key=lambda g: (-cm.capacity_bytes(g), g.name))


def _mbs_options(problem: SearchProblem) -> list[int]:
    """Micro-batch sizes a one-GPU-per-stage pipeline may use, smallest first."""
    sizes = problem.options.micro_batch_sizes
    return [m for m in divisors(problem.global_batch_size) if sizes is None or m in sizes]


def _holds(problem: SearchProblem, caps: list[float], width: int = 1,
           tps: list[int] | None = None) -> int | None:
    """The largest micro-batch size with which stages of these capacities (in this order;
    ``width`` replicas each, sharding their optimizer state when more than one; each replica
    of ``tps[i]`` GPUs, 1 where not given) hold the whole model under the problem's schedule,
    micro-batch sizes, recompute and depth; None if none does."""
    cm, options = problem.cost_model, problem.options
    recompute = options.allow_recompute
    L = cm.model.num_layers
    n = min(len(caps), L, options.max_stages or L)
    state = SHARDED if width > 1 else REPLICATED
    for mbs in reversed([m for m in _mbs_options(problem) if m % width == 0]):
        warm = default_warmups(options.schedule, n, problem.num_microbatches(mbs))
        s, a = mbs // width, 0
        for i, (cap, w) in enumerate(zip(caps[:n], warm)):
            b, t = a, tps[i] if tps else 1
            # every later stage keeps at least one layer
            while b < L - (n - i - 1) and \
                    cm.memory_bytes(s, a, b + 1, w, recompute, state, width, t) <= cap:
                b += 1
            if b == a:
                break
            a = b
        if a == L:
            return mbs
    return None


def _largest_layer(cm: CostModel, recompute: bool) -> tuple[int, float]:
    """(layer, bytes) of the layer that needs the most memory alone: one sample, one in flight."""
    need = [cm.memory_bytes(1, j, j + 1, 1, recompute) for j in range(cm.model.num_layers)]
    j = max(range(len(need)), key=need.__getitem__)
    return j, need[j]


def _zero1(cm: CostModel, layer: int, need: float, cap: float, allowed: bool,
           widest: int) -> str:
    """What sharding the layer's optimizer state over the stage's replicas would give, and
    what it takes (``widest``: GPUs of the largest group)."""
    params = cm.params[layer + 1] - cm.params[layer]
    opt = params * ADAM_STATE_BYTES
    if need - opt >= cap:
        return ("even sharding its optimizer state over the stage's replicas (ZeRO-1) would "
                f"leave {_gb(need - opt)}, more than the GPU holds")
    d = max(2, math.ceil(opt / (cap - (need - opt))))
    text = (f"sharding its optimizer state (ZeRO-1) over {d} replicas of the stage would bring "
            f"it to {_gb(need - opt + opt / d)}")
    if d > widest:
        return text + f", but the largest group has {widest} GPUs"
    if not allowed:
        return text + ": allow_sharded_optimizer=True (drop --no-sharded-optimizer)"
    return (text + f"; sharding is on, but no layout with stages of {d} replicas holds the "
            "whole model on these GPUs")


def _shard_widths(cm: CostModel) -> list[int]:
    """Stage widths the sharded check tries: powers of two up to the largest group."""
    widest = max(g.size for g in cm.cluster.groups)
    return [1 << k for k in range(1, widest.bit_length()) if 1 << k <= widest]


def _tp_degree(problem: SearchProblem, groups: list[GpuGroup]) -> int | None:
    """The smallest tensor-parallel degree above ``max_tp`` with which replicas of that many
    GPUs of one node (in the groups whose nodes it divides, one GPU a replica elsewhere) hold
    the model, where the model allows it; None where none does or ``max_tp`` allows 8."""
    cm = problem.cost_model
    for t in (2, 4, 8):
        if t <= problem.options.max_tp or tp_unfit(cm.model, t):
            continue
        deg = {g.name: t if g.gpus_per_node % t == 0 else 1 for g in groups}
        if all(d == 1 for d in deg.values()):
            continue
        # per replica, its GPUs' memory; the largest replicas first
        reps = sorted(((cm.capacity_bytes(g), deg[g.name]) for g in groups
                       for _ in range(g.size // deg[g.name])),
                      key=lambda c: -c[0] * c[1])
        if _holds(problem, [c for c, _ in reps], tps=[d for _, d in reps]):
            return t
    return None


def _tp_text(t: int) -> str:
    return (f"max_tp={t} (tensor parallelism: replicas of {t} GPUs of one node, each holding "
            f"1/{t} of every block's projections and optimizer state)")


def _more_gpus(problem: SearchProblem, caps: list[float], big_cap: float) -> int | None:
    """How many more GPUs of ``big_cap`` would hold the model (None: no count up to one stage
    per layer would)."""
    L = problem.num_layers
    # past one stage per layer more GPUs only replicate stages; up to L new ones can still
    # replace smaller GPUs among the first L
    for k in range(1, L + 1):
        grown = sorted(caps + [big_cap] * k, reverse=True)
        if _holds(problem, grown):
            return k
    return None


def fit_advice(problem: SearchProblem) -> list[str]:
    """What would make the job fit, each as one clause with its figures; empty when the
    most favourable layout already fits on the problem's cluster (the search failed for
    another reason, e.g. the widths the global batch allows)."""
    cm, options = problem.cost_model, problem.options
    groups = _largest(cm)
    caps = [cm.capacity_bytes(g) for g in groups for _ in range(g.size)]
    big = groups[0]
    rc = options.allow_recompute

    def holds(**changes) -> int | None:  # on this cluster, with one of the options changed
        p = problem.with_options(**changes) if changes else problem
        got = _holds(p, caps)
        if got or not p.allow_sharded:
            return got
        for d in _shard_widths(cm):  # stages of d GPUs of one group, largest GPUs first
            stage_caps = [cm.capacity_bytes(g) for g in groups for _ in range(g.size // d)]
            got = _holds(p, stage_caps, width=d)
            if got:
                return got
        return None

    if holds():
        return []
    layer, need = _largest_layer(cm, True)
    if need > caps[0]:
        size = math.ceil(need / cm.memory_headroom / 1e7) * 1e7  # as printed, rounded up
        count = _more_gpus(problem, [], size * cm.memory_headroom)
        out = [f"use GPUs with at least {_gb(size)} of memory" + (
            f" ({count} of them, one stage each, hold the model)" if count else "")]
        if need <= big.gpu.memory_gb * 1e9:
            out.append(f"or memory_headroom {math.ceil(need / big.gpu.memory_gb / 1e6) / 1e3} "
                       f"(now {cm.memory_headroom}) holds that layer")
        out.append(_zero1(cm, layer, need, caps[0], options.allow_sharded_optimizer,
                          max(g.size for g in groups)))
        t = _tp_degree(problem, groups)
        if t:
            out.append(f"{_tp_text(t)} fits it")
        return out
    out = []
    if not rc and holds(allow_recompute=True):
        out.append("allow_recompute=True (recompute activations in the backward) fits it")
    if options.schedule == ScheduleKind.GPIPE.value and \
            holds(schedule=ScheduleKind.ONE_F_ONE_B.value):
        out.append("schedule 1f1b (fewer micro-batches in flight: --schedule 1f1b) fits it")
    if options.micro_batch_sizes is not None:
        mbs = holds(micro_batch_sizes=None)
        if mbs:
            out.append(f"micro-batch size {mbs} (--micro-batch {mbs}) fits it")
    if not options.allow_sharded_optimizer and holds(allow_sharded_optimizer=True):
        out.append("allow_sharded_optimizer=True (shard the Adam moments among a stage's "
                   "replicas, ZeRO-1; drop --no-sharded-optimizer) fits it")
    t = _tp_degree(problem, groups)
    if t:
        out.append(f"{_tp_text(t)} fits it")
    more = _more_gpus(problem, caps, caps[0])
    if more:
        out.append(f"{more} more {big.gpu.name} GPU{'s' if more > 1 else ''} (one stage each) "
                   "would hold it")
    elif not out:
        out.append(f"even one {big.gpu.name} GPU per layer does not hold it with the micro-batches "
                   f"schedule {options.schedule} keeps in flight; use GPUs with more memory")
    return out


def _shortfall(problem: SearchProblem) -> str:
    """The need against the capacity: the smallest stage and the whole model's state."""
    cm, options = problem.cost_model, problem.options
    big = _largest(cm)[0]
    layer, need = _largest_layer(cm, options.allow_recompute)
    name = layer_name(layer, cm.model.num_layers, cm.model.layer_unit)
    total = sum(cm.capacity_bytes(g) * g.size for g in cm.cluster.groups)
    return (f"the smallest stage (layer {name} alone, one sample"
            f"{', recompute on' if options.allow_recompute else ''}) needs {_gb(need)} against "
            f"{_gb(cm.capacity_bytes(big))} usable on the largest GPU ({big.gpu.name}, "
            f"memory_headroom {cm.memory_headroom}); weights, gradients and optimizer state "
            f"take {_gb(cm.static_bytes(0, cm.model.num_layers))} against {_gb(total)} usable "
            f"on all {cm.cluster.world_size} GPUs")


def does_not_fit(problem: SearchProblem) -> PlanningError:
    """The error of a job with no plan that fits memory: the shortfall and what would fit."""
    head = (f"no plan of model {problem.model.name!r} fits cluster {problem.cluster.name!r} "
            f"with global batch {problem.global_batch_size}: {_shortfall(problem)}")
    advice = fit_advice(problem)
    if not advice:
        return PlanningError(
            f"{head}; the micro-batch sizes allowed by the stage widths need more memory than "
            "the GPUs have; try a global batch divisible by more widths or more GPUs")
    return PlanningError(f"{head}. What would fit: {'; '.join(advice)}")
