"""Sharded optimizer state (ZeRO-1): its memory and time, and where the search chooses it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hapt_hf.core.precision import REPLICATED, SHARDED
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.plan import Stage
from hapt_hf.planner.report import build_report, format_report
from hapt_hf.planner.search import (PlannerOptions, PlanningError, SearchProblem, baseline_plans,
                                    plan_job)
from hapt_hf.planner.search.infeasible import fit_advice
from hapt_hf.planner.simulate import simulate_plan

from .test_cost_model import toy_model, two_groups
from .test_search import make_group, synth_model


def _one_group(mem_gb: float, gpus: int, tflops: float = 100.0) -> Cluster:
    return Cluster("tiny", (make_group("a", tflops, mem_gb, gpus),), ())


# -- cost model ----------------------------------------------------------------------------

@pytest.mark.parametrize("d", [2, 4, 8])
def test_sharded_stage_keeps_8_plus_8_over_d_bytes_per_param(d):
    cm = CostModel(toy_model(), two_groups())
    params = cm.params[3] - cm.params[1]
    assert cm.static_bytes(1, 3) == params * 16
    assert cm.static_bytes(1, 3, REPLICATED, d) == params * 16
    assert cm.static_bytes(1, 3, SHARDED, d) == pytest.approx(params * (8 + 8 / d))
    # only the state differs: activations and working set are the same
    rep = cm.memory_bytes(2, 1, 3, 3, False, REPLICATED, d)
    shd = cm.memory_bytes(2, 1, 3, 3, False, SHARDED, d)
    assert rep - shd == pytest.approx(params * (8 - 8 / d))
    # the prefix sums the partition reads agree with the direct figure
    pre = cm.memory_prefix(2, 3, False, SHARDED, d)
    assert pre[3] - pre[1] + cm.working_bytes(2, 1, 3) == pytest.approx(shd)


def test_sharded_update_is_one_dth_then_an_all_gather_of_the_weights():
    cm = CostModel(toy_model(), two_groups())
    a = cm.group("a")
    nbytes = 2 * 1000 * 4  # two blocks of 1000 fp32 weights
    inside, spans = cm.slice_replicas(a, 2, 0, 2), cm.slice_replicas(a, 4, 0, 4)
    assert cm.update_s(a, 1, 1, 3, SHARDED, 4) == pytest.approx(cm.update_s(a, 1, 1, 3) / 4)
    assert cm.allgather_s(inside, 1, 3, SHARDED) == pytest.approx(
        1 / 2 * nbytes / (100e9 / 8) + 1 * 10e-6)
    # a stage across nodes gathers over the inter-node link
    assert cm.allgather_s(spans, 1, 3, SHARDED) == pytest.approx(
        3 / 4 * nbytes / (10e9 / 8) + 3 * 50e-6)
    assert cm.allgather_s(spans, 1, 3, REPLICATED) == 0.0
    assert cm.allgather_s(cm.slice_replicas(a, 1, 0, 1), 1, 3, SHARDED) == 0.0
    assert cm.optimizer_step_s(spans, 1, 1, 3, SHARDED) == pytest.approx(
        cm.update_s(a, 1, 1, 3) / 4 + cm.allgather_s(spans, 1, 3, SHARDED))


def test_simulator_runs_the_all_gather_after_the_update():
    cm = CostModel(toy_model(), two_groups())
    stage = Stage(0, (0, 6), cm.slice_replicas(cm.group("a"), 4, 0, 4))
    rep = cm.stage_costs([stage], 4).stages[0]
    shd = cm.stage_costs([replace(stage, optimizer=SHARDED)], 4).stages[0]
    assert (rep.optimizer, rep.allgather_s) == (REPLICATED, 0.0)
    assert shd.optimizer == SHARDED and shd.allgather_s > 0
    assert shd.update_s == pytest.approx(rep.update_s / 4)
    assert shd.static_bytes < rep.static_bytes
    from hapt_hf.planner.schedule import build_schedule
    from hapt_hf.planner.simulate import simulate_schedule
    from hapt_hf.planner.cost_model import StageCosts
    sched = build_schedule("1f1b", 1, 3, [1], validate=False)
    r_rep = simulate_schedule(sched, StageCosts((rep,)))
    r_shd = simulate_schedule(sched, StageCosts((shd,)))
    assert r_shd.iteration_s - r_rep.iteration_s == pytest.approx(
        shd.allgather_s + shd.update_s - rep.update_s)
    upd = next(e for e in r_shd.events if e.kind == "UPDATE")
    gather = next(e for e in r_shd.events if e.kind == "ALLGATHER")
    assert gather.start == pytest.approx(upd.end) and gather.end == pytest.approx(
        r_shd.iteration_s)
    assert not any(e.kind == "ALLGATHER" for e in r_rep.events)


# -- search --------------------------------------------------------------------------------

def test_where_only_sharded_state_fits_the_plan_shards_and_validates():
    model = synth_model(2, 1024)  # a block: 0.2 GB replicated, 0.126 GB sharded over 4
    cluster = _one_group(0.15, 12)
    res = plan_job(model, cluster, 8)
    plan = res.plan.validate(world_size=cluster.world_size)
    sharded = [s for s in plan.stages if s.optimizer == SHARDED]
    assert sharded and all(s.width >= 2 for s in sharded)
    # the saved plan says so, and replays to the same figures and fits
    again = simulate_plan(type(plan).from_dict(plan.to_dict()), model, cluster)
    assert again.feasible and again.iteration_s == pytest.approx(res.sim.iteration_s)
    # the report says which stages shard and why
    assert set(res.sharding) == {s.index for s in sharded}
    text = format_report(build_report(plan, res.sim, sharding=res.sharding))
    assert "sharded state" in text and "instead of" in text
    # with the switch off nothing is sharded: here nothing fits, and the message names it
    with pytest.raises(PlanningError, match="allow_sharded_optimizer=True"):
        plan_job(model, cluster, 8, options=PlannerOptions(allow_sharded_optimizer=False))


# the search's own choice: the baselines (replicated splits, ZeRO-1 DDP) are left out
OWN = PlannerOptions(include_baselines=False)


def test_where_replicated_fits_and_steps_faster_the_plan_stays_replicated():
    model, cluster = synth_model(4, 1024), _one_group(16.0, 8)
    res = plan_job(model, cluster, 16, options=OWN)
    plan = res.plan
    assert any(s.width >= 2 for s in plan.stages)
    assert all(s.optimizer == REPLICATED for s in plan.stages) and not res.sharding
    # sharding the same stages would only add the all-gather: the replay is slower
    wide = tuple(replace(s, optimizer=SHARDED) if s.width >= 2 else s for s in plan.stages)
    shd = simulate_plan(replace(plan, stages=wide).validate(), model, cluster)
    assert shd.iteration_s > res.sim.iteration_s


def test_sharding_where_its_step_is_faster_and_never_with_the_switch_off():
    # GPUs this slow have little memory bandwidth: the whole Adam step costs more than a
    # 1/d step plus the all-gather over their link, so sharding wins though both fit
    model, cluster = synth_model(4, 1024), _one_group(16.0, 8, tflops=0.5)
    on = plan_job(model, cluster, 16, options=OWN)
    assert any(s.optimizer == SHARDED for s in on.plan.stages)
    assert all("faster optimizer step" in why for why in on.sharding.values())
    off = plan_job(model, cluster, 16, options=replace(OWN, allow_sharded_optimizer=False))
    assert all(s.optimizer == REPLICATED for s in off.plan.stages) and not off.sharding
    assert on.sim.iteration_s < off.sim.iteration_s
    # with the baselines too (ZeRO-1 DDP among them), the switch still holds
    off = plan_job(model, cluster, 16, options=PlannerOptions(allow_sharded_optimizer=False))
    assert all(s.optimizer == REPLICATED for s in off.plan.stages)


def test_sharding_lets_fewer_stages_hold_the_model():
    model, cluster = synth_model(4, 1024), _one_group(0.3, 8)
    two = PlannerOptions(max_stages=2)
    plan = plan_job(model, cluster, 8, options=two).plan.validate()
    assert plan.num_stages <= 2 and all(s.optimizer == SHARDED for s in plan.stages)
    with pytest.raises(PlanningError, match="allow_sharded_optimizer=True"):
        plan_job(model, cluster, 8, options=replace(two, allow_sharded_optimizer=False))


# -- baseline ------------------------------------------------------------------------------

def test_zero1_ddp_baseline_is_one_sharded_stage_over_every_gpu():
    model, cluster = synth_model(2, 256), _one_group(16.0, 4)
    b = baseline_plans(SearchProblem.build(model, cluster, 8))["zero1_ddp"]
    plan = b.plan.validate(world_size=4)
    assert plan.num_stages == 1 and plan.stages[0].width == 4
    assert plan.stages[0].optimizer == SHARDED and plan.stages[0].layers == (0, model.num_layers)
    assert simulate_plan(plan, model, cluster).iteration_s == pytest.approx(b.sim.iteration_s)
    # where the whole model does not fit one GPU even sharded, the reason gives the figures
    small = baseline_plans(SearchProblem.build(synth_model(4, 1024), _one_group(0.3, 8), 8))["zero1_ddp"]
    assert small.plan is None and "GB per" in small.reason and "usable" in small.reason
    # over several groups: one stage of every GPU of every group, equal shares, sharded
    multi = baseline_plans(SearchProblem.build(toy_model(), two_groups(), 12))["zero1_ddp"]
    stage = multi.plan.validate().stages[0]
    assert multi.plan.num_stages == 1 and stage.optimizer == SHARDED
    assert len(set(stage.shares(multi.plan.micro_batch_size))) == 1 and len(stage.groups) == 2


# -- fit advice ----------------------------------------------------------------------------

def test_fit_advice_recommends_sharding_only_where_it_is_off_and_would_fit():
    model, cluster = synth_model(4, 1024), _one_group(0.3, 8)
    cm = CostModel(model, cluster)
    two = PlannerOptions(max_stages=2)
    off = replace(two, allow_sharded_optimizer=False)
    assert any("allow_sharded_optimizer=True" in a for a in fit_advice(SearchProblem(cm, 8, off)))
    # allowed already: the sharded layout holds the model, so there is nothing to advise
    assert fit_advice(SearchProblem(cm, 8, two)) == []
    # where sharding cannot help, it is not advised
    tiny = CostModel(model, _one_group(0.01, 8))
    assert not any("allow_sharded_optimizer" in a for a in fit_advice(SearchProblem(tiny, 8, off)))


def test_report_merges_runs_of_sharded_stages_with_one_reason():
    """A deep plan prints one line per run of alike sharded stages, not one per stage."""
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.report import build_report
    stages = tuple(Stage.even(i, (i, i + 1), "g", "V100-32", (2 * i, 2 * i + 1), 4 - i,
                              micro_batch_size=2, optimizer=SHARDED) for i in range(4))
    plan = Plan("m", 4, 64, 8, 2, 4, "1f1b", stages).validate()
    why = {0: "fits 2 layers per V100-32 from emb instead of 1",
           1: "fits 3 layers per V100-32 from b1 instead of 2",
           2: "fits 3 layers per V100-32 from b4 instead of 2",
           3: "faster optimizer step"}
    assert build_report(plan, None, sharding=why).sharding == (
        "stage 0 over 2 replicas: fits 2 layers per V100-32 from emb instead of 1",
        "stages 1-2 over 2 replicas each: fits 3 layers per V100-32 instead of 2",
        "stage 3 over 2 replicas: faster optimizer step")
