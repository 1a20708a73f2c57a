"""Stage shapes: how each group is cut into stages (each stage's replicas), group orders,
micro-batch sizes."""
from __future__ import annotations

import itertools
import math

from hapt_hf.errors import PlanningError

from ..cluster import Cluster, GpuGroup
from ..cost_model import CostModel
from ..plan import Replica

__all__ = ["divisors", "compositions", "group_cuts", "width_options", "group_orders",
           "require_chain", "shapes_for",
           "micro_batch_options"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def compositions(total: int, parts: int):
    """Ordered ways to write ``total`` as ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def group_cuts(size: int):
    """Every way to cut a group of ``size`` GPUs into stages of any widths, in order."""
    for k in range(1, size + 1):
        yield from compositions(size, k)


def _split(size: int, k: int, allowed: set[int]) -> tuple[int, ...] | None:
    """``size`` GPUs as ``k`` stage widths from ``allowed``, as equal as possible, widest first."""
    if size % k == 0 and size // k in allowed:
        return (size // k,) * k
    best = None
    for hi in sorted(allowed):
        for lo in sorted(allowed):
            if lo >= hi:
                break
            # x stages of width hi, k - x of width lo
            if (size - k * lo) % (hi - lo):
                continue
            x = (size - k * lo) // (hi - lo)
            if 0 < x < k and (best is None or hi / lo < best[0]):
                best = (hi / lo, (hi,) * x + (lo,) * (k - x))
    return best[1] if best else None


def width_options(group: GpuGroup, global_batch_size: int,
                  max_k: int) -> list[tuple[int, ...]]:
    """Ways to cut one group into stages (widths per stage), fewest stages first."""
    allowed = {d for d in divisors(global_batch_size) if d <= group.size}
    out = []
    for k in range(1, min(group.size, max_k) + 1):
        w = _split(group.size, k, allowed)
        if w is not None:
            out.append(w)
    return out


def group_orders(cluster: Cluster, limit: int = 720) -> list[tuple[GpuGroup, ...]]:
    """Orders of all groups along the pipeline in which every pair of neighbours is linked."""
    names = {frozenset((l.a, l.b)) for l in cluster.links}
    out = []
    for perm in itertools.permutations(cluster.groups):
        if all(frozenset((a.name, b.name)) in names for a, b in zip(perm, perm[1:])):
            out.append(perm)
            if len(out) >= limit:
                break
    return out


def require_chain(cluster: Cluster) -> list[tuple[GpuGroup, ...]]:
    """The orders of :func:`group_orders`; none is an error naming the fix."""
    orders = group_orders(cluster)
    if not orders:
        raise PlanningError("no order of the groups has a link between every pair of "
                            "neighbours; add links under 'links:' so the groups form a chain")
    return orders


def shapes_for(cm: CostModel, order: tuple[GpuGroup, ...], widths: dict[str, tuple[int, ...]],
               mbs: int) -> tuple[tuple[Replica, ...], ...]:
    """Each stage's replicas: the groups in ``order``, each cut into stages of ``widths`` (its
    GPUs in order), every stage splitting a micro-batch of ``mbs`` evenly."""
    shapes = []
    for g in order:
        off = 0
        for w in widths[g.name]:
            shapes.append(cm.slice_replicas(g, w, off, mbs))
            off += w
    return tuple(shapes)


def micro_batch_options(global_batch_size: int, widths: list[int],
                        wanted: tuple[int, ...] | None) -> list[int]:
    """Micro-batch sizes dividing the global batch that every width divides (of ``wanted``,
    where given)."""
    l = math.lcm(*widths) if widths else 1
    opts = [m for m in divisors(global_batch_size) if m % l == 0]
    if wanted is not None:
        opts = [m for m in opts if m in wanted]
    return opts
