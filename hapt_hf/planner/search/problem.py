"""The search problem: one job's cost model (model and cluster), global batch and options.

Every step of the search takes a :class:`SearchProblem` instead of the three values apart; the
driver derives the problem on a set of groups (:meth:`SearchProblem.on`) and on another layer
sequence of the model (:meth:`SearchProblem.with_model`, whole blocks or halves).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from hapt_hf.errors import PlanningError

from ..cluster import Cluster
from ..cost_model import CostModel
from ..model_spec import ModelSpec
from ..profile import Profile
from .options import PlannerOptions

__all__ = ["SearchProblem"]


@dataclass(frozen=True)
class SearchProblem:
    """What the search plans: the cost model prices every layout of ``cost_model.model`` on
    ``cost_model.cluster``; every plan trains ``global_batch_size`` samples per iteration under
    ``options``. The cost model's efficiency and memory headroom are the ones priced (build the
    problem with :meth:`build` to take them from ``options``)."""

    cost_model: CostModel = field(repr=False)
    global_batch_size: int
    options: PlannerOptions = PlannerOptions()

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise PlanningError(f"global_batch_size {self.global_batch_size} must be >= 1")

    @classmethod
    def build(cls, model: ModelSpec, cluster: Cluster, global_batch_size: int,
              profile: Profile | None = None,
              options: PlannerOptions = PlannerOptions()) -> SearchProblem:
        """The problem of this job, its cost model priced with ``options.efficiency`` and
        ``options.memory_headroom``."""
        return cls(CostModel(model, cluster, profile, options.efficiency,
                             options.memory_headroom), global_batch_size, options)

    def __repr__(self) -> str:
        return (f"SearchProblem(model={self.model.name!r}, layer_unit={self.model.layer_unit!r}, "
                f"cluster={self.cluster.name!r}, groups={list(self.cluster.group_names)}, "
                f"global_batch_size={self.global_batch_size}, options={self.options!r})")

    @property
    def model(self) -> ModelSpec:
        return self.cost_model.model

    @property
    def cluster(self) -> Cluster:
        """The cluster as the search sees it: each tensor-parallel replica's GPUs as one."""
        return self.cost_model.cluster

    @property
    def hardware(self) -> Cluster:
        """The cluster itself (every GPU)."""
        return self.cost_model.hardware

    @property
    def tp(self) -> dict[str, int]:
        """The tensor-parallel degree of each group's replicas."""
        return self.cost_model.tp

    @property
    def profile(self) -> Profile | None:
        return self.cost_model.profile

    @property
    def num_layers(self) -> int:
        return self.cost_model.model.num_layers

    @property
    def schedule(self) -> str:
        return self.options.schedule

    @property
    def allow_recompute(self) -> bool:
        return self.options.allow_recompute

    @property
    def allow_sharded(self) -> bool:
        """Whether a stage of several replicas may shard its optimizer state."""
        return self.options.allow_sharded_optimizer

    def num_microbatches(self, micro_batch_size: int) -> int:
        """Micro-batches per iteration at this micro-batch size."""
        return self.global_batch_size // micro_batch_size

    def on(self, cluster: Cluster) -> SearchProblem:
        """The same problem on another cluster (a set of this one's groups), priced alike, each
        group at its degree."""
        if cluster is self.hardware:
            return self
        cm = self.cost_model
        tp = {g.name: cm.tp[g.name] for g in cluster.groups if cm.tp.get(g.name, 1) > 1}
        return replace(self, cost_model=CostModel(cm.model, cluster, cm.profile, cm.efficiency,
                                                  cm.memory_headroom, tp))

    def with_model(self, model: ModelSpec) -> SearchProblem:
        """The same problem over another layer sequence of the model (whole blocks or halves)."""
        if model is self.model:
            return self
        cm = self.cost_model
        return replace(self, cost_model=CostModel(model, cm.hardware, cm.profile, cm.efficiency,
                                                  cm.memory_headroom, cm.tp))

    def with_tp(self, tp: Mapping[str, int]) -> SearchProblem:
        """The same problem searched with each group's replicas at these tensor-parallel
        degrees (a group not named: 1)."""
        full = {g.name: tp.get(g.name, 1) for g in self.hardware.groups}
        if full == self.tp:
            return self
        return replace(self, cost_model=self.cost_model.with_tp(
            {n: t for n, t in full.items() if t > 1}))

    def with_options(self, **changes) -> SearchProblem:
        """The same cost model and batch under options with these fields changed."""
        return replace(self, options=replace(self.options, **changes))
