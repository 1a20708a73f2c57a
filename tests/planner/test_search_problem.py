"""The search problem: one cost model, global batch and options, derived on groups and units."""
from __future__ import annotations

import pytest

from hapt_hf.planner.search import PlannerOptions, PlanningError, SearchProblem, physical_limit_s

from .test_cost_model import toy_model, two_groups


def test_build_prices_with_the_options_efficiency_and_headroom():
    opts = PlannerOptions(efficiency=0.3, memory_headroom=0.8, schedule="1f1b")
    p = SearchProblem.build(toy_model(), two_groups(), 12, options=opts)
    assert p.cost_model.efficiency == 0.3 and p.cost_model.memory_headroom == 0.8
    assert p.model is p.cost_model.model and p.cluster is p.cost_model.cluster
    assert p.schedule == "1f1b" and p.num_microbatches(4) == 3
    assert "global_batch_size=12" in repr(p) and "'two'" in repr(p)


def test_on_a_set_of_groups_and_another_unit_keeps_the_pricing():
    opts = PlannerOptions(efficiency=0.3, memory_headroom=0.8)
    p = SearchProblem.build(toy_model(), two_groups(), 12, options=opts)
    sub = p.on(p.cluster.subset(["a"]))
    assert list(sub.cluster.group_names) == ["a"]
    assert sub.cost_model.efficiency == 0.3 and sub.cost_model.memory_headroom == 0.8
    assert sub.global_batch_size == 12 and sub.options is opts
    # the limit of fewer GPUs is no faster
    assert physical_limit_s(sub) > physical_limit_s(p)
    deeper = p.with_model(toy_model(6))
    assert deeper.num_layers == p.num_layers + 2 and deeper.cluster is p.cluster
    assert deeper.cost_model.efficiency == 0.3 and deeper.cost_model.memory_headroom == 0.8
    assert p.with_model(p.model) is p and p.on(p.cluster) is p


def test_with_options_changes_only_the_options():
    p = SearchProblem.build(toy_model(), two_groups(), 12)
    q = p.with_options(allow_recompute=False)
    assert q.cost_model is p.cost_model and not q.allow_recompute and p.allow_recompute


def test_a_global_batch_below_one_is_refused_naming_the_field():
    with pytest.raises(PlanningError, match="global_batch_size 0 must be >= 1"):
        SearchProblem.build(toy_model(), two_groups(), 0)
