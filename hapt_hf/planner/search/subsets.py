"""Which groups to use: the search on every group, and on sets of groups with others left idle.

A slow group behind a slow link can cost more than it gives: its stages pace the pipeline, or
its link does. So the whole search runs on sets of groups too and the fastest plan wins:

* up to ``EXHAUSTIVE_GROUPS`` groups, every non-empty set of them;
* beyond, a greedy pass: from every group, drop the group whose removal gives the fastest plan,
  while that beats the best so far.

A set is not searched when no plan on it can win: its groups hold no chain of links, their
memory cannot hold the model's weights and optimizer state, or their physical limit (total work
over the sum of their GPUs' speeds, which no plan on them beats) is already no faster than the
best plan found. On clusters where the plan is near the limit this rules out every smaller set.
"""
from __future__ import annotations

import itertools
from typing import Callable

from hapt_hf.errors import PlanningError

from ..cluster import Cluster
from .options import GroupChoice, PlanResult
from .shapes import group_orders

__all__ = ["EXHAUSTIVE_GROUPS", "choose_groups"]

EXHAUSTIVE_GROUPS = 4
"""Up to this many groups every set of them is weighed (15 sets at 4); beyond, greedily."""

Search = Callable[[Cluster], PlanResult]
Bound = Callable[[Cluster], "float | None"]
"""The physical limit of a set of groups, or None when their memory cannot hold the model."""


def _ruled_out(sub: Cluster, bound: Bound, best_s: float) -> str:
    """Why no plan on ``sub`` can beat ``best_s`` (empty: it has to be searched)."""
    if len(sub.groups) > 1 and not group_orders(sub, limit=1):
        return "no chain of links through these groups"
    limit = bound(sub)
    if limit is None:
        return "their memory cannot hold the model's weights and optimizer state"
    if limit >= best_s:
        return f"their physical limit {limit:.4g} s is no faster than the best plan"
    return ""


class _Weigher:
    """Searches sets of groups, remembers what each gave, and keeps the fastest plan."""

    def __init__(self, cluster: Cluster, search: Search, bound: Bound):
        self.cluster, self.search, self.bound = cluster, search, bound
        self.choices: list[GroupChoice] = []
        self.best: PlanResult | None = None
        self.best_kept: tuple[str, ...] = ()
        self.whole: PlanResult | None = None
        self.failure: PlanningError | None = None

    @property
    def best_s(self) -> float:
        return self.best.sim.iteration_s if self.best is not None else float("inf")

    def weigh(self, kept: tuple[str, ...]) -> float | None:
        sub = self.cluster.subset(kept)
        why = _ruled_out(sub, self.bound, self.best_s) if kept != self.full else ""
        if why:
            self.choices.append(GroupChoice(kept, None, why))
            return None
        try:
            res = self.search(sub)
        except PlanningError as e:
            self.failure = self.failure or e
            self.choices.append(GroupChoice(kept, None, str(e)))
            return None
        self.choices.append(GroupChoice(kept, res.sim.iteration_s))
        if kept == self.full:
            self.whole = res
        # a smaller set must be strictly faster: on a tie the GPUs are not left idle
        if res.sim.iteration_s < self.best_s * (1 - 1e-9):
            self.best, self.best_kept = res, kept
        return res.sim.iteration_s

    @property
    def full(self) -> tuple[str, ...]:
        return tuple(self.cluster.group_names)


def _in_order(cluster: Cluster, names) -> tuple[str, ...]:
    keep = set(names)
    return tuple(n for n in cluster.group_names if n in keep)


def _exhaustive(w: _Weigher) -> None:
    full = w.full
    subsets = [_in_order(w.cluster, c) for k in range(len(full) - 1, 0, -1)
               for c in itertools.combinations(full, k)]
    # the most promising first (lowest limit), so the bound rules out more of the rest
    limits = {s: w.bound(w.cluster.subset(s)) for s in subsets}
    subsets.sort(key=lambda s: (limits[s] is None, limits[s] or 0.0, -len(s), s))
    for s in subsets:
        w.weigh(s)


def _greedy(w: _Weigher) -> None:
    current = w.full
    while len(current) > 1:
        before = w.best
        for g in current:
            w.weigh(tuple(n for n in current if n != g))
        if w.best is before:
            return  # dropping one more group did not beat the best plan
        current = w.best_kept


def choose_groups(cluster: Cluster, search: Search, bound: Bound, all_groups: bool
                  ) -> tuple[PlanResult, tuple[str, ...], tuple[GroupChoice, ...],
                             PlanResult | None]:
    """The fastest plan over the sets of groups weighed, the groups it leaves idle, every set
    weighed (the whole cluster first) and the whole cluster's result (None: no plan there).
    Raises the whole cluster's PlanningError when no set has a plan."""
    w = _Weigher(cluster, search, bound)
    w.weigh(w.full)
    if not all_groups and len(cluster.groups) > 1:
        (_exhaustive if len(cluster.groups) <= EXHAUSTIVE_GROUPS else _greedy)(w)
    if w.best is None:
        raise w.failure
    idle = tuple(n for n in cluster.group_names if n not in w.best_kept)
    return w.best, idle, tuple(w.choices), w.whole
