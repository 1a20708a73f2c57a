"""When nothing fits: one message that says how short the GPUs are and what would fit."""
from __future__ import annotations

from hapt_hf.errors import PlanningError

from ..cost_model import CostModel
from .options import PlannerOptions

__all__ = ["does_not_fit"]


def _fill(cm: CostModel, caps: list[float], extra: float = 0.0) -> int:
    """Layers that GPUs of these capacities (one stage each, one sample in flight, recompute
    on) hold when each takes as many as fit, in order."""
    L, a = cm.model.num_layers, 0
    for cap in caps:
        b = a
        while b < L and cm.memory_bytes(1, a, b + 1, 1, True) <= cap + extra:
            b += 1
        a = b
        if a == L:
            break
    return a


def does_not_fit(cm: CostModel, global_batch: int, options: PlannerOptions) -> PlanningError:
    L = cm.model.num_layers
    caps = sorted((cm.capacity_bytes(g) for g in cm.cluster.groups for _ in range(g.size)),
                  reverse=True)
    if _fill(cm, caps) < L:
        # the bytes each GPU lacks: the least extra capacity that lets the GPUs hold it all
        lo, hi = 0.0, max(cm.memory_bytes(1, 0, L, 1, True), 1.0)
        while hi - lo > max(1e6, 1e-4 * hi):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if _fill(cm, caps, mid) == L else (mid, hi)
        big = max(cm.cluster.groups, key=lambda g: (g.gpu.memory_gb, g.name))
        cap_big = cm.capacity_bytes(big)
        done, more = _fill(cm, caps), 0
        while done < L:  # keep adding the largest GPU of the cluster, one stage each
            nxt = _fill_from(cm, done, cap_big)
            if nxt == done:
                break
            done, more = nxt, more + 1
        fix = (f"{more} more {big.gpu.name} GPUs would fit it" if done == L else
               f"a single layer needs more than one {big.gpu.name} holds; use GPUs with more "
               "memory")
        return PlanningError(
            f"model {cm.model.name!r} does not fit on cluster {cm.cluster.name!r}: even with one "
            f"GPU per stage, recompute and one sample per micro-batch, the GPUs are short by "
            f"{hi / 1e9:.2f} GB per GPU; {fix} (or raise memory_headroom, now "
            f"{options.memory_headroom})")
    return PlanningError(
        f"no plan of model {cm.model.name!r} fits cluster {cm.cluster.name!r} with global batch "
        f"{global_batch}: the micro-batch sizes allowed by the stage widths need more memory "
        "than the GPUs have; try a global batch divisible by more widths, allow_recompute=True, "
        "or more GPUs")


def _fill_from(cm: CostModel, a: int, cap: float) -> int:
    b, L = a, cm.model.num_layers
    while b < L and cm.memory_bytes(1, a, b + 1, 1, True) <= cap:
        b += 1
    return b
