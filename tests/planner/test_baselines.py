"""Baseline splits: what each one cuts, and that they are scored like the planner's plans."""
from __future__ import annotations

import itertools

import pytest

from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import LayerSpec, ModelSpec
from hapt_hf.planner.search import SearchProblem
from hapt_hf.planner.search.baselines import (BASELINES, _param_balanced, _speed_proportional,
                                              _uniform, baseline_plans)
from hapt_hf.planner.simulate import simulate_plan


def model(blocks: int = 8, emb_params: int = 5000) -> ModelSpec:
    layers = [LayerSpec(0, "embedding", "emb", emb_params, 1e9, 2e9, 1e5, 1e5)]
    layers += [LayerSpec(i + 1, "block", "blk", 1000 + 100 * (i % 3), 1e11, 2e11, 1e5, 1e6, 1e5)
               for i in range(blocks)]
    layers.append(LayerSpec(blocks + 1, "head", "head", 10, 3e10, 6e10, 0, 1e6, 1e5))
    return ModelSpec("m", "gpt2", 64, blocks, 100, 64, "fp16", True, tuple(layers))


def grp(name, tflops, gpus, mem=16.0, gpn=None):
    link = LinkSpec(100, 10)
    gpn = gpn or gpus
    return GpuGroup(name, GpuType(name.upper(), tflops, mem), gpus // gpn, gpn, link, link)


def cluster(slow=2, fast=2, mem=16.0) -> Cluster:
    return Cluster("c", (grp("slow", 50.0, slow, mem), grp("fast", 200.0, fast, mem)),
                   (GroupLink("slow", "fast", LinkSpec(10.0, 100.0)),))


def edges(cuts, L):
    e = [0, *cuts, L]
    return list(zip(e, e[1:]))


def test_uniform_splits_blocks_evenly_with_embedding_first_and_head_last():
    m = model(blocks=8)
    cm = CostModel(m, cluster())
    shapes = [cm.slice_replicas(cm.group("slow"), 1, 0, 1)] * 4
    assert edges(_uniform(cm, shapes, 1), m.num_layers) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert _uniform(cm, [cm.slice_replicas(cm.group("slow"), 1, 0, 1)] * 9, 1) is None


def test_param_balanced_minimises_the_largest_stage_parameter_count():
    m = model(blocks=6, emb_params=2500)
    cm = CostModel(m, cluster())
    n, L = 3, m.num_layers
    cuts = _param_balanced(cm, [cm.slice_replicas(cm.group("slow"), 1, 0, 1)] * n, 1)
    got = max(cm.params[b] - cm.params[a] for a, b in edges(cuts, L))
    best = min(max(cm.params[b] - cm.params[a] for a, b in edges(c, L))
               for c in itertools.combinations(range(1, L), n - 1))
    assert got == best


def test_speed_proportional_gives_the_fast_stage_more_flops():
    m = model(blocks=10)
    cm = CostModel(m, cluster())
    shapes = [cm.slice_replicas(cm.group("slow"), 1, 0, 1),
              cm.slice_replicas(cm.group("fast"), 1, 0, 1)]
    (a0, b0), (a1, b1) = edges(_speed_proportional(cm, shapes, 1), m.num_layers)
    flops = [l.fwd_flops + l.bwd_flops for l in m.layers]
    share_fast = sum(flops[a1:b1]) / sum(flops)
    assert share_fast == pytest.approx(0.8, abs=0.06)


def test_every_baseline_gives_a_valid_plan_scored_by_the_simulator():
    m, cl = model(), cluster()
    res = baseline_plans(SearchProblem.build(m, cl, 8))
    assert set(res) == set(BASELINES)
    for name, b in res.items():
        assert b.plan is not None, (name, b.reason)
        b.plan.validate(world_size=cl.world_size)
        again = simulate_plan(b.plan, m, cl)
        assert again.iteration_s == pytest.approx(b.sim.iteration_s), name
    for name in ("uniform", "param_balanced", "speed_proportional"):
        p = res[name].plan
        assert p.schedule == "1f1b" and len({s.width for s in p.stages}) == 1
        assert [s.group for s in p.stages] == sorted((s.group for s in p.stages),
                                                    key=["slow", "fast"].index)
    # a split that knows the speeds beats one that does not
    assert res["speed_proportional"].sim.iteration_s < res["uniform"].sim.iteration_s


def test_hapt_recipe_keeps_the_file_order_power_of_two_shapes_and_its_warmups():
    m = model(blocks=12)
    cl = Cluster("c", (grp("fast", 200.0, 4, gpn=2), grp("slow", 50.0, 6, gpn=6)),
                 (GroupLink("slow", "fast", LinkSpec(1.0, 1000.0)),))
    p = baseline_plans(SearchProblem.build(m, cl, 24))["hapt_recipe"].plan
    assert p.schedule == "h1f1b"
    groups = [s.group for s in p.stages]
    assert groups == sorted(groups, key=["fast", "slow"].index)
    for s in p.stages:
        g = cl.groups[0] if s.group == "fast" else cl.groups[1]
        assert s.width & (s.width - 1) == 0 and s.width <= g.gpus_per_node
    w = p.warmups()
    assert w[-1] == 1 and all(a > b for a, b in zip(w, w[1:]))
    cross = next(i for i in range(len(groups) - 1) if groups[i] != groups[i + 1])
    assert w[cross] - w[cross + 1] in (1, 2, 3)


def test_a_baseline_that_cannot_fit_says_so():
    res = baseline_plans(SearchProblem.build(model(), cluster(mem=1e-5), 8))
    for b in res.values():
        assert b.plan is None and b.reason


def test_file_order_with_unlinked_neighbours_rules_the_fixed_order_baselines_out():
    cl = Cluster("c", (grp("a", 50.0, 1), grp("b", 50.0, 1), grp("c", 200.0, 1)),
                 (GroupLink("a", "c", LinkSpec(10.0, 10.0)),
                  GroupLink("c", "b", LinkSpec(10.0, 10.0))))
    res = baseline_plans(SearchProblem.build(model(), cl, 4))
    for name in ("uniform", "param_balanced", "speed_proportional", "hapt_recipe"):  # fixed order
        assert res[name].plan is None and "no link between them" in res[name].reason
    # the planner orders the groups itself: c sits between a and b (when it uses them all)
    from hapt_hf.planner.search import PlannerOptions, plan_job
    groups = [s.group for s in plan_job(model(), cl, 4, options=PlannerOptions(all_groups=True))
              .plan.stages]
    assert groups.index("c") > min(groups.index("a"), groups.index("b"))
    assert groups.index("c") < max(groups.index("a"), groups.index("b"))
