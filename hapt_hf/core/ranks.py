"""How global ranks are numbered: group by group in cluster-file order, node by node inside a
group. The planner, the cost model and the cluster file all count ranks this way."""
from __future__ import annotations

from typing import Iterable

__all__ = ["first_ranks"]


def first_ranks(group_sizes: Iterable[tuple[str, int]]) -> dict[str, int]:
    """The first global rank of each group, from (name, number of GPUs) in file order."""
    out, start = {}, 0
    for name, size in group_sizes:
        out[name] = start
        start += size
    return out
