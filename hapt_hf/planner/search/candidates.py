"""The analytic search: candidate shapes in order of their bound, partitioned and scored."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from hapt_hf.core.precision import REPLICATED, SHARDED

from ..cost_model import CostModel
from .options import Layout
from .partition import balanced_step_s, cut_times, estimate_s, partition_layers
from .problem import SearchProblem
from .shapes import micro_batch_options, require_chain, shapes_for, width_options
from .warmups import hapt_warmups, in_flight_guess

__all__ = ["search_layouts", "layout_on"]


@dataclass(order=True)
class _Scored:
    score: float
    key: tuple
    layout: Layout = field(compare=False)


def layout_on(problem: SearchProblem, shapes, mbs: int) -> tuple[float, Layout] | None:
    """The layout the analytic search makes of the stages ``shapes`` (each stage's replicas)
    at micro-batch ``mbs``: layers by the min-max partition under memory, HAPT's warm-ups;
    with its score by HAPT's formula. None where no partition fits."""
    got = _expand(problem, shapes, mbs, ())
    return None if got is None else (got.score, got.layout)


def _expand(problem: SearchProblem, shapes, mbs: int, key: tuple) -> _Scored | None:
    cm, schedule, m = problem.cost_model, problem.schedule, problem.num_microbatches(mbs)
    cap_guess = balanced_step_s(cm, shapes, mbs)
    inflight = in_flight_guess(shapes, mbs, m, schedule, cm, cap_guess)
    part = partition_layers(cm, shapes, mbs, inflight, problem.allow_recompute,
                            lower_bound_s=cap_guess, allow_sharded=problem.allow_sharded,
                            allow_sp=problem.options.allow_sequence_parallel)
    if part is None:
        return None
    cuts = cut_times(cm, shapes, part.bounds, mbs)
    warm = hapt_warmups(shapes, cuts, part.cap_s, m, schedule)
    layout = Layout.build(shapes, part.bounds, part.recompute, mbs, warm, schedule,
                          part.optimizer, part.sequence_parallel)
    return _Scored(estimate_s(cm, layout, m), key, layout)


def _candidates(problem: SearchProblem):
    """(bound, key, widths, mbs) for every stage-shape choice, most promising first."""
    cm, options = problem.cost_model, problem.options
    L = cm.model.num_layers
    max_n = min(L, options.max_stages or L)
    per_group = [width_options(g, problem.global_batch_size, max_n) for g in cm.cluster.groups]
    if math.prod(len(o) for o in per_group) > options.max_shape_combos:
        # at scale, keep equal widths inside a group (unequal ones only where none is equal)
        per_group = [[w for w in o if len(set(w)) == 1] or o for o in per_group]
    out = []
    for combo in itertools.product(*per_group):
        n = sum(len(w) for w in combo)
        if n > max_n:
            continue
        # every replica of a stage holds the stage's weights and optimizer state (sharded: its
        # share of the Adam moments; a replica of t GPUs: each its 1/t of the blocks'), so the
        # stages' memories together must hold the whole model's at least once
        widest = max(max(ws) for ws in combo)
        state = SHARDED if options.allow_sharded_optimizer else REPLICATED
        if sum(cm.capacity_bytes(g) * cm.tp_of(g) * len(ws)
               for g, ws in zip(cm.cluster.groups, combo)) \
                < cm.static_bytes(0, L, state, widest):
            continue
        widths = {g.name: w for g, w in zip(cm.cluster.groups, combo)}
        flat = [w for ws in combo for w in ws]
        for mbs in micro_batch_options(problem.global_batch_size, flat,
                                       options.micro_batch_sizes):
            m = problem.num_microbatches(mbs)
            rate = sum(cm.replica_rate(g, mbs // w) * w
                       for g, ws in zip(cm.cluster.groups, combo) for w in ws)
            bound = (m + n - 1) * mbs / rate
            out.append((bound, (n, mbs, tuple(combo)), widths, mbs))
    out.sort(key=lambda c: (c[0], c[1]))
    return out


def _signature(cm: CostModel, layout: Layout) -> tuple:
    """What prices a layout: its GPUs, widths, places, links and cuts (not group names)."""
    sh = [cm.placement(s.replicas) for s in layout.stages]
    gpus = tuple((s.group.gpu, s.width, s.index[0], s.group.gpus_per_node, s.group.intra_node,
                  s.group.inter_node) for s in sh)
    links = tuple(cm.group_link(a.group.name, b.group.name) if a.group.name != b.group.name
                  else None for a, b in zip(sh, sh[1:]))
    return gpus, links, layout.bounds, layout.micro_batch_size


def _twin(cm: CostModel, a: _Scored, b: _Scored) -> bool:
    return math.isclose(a.score, b.score, rel_tol=1e-12) and \
        _signature(cm, a.layout) == _signature(cm, b.layout)


def search_layouts(problem: SearchProblem):
    """The best few layouts scored by HAPT's formula (scored entries, best first; at most
    ``max(simulate_top, simulate_top_cheap)``) and how many partitions were tried."""
    cm, options = problem.cost_model, problem.options
    orders = require_chain(cm.cluster)
    best: list[_Scored] = []
    tried = expanded = last_gain = 0
    keep = max(options.simulate_top, options.simulate_top_cheap)
    order_score = [math.inf] * len(orders)
    active = list(range(len(orders)))
    for bound, key, widths, mbs in _candidates(problem):
        if len(best) >= options.simulate_top and bound > best[options.simulate_top - 1].score:
            break
        if tried >= options.max_expansions or tried - last_gain > options.patience:
            break
        if expanded == options.order_probe and len(orders) > options.orders_kept:
            # the first candidates rank the orders (links and memory by position decide it);
            # later ones try only the best few orders
            ranked = sorted(range(len(orders)), key=lambda o: (order_score[o], o))
            active = sorted(ranked[:options.orders_kept])
        any_fit = False
        for oi in active:
            tried += 1
            sc = _expand(problem, shapes_for(cm, orders[oi], widths, mbs), mbs, key + (oi,))
            if sc is None:
                continue
            any_fit = True
            order_score[oi] = min(order_score[oi], sc.score)
            if any(_twin(cm, sc, b) for b in best):
                continue  # an order of alike groups that prices the same: keep one
            if len(best) < options.simulate_top or sc < best[options.simulate_top - 1]:
                last_gain = tried
            best.append(sc)
            best.sort()
            del best[keep:]
        expanded += any_fit
    return best, tried
