"""Stages whose replicas differ (unlike GPUs, uneven shares), shares by speed, the one-stage
data-parallel candidate, the equal-share DDP baseline and the report's line about them."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapt_hf.core.shares import overlaps, speed_shares
from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel, CostModelError
from hapt_hf.planner.job import load_job
from hapt_hf.planner.plan import Plan, Replica, Stage
from hapt_hf.planner.report import build_report, format_report
from hapt_hf.planner.search import PlannerOptions, SearchProblem, plan_job
from hapt_hf.planner.search.baselines import equal_share_ddp
from hapt_hf.planner.simulate import simulate_plan
from tests.planner.test_cost_model import toy_model

SCENARIO = Path(__file__).resolve().parents[2] / "benchmarks/scenarios/dp_a100x3_v100x5_355m.yaml"
INTRA, INTER, GROUP_LINK = LinkSpec(100.0, 10.0), LinkSpec(20.0, 30.0), LinkSpec(8.0, 500.0)


def gpu_group(name, tflops, mem, gpus=2, gpn=2) -> GpuGroup:
    return GpuGroup(name, GpuType(name.upper(), tflops, mem), gpus // gpn, gpn, INTRA, INTER)


def a100_v100(v_mem: float = 32.0, linked: bool = True) -> Cluster:
    return Cluster("av", (gpu_group("a100", 312.0, 40.0), gpu_group("v100", 125.0, v_mem)),
                   (GroupLink("a100", "v100", GROUP_LINK),) if linked else ())


def mixed(cm: CostModel, shares=((("a100", 0), 5), (("v100", 0), 2))) -> tuple[Replica, ...]:
    return cm.gpu_replicas([(cm.group(g), i) for (g, i), _ in shares], [s for _, s in shares])


# -- cost model ------------------------------------------------------------------------------

def test_a_mixed_stage_takes_the_slowest_replicas_time_for_its_own_share():
    cm = CostModel(toy_model(), a100_v100())
    L = cm.model.num_layers
    c = cm.stage_costs([Stage(0, (0, L), mixed(cm))], 7).stages[0]
    fa, ba = cm.compute_s(cm.group("a100"), 5, 0, L)
    fv, bv = cm.compute_s(cm.group("v100"), 2, 0, L)
    assert fa != fv and (c.forward_s, c.backward_s) == (max(fa, fv), max(ba, bv))
    # 5 samples on a 312 TFLOP/s GPU against 2 on a 125: the A100 is the slower by a little
    assert c.forward_s == fa


def test_each_replica_holds_its_own_share_against_its_own_gpu():
    m = toy_model()
    L = m.num_layers
    probe = CostModel(m, a100_v100())
    need = {s: probe.memory_bytes(s, 0, L, 1) for s in (2, 5)}
    v_mem = (need[2] + need[5]) / 2 / 0.9 / 1e9  # room for 2 samples, not for 5
    cm = CostModel(m, a100_v100(v_mem=v_mem))
    cap_v = cm.capacity_bytes(cm.group("v100"))
    # the A100 holds 5 samples in 36 GB; the V100 with 2 is the GPU with the least to spare
    ok = cm.stage_costs([Stage(0, (0, L), mixed(cm))], 7).stages[0]
    assert ok.memory_use(1) == pytest.approx((need[2], cap_v)) and need[2] < cap_v
    swapped = mixed(cm, ((("a100", 0), 2), (("v100", 0), 5)))
    bad = cm.stage_costs([Stage(0, (0, L), swapped)], 7).stages[0]
    assert bad.memory_use(1) == pytest.approx((need[5], cap_v)) and need[5] > cap_v


def test_the_all_reduce_of_a_stage_across_groups_runs_at_the_group_link():
    cm = CostModel(toy_model(), a100_v100())
    L = cm.model.num_layers
    sh = mixed(cm, ((("a100", 0), 3), (("a100", 1), 3), (("v100", 0), 1)))
    c = cm.stage_costs([Stage(0, (0, L), sh)], 7).stages[0]
    nbytes = cm.params[L] * cm.grad_dtype_bytes  # the toy model's gradients: one bucket
    d = 3
    expect = (2 * (d - 1) / d * nbytes / (GROUP_LINK.bandwidth_gbps * 1e9 / 8)
              + 2 * (d - 1) * GROUP_LINK.latency_us * 1e-6)
    assert c.allreduce_s == pytest.approx(expect)
    # inside one group the same stage runs at the intra-node link, as an even stage does
    one = mixed(cm, ((("a100", 0), 4), (("a100", 1), 3)))
    even = cm.allreduce_window(cm.slice_replicas(cm.group("a100"), 2, 0, 8), 0, L).link_s
    assert cm.stage_costs([Stage(0, (0, L), one)], 7).stages[0].allreduce_s == \
        pytest.approx(even)


def test_a_stage_across_unlinked_groups_cannot_all_reduce():
    cm = CostModel(toy_model(), a100_v100(linked=False))
    with pytest.raises(CostModelError, match="add links"):
        cm.stage_costs([Stage(0, (0, cm.model.num_layers), mixed(cm))], 7)


def test_a_cut_prices_the_pieces_each_pair_of_gpus_trades():
    cm = CostModel(toy_model(), a100_v100())
    left = cm.slice_replicas(cm.group("a100"), 1, 0, 7)  # one A100 with the whole micro-batch
    right = mixed(cm, ((("a100", 1), 5), (("v100", 0), 2)))
    last = 2
    per = cm.model.boundary_bytes(last, 1)
    # 5 samples A100 -> A100 on the intra-node link, 2 samples over the group link
    expect = max(INTRA.transfer_s(5 * per), GROUP_LINK.transfer_s(2 * per))
    assert cm.cut_s(left, right, last, 7) == pytest.approx(expect)
    # the latency the link is not held for: the least of the two links' latencies
    assert cm.cut_latency_s(left, right, 7) == pytest.approx(
        min(INTRA.latency_us, GROUP_LINK.latency_us) * 1e-6)
    assert overlaps([7], [5, 2]) == ((0, 0, 5), (0, 1, 2))


def test_a_plan_with_replicas_is_priced_from_its_replicas():
    cl = Cluster("av1", (gpu_group("a100", 312.0, 40.0, 1, 1),
                         gpu_group("v100", 125.0, 32.0, 1, 1)),
                 (GroupLink("a100", "v100", GROUP_LINK),))
    m = toy_model()
    cm = CostModel(m, cl)
    L = m.num_layers
    reps = (Replica("a100", "A100", 5, (0,)), Replica("v100", "V100", 2, (1,)))
    plan = Plan("toy", L, 64, 14, 7, 2, "1f1b", (Stage(0, (0, L), reps, 1),)).validate(2)
    got = cm.placement(cm.stages_of(plan)[0].replicas)
    assert [(g.name, i, r.samples) for g, i, r in zip(got.group_of, got.index, got.replicas)] == \
        [("a100", 0, 5), ("v100", 0, 2)]
    sim = simulate_plan(plan, m, cl)
    c = cm.plan_costs(plan).stages[0]
    assert sim.feasible and sim.iteration_s == pytest.approx(
        2 * (c.forward_s + c.backward_s) + c.allreduce_after_s + c.update_s)
    wrong = Plan("toy", L, 64, 14, 7, 2, "1f1b", (Stage(
        0, (0, L), (Replica("v100", "V100", 5, (0,)), Replica("a100", "A100", 2, (1,))), 1),))
    with pytest.raises(CostModelError, match="rank of its own group"):
        cm.stages_of(wrong)


# -- shares by speed ------------------------------------------------------------------------

def test_shares_follow_speed_5_to_2():
    cm = CostModel(toy_model(), a100_v100())
    L = cm.model.num_layers
    t = [lambda s, g=cm.group(n): sum(cm.compute_s(g, s, 0, L)) for n in ("a100", "v100")]
    assert speed_shares(7, t) == (5, 2)
    assert speed_shares(14, t + t) == (5, 2, 5, 2)


@settings(max_examples=200, deadline=None)
@given(speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6),
       extra=st.integers(0, 40), fixed=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6))
def test_shares_sum_to_the_micro_batch_and_no_single_move_helps(speeds, extra, fixed):
    n = len(speeds)
    mbs = n + extra
    t = [lambda s, v=v, c=c: c + s / v for v, c in zip(speeds, fixed)]
    shares = speed_shares(mbs, t)
    assert sum(shares) == mbs and min(shares) >= 1
    worst = max(f(s) for f, s in zip(t, shares))
    for i in range(n):
        for j in range(n):
            if i == j or shares[i] < 2:
                continue
            moved = list(shares)
            moved[i] -= 1
            moved[j] += 1
            assert max(f(s) for f, s in zip(t, moved)) >= worst - 1e-12


def test_shares_need_a_sample_per_replica():
    with pytest.raises(Exception, match="at least 3"):
        speed_shares(2, [lambda s: s] * 3)


# -- search, baseline, report ---------------------------------------------------------------

@pytest.fixture(scope="module")
def scenario():
    job = load_job(SCENARIO)
    args = (job.model, job.cluster, job.global_batch_size, job.profile)
    return plan_job(*args), plan_job(*args, PlannerOptions(allow_uneven_dp=False))


def test_uneven_data_parallelism_wins_where_the_model_fits_and_links_are_fast(scenario):
    res, pipe = scenario
    (stage,) = res.plan.stages
    assert stage.width == 8 and stage.shares(res.plan.micro_batch_size) == (13,) * 3 + (5,) * 5
    assert stage.groups == ("a100", "v100")
    res.plan.validate(8)
    assert pipe.plan.num_stages > 1 and res.sim.iteration_s < pipe.sim.iteration_s
    ddp = res.baselines["ddp"]
    assert set(ddp.plan.stages[0].shares(ddp.plan.micro_batch_size)) == \
        {ddp.plan.micro_batch_size // 8}
    assert res.sim.iteration_s * 1.4 < ddp.sim.iteration_s
    # the simulator prices the saved plan as the search did
    job = load_job(SCENARIO)
    again = simulate_plan(res.plan, job.model, job.cluster, job.profile)
    assert again.iteration_s == pytest.approx(res.sim.iteration_s)


def test_where_the_model_does_not_fit_a_gpu_a_pipeline_is_chosen():
    m = toy_model(blocks=8)
    cm = CostModel(m, a100_v100())
    # a V100 cannot hold the whole model with one sample even recomputing; half of it, it can
    whole = cm.memory_bytes(1, 0, m.num_layers, 1, recompute=True)
    cl = a100_v100(v_mem=whole * 0.8 / 0.9 / 1e9)
    res = plan_job(m, cl, 28, options=PlannerOptions(all_groups=True))
    assert res.plan.num_stages > 1 and {s.group for s in res.plan.stages} == {"a100", "v100"}
    ddp = res.baselines["ddp"]
    assert ddp.plan is None and "fits every GPU" in ddp.reason and "GB" in ddp.reason


def test_the_ddp_baseline_is_one_stage_of_equal_shares_where_it_fits():
    cm = CostModel(toy_model(), a100_v100())
    b = equal_share_ddp(SearchProblem(cm, 28, PlannerOptions()))
    (stage,) = b.plan.stages
    assert stage.width == 4 and len(set(stage.shares(b.plan.micro_batch_size))) == 1
    assert b.sim.feasible
    none = equal_share_ddp(SearchProblem(cm, 30, PlannerOptions()))  # 30 samples, 4 GPUs: no equal share
    assert none.plan is None and "same number" in none.reason


@settings(max_examples=6, deadline=None)
@given(fast=st.integers(1, 3), slow=st.integers(1, 3), ratio=st.floats(1.0, 4.0),
       bw=st.sampled_from([1.0, 10.0, 100.0]))
def test_the_plan_is_never_slower_than_equal_share_ddp(fast, slow, ratio, bw):
    cl = Cluster("p", (gpu_group("f", 100.0 * ratio, 40.0, fast, fast),
                       gpu_group("s", 100.0, 40.0, slow, slow)),
                 (GroupLink("f", "s", LinkSpec(bw, 100.0)),))
    m = toy_model(blocks=4)
    gbs = 12 * (fast + slow)
    res = plan_job(m, cl, gbs, options=PlannerOptions(all_groups=True))
    ddp = res.baselines["ddp"]
    assert ddp.sim is not None and ddp.sim.feasible
    assert res.sim.iteration_s <= ddp.sim.iteration_s * (1 + 1e-9)


def test_the_report_says_why_the_plan_is_data_parallel_and_the_shares(scenario):
    res, pipe = scenario
    text = format_report(build_report(res.plan, res.sim, baselines=res.baselines))
    line = next(l for l in text.splitlines() if l.startswith("data parallel"))
    assert "whole model fits every GPU" in line and "by speed" in line
    assert "a100 (A100-40) 13 x 3 GPUs" in line and "v100 (V100-32) 5 x 5 GPUs" in line
    assert "all-reduce" in line
    assert "a100+v100  A100-40+V100-32" in text  # the stage's row names both groups
    assert "data parallel" not in format_report(build_report(pipe.plan, pipe.sim))
