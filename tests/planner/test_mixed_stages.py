"""Pipeline stages that mix groups (shares by speed): found where they are the best plan, not
chosen where they are not, the switch, and never slower than the search without them."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import LayerSpec, ModelSpec
from hapt_hf.planner.plan import Plan
from hapt_hf.planner.report import build_report, format_report
from hapt_hf.planner.search import (PlannerOptions, PlanningError, SearchProblem, layout_of_plan,
                                    plan_job)
from hapt_hf.planner.search.mixed import column_layouts, merge_boundaries, speed_shape
from hapt_hf.planner.search.state import stage_state
from hapt_hf.planner.simulate import simulate_plan
from tests.planner.test_cost_model import toy_model

FAST = LinkSpec(400.0, 5.0)


def heavy_model(blocks: int = 8) -> ModelSpec:
    """Blocks of 500M parameters (8 GB of state each): a handful fill a 40 GB GPU."""
    layers = [LayerSpec(0, "embedding", "emb", 1e8, 1e10, 2e10, 1e6, 1e6, 0.0)]
    for i in range(blocks):
        layers.append(LayerSpec(i + 1, "block", "blk", 5e8, 1e12, 2e12, 1e6, 10e6, 1e6))
    layers.append(LayerSpec(blocks + 1, "head", "head", 1e8, 2e11, 4e11, 0.0, 5e6, 1e6))
    return ModelSpec("heavy", "gpt2", 64, blocks, 100, 128, "fp16", True, tuple(layers))


def cluster(a: int, v: int, mem: float = 40.0, linked: bool = True) -> Cluster:
    """``a`` GPUs of 312 TFLOP/s and ``v`` of 125 TFLOP/s, each group one node."""
    groups = (GpuGroup("a100", GpuType("A", 312.0, mem), 1, a, FAST, FAST),
              GpuGroup("v100", GpuType("V", 125.0, mem), 1, v, FAST, FAST))
    return Cluster("av", groups, (GroupLink("a100", "v100", FAST),) if linked else ())


def _plan(a: int, v: int, gb: int, mixed: bool):
    opts = PlannerOptions(allow_mixed_stages=mixed, include_baselines=False)
    return plan_job(heavy_model(), cluster(a, v), gb, options=opts)


def _mixed_stages(plan: Plan):
    return [s for s in plan.stages if len(s.groups) > 1]


def test_a_stage_over_both_groups_is_the_best_plan_where_three_v100s_are_too_slow_alone(
        tmp_path):
    # 3 fast + 3 slow GPUs, 8 heavy blocks: one-group stages leave a slow GPU with a whole
    # block as the bottleneck (a 3-wide group cannot share the micro-batch evenly either);
    # stages that each take fast and slow GPUs, shares by speed, are faster
    plain = _plan(3, 3, 64, mixed=False)
    res = _plan(3, 3, 64, mixed=True)
    assert not _mixed_stages(plain.plan)
    mixed = _mixed_stages(res.plan)
    assert mixed and res.sim.iteration_s < plain.sim.iteration_s * 0.99
    for s in mixed:
        shares = {r.group: r.samples for r in s.replicas}
        assert shares["a100"] > shares["v100"]  # by speed, not equal
    res.plan.validate()
    path = res.plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back == res.plan
    again = simulate_plan(back, heavy_model(), cluster(3, 3))
    assert again.iteration_s == pytest.approx(res.sim.iteration_s, rel=1e-9)
    text = format_report(build_report(back, again))
    assert "a100+v100" in text and "samples" in text


def test_where_one_group_stages_are_best_the_plan_is_unchanged():
    # 4 + 4 GPUs divide the micro-batch and balance on their own: nothing mixed is faster
    plain = _plan(4, 4, 64, mixed=False)
    res = _plan(4, 4, 64, mixed=True)
    assert not _mixed_stages(res.plan)
    assert res.plan.to_dict() == plain.plan.to_dict()


def test_the_switch_off_keeps_every_stage_on_one_group():
    res = _plan(3, 3, 64, mixed=False)
    assert all(len(s.groups) == 1 and not s.uneven for s in res.plan.stages)


def test_columns_take_a_slice_of_every_group_with_shares_by_speed():
    cm = CostModel(heavy_model(), cluster(3, 3))
    lays = column_layouts(SearchProblem(cm, 64, PlannerOptions()))
    assert lays
    for lay in lays:
        for s in lay.stages:
            assert set(s.groups) == {"a100", "v100"}
            assert sum(s.shares()) == lay.micro_batch_size
        assert lay.bounds[0][0] == 0 and lay.bounds[-1][1] == cm.model.num_layers
    # groups without a link between them cannot share a stage's gradient ring
    assert column_layouts(SearchProblem(CostModel(heavy_model(), cluster(3, 3, linked=False)),
                                        64, PlannerOptions())) == []


def test_speed_shape_gives_the_faster_gpu_the_larger_share():
    cm = CostModel(heavy_model(), cluster(1, 1))
    a, v = cm.group("a100"), cm.group("v100")
    sh = speed_shape(cm, [(a, 0), (v, 0)], 7, 0, cm.model.num_layers)
    assert [r.samples for r in sh] == [5, 2]
    assert speed_shape(cm, [(a, 0), (v, 0)], 1, 0, cm.model.num_layers) is None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(1, 4), v=st.integers(1, 4), gb=st.sampled_from([16, 32, 48, 64]),
       mem=st.sampled_from([24.0, 40.0, 80.0]))
def test_mixed_stages_are_never_slower_than_without(a, v, gb, mem):
    m, cl = heavy_model(), cluster(a, v, mem)
    got = {}
    for mixed in (False, True):
        try:
            got[mixed] = plan_job(m, cl, gb, options=PlannerOptions(
                allow_mixed_stages=mixed, include_baselines=False)).sim.iteration_s
        except PlanningError:
            got[mixed] = None
    if got[False] is not None:
        assert got[True] is not None and got[True] <= got[False] * (1 + 1e-9)


def test_a_mixed_stage_fits_only_where_every_replica_holds_its_own_share():
    # the first replica (a roomy GPU, 1 sample) fits; the second (a small GPU, 6 samples) does
    # not: the stage does not fit
    m = heavy_model()
    probe = CostModel(m, cluster(1, 1))
    need6 = probe.memory_bytes(6, 0, 2, 1)
    small = need6 * 0.99 / 0.9 / 1e9
    groups = (GpuGroup("a100", GpuType("A", 312.0, 80.0), 1, 1, FAST, FAST),
              GpuGroup("v100", GpuType("V", 125.0, small), 1, 1, FAST, FAST))
    cm = CostModel(m, Cluster("av", groups, (GroupLink("a100", "v100", FAST),)))
    shape = cm.gpu_replicas([(cm.group("a100"), 0), (cm.group("v100"), 0)], (1, 6))
    assert stage_state(cm, shape, 7, 0, 2, 1, False, False) is None
    assert stage_state(cm, shape, 7, 0, 1, 1, False, False) == (False, "replicated", False)


def test_merging_a_group_boundary_keeps_both_stages_layers_on_both_gpus_by_speed():
    # one fast and one slow GPU, a light model: the two one-GPU stages merged into one stage
    # over both (3 samples and 1 of each micro-batch of 4) replays faster than the pipeline
    m, cl = toy_model(6), cluster(1, 1, 4.0)
    res = plan_job(m, cl, 16, options=PlannerOptions(
        allow_mixed_stages=False, allow_uneven_dp=False, include_baselines=False,
        all_groups=True))
    assert res.plan.num_stages == 2
    cm = CostModel(m, cl)
    lay, sim = merge_boundaries(SearchProblem(cm, 16, PlannerOptions()),
                                layout_of_plan(cm, res.plan), res.sim)
    assert lay.bounds == ((0, m.num_layers),)
    assert {r.group: r.samples for r in lay.stages[0].replicas} == {"a100": 3, "v100": 1}
    assert sim.iteration_s < res.sim.iteration_s * 0.95
