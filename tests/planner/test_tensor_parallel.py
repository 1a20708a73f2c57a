"""Tensor parallelism in the planner: the price of a replica of t GPUs, the choice of t, the
advice where nothing fits without it."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapt_hf.core.precision import REPLICATED, SHARDED
from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, LinkSpec
from hapt_hf.planner.cost_model import (TP_ACT_KEPT, CostModel, CostModelError, tp_efficiency,
                                        tp_unfit)
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Plan, Replica, Stage
from hapt_hf.planner.profile import LayerTiming, Profile, ProfileKey
from hapt_hf.planner.search import (PlannerOptions, PlanningError, SearchProblem, plan_job,
                                    physical_limit_s)
from hapt_hf.planner.search.tensor_parallel import tp_limit_s


def llama(hidden=1024, inter=4096, blocks=2, heads=8, kv=4, seq=1024) -> ModelSpec:
    return ModelSpec.from_job_dict({"family": "llama", "hidden_size": hidden,
                                    "intermediate_size": inter, "num_layers": blocks,
                                    "num_heads": heads, "num_kv_heads": kv,
                                    "vocab_size": 1000}, seq, "fp16")


def one_group(mem_gb=16.0, gpus=8, gpn=8, intra=(200.0, 10.0)) -> Cluster:
    return Cluster("tp", (GpuGroup("a", GpuType(f"G-{mem_gb:g}", 100.0, mem_gb),
                                   gpus // gpn, gpn, LinkSpec(*intra), LinkSpec(50, 20)),), ())


def stage(replicas, layers, optimizer=REPLICATED, recompute=False) -> Stage:
    return Stage(0, layers, tuple(replicas), 1, recompute, optimizer)


def tp_replicas(t: int, width: int, samples: int = 1) -> list[Replica]:
    return [Replica("a", "G-16", samples, tuple(range(i * t, (i + 1) * t)))
            for i in range(width)]


# -- pricing ---------------------------------------------------------------------------------

def test_degree_one_is_the_price_without_tensor_parallelism():
    m, cl = llama(), one_group()
    old, one = CostModel(m, cl), CostModel(m, cl, tp={"a": 1})
    assert one.cluster is cl and one.tp == {"a": 1}
    st_ = [stage(tp_replicas(1, 4, 2), (0, m.num_layers), SHARDED)]
    assert one.stage_costs(st_, 8) == old.stage_costs(st_, 8)
    assert one.shard(1) == old.shard(1) and old.params == one.shard(1).params


def test_a_block_splits_its_compute_and_pays_four_all_reduces():
    m, cl = llama(), one_group()
    cm = CostModel(m, cl)
    g = cl.groups[0]
    f1, b1 = cm.compute_s(g, 2, 1, 2)
    f2, b2 = cm.compute_s(g, 2, 1, 2, tp=2)
    eff = tp_efficiency(2, m.hidden_size)
    # ring all-reduce of 2 samples x seq x hidden x 2 bytes, twice a pass, on the intra link
    nbytes = 2 * 1024 * 1024 * 2
    ar = 2 * (2 * (2 - 1) / 2 * nbytes * 8 / 200e9 + 2 * 10e-6)
    assert f2 == pytest.approx(f1 / (2 * eff) + ar) and b2 == pytest.approx(b1 / (2 * eff) + ar)
    # the embedding stays whole: the same time on every rank (the head: test_tp_pricing)
    assert cm.compute_s(g, 2, 0, 1, tp=2) == cm.compute_s(g, 2, 0, 1)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(512, 2048, 8, 8), (1024, 4096, 16, 8), (2048, 5632, 16, 16)]),
       st.integers(1, 4), st.integers(0, 3), st.integers(1, 8), st.booleans(),
       st.sampled_from([REPLICATED, SHARDED]))
def test_memory_falls_and_communication_grows_with_the_degree(shape, blocks, first, samples, rc,
                                                              optimizer):
    hidden, inter, heads, kv = shape
    m = llama(hidden, inter, blocks, heads, kv, seq=512)
    cm = CostModel(m, one_group())
    g = cm.hardware.groups[0]
    a = min(first, m.num_layers - 1)
    b = m.num_layers if a == 0 else min(a + 2, m.num_layers)
    # the blocks' projections and the head's vocabulary rows split (an untied llama head)
    has_block = any(l.kind in ("block", "head") for l in m.layers[a:b])
    mem = [cm.memory_bytes(samples, a, b, 2, rc, optimizer, 2, t) for t in (1, 2, 4, 8)]
    ar = [cm.tp_allreduce_s(g, samples, t, 1) for t in (1, 2, 4, 8)]
    if has_block:
        assert all(x > y for x, y in zip(mem, mem[1:]))
    else:  # equal but for the rounding of prefix sums over layers before the range
        assert mem == pytest.approx([mem[0]] * 4, rel=1e-12)
    assert ar[0] == 0 and all(x < y for x, y in zip(ar, ar[1:]))
    # a block's compute never beats a t-th of one GPU's
    one = sum(cm.compute_s(g, samples, 1, 2))
    assert all(sum(cm.compute_s(g, samples, 1, 2, tp=t)) >= one / t for t in (2, 4, 8))


def test_activations_follow_korthikanti_and_state_splits_only_the_projections():
    m = llama()
    cm = CostModel(m, one_group())
    whole, split, parts = TP_ACT_KEPT
    assert whole + split == parts == 34
    blk = m.layers[1]
    assert cm.activation_bytes(1, 1, 2, tp=4) == pytest.approx(
        blk.act_keep_bytes * (10 + 24 / 4) / 34)
    assert cm.weight_copy_bytes(1, 2, tp=4) == pytest.approx(blk.act_keep_fixed_bytes / 4)
    # a recomputed block keeps its whole input on every rank
    assert cm.activation_bytes(3, 1, 2, True, tp=4) == cm.activation_bytes(3, 1, 2, True)
    norms = 2 * m.hidden_size
    assert m.tp_whole_params(blk) == norms
    assert cm.static_bytes(1, 2, tp=4) == pytest.approx((norms + (blk.params - norms) / 4) * 16)
    assert cm.static_bytes(0, 1, tp=4) == cm.static_bytes(0, 1)  # the embedding stays whole


def test_a_measured_timing_at_the_degree_replaces_the_split():
    m, cl = llama(), one_group()
    sig = m.layers[1].signature
    prof = Profile({ProfileKey("G-16", sig, 1, m.seq_len, m.dtype): LayerTiming(0.010, 0.020),
                    ProfileKey("G-16", sig, 1, m.seq_len, m.dtype, 2):
                        LayerTiming(0.006, 0.011, tp_comm_included=True)})
    cm = CostModel(m, cl, prof)
    g = cl.groups[0]
    assert cm.compute_s(g, 1, 1, 2, tp=2) == pytest.approx((0.006, 0.011))
    ar = cm.tp_allreduce_s(g, 1, 4, 1)  # no timing at 4: the profile's degree-1 time, split
    eff = tp_efficiency(4, m.hidden_size)
    assert cm.compute_s(g, 1, 1, 2, tp=4) == pytest.approx((0.010 / (4 * eff) + ar,
                                                            0.020 / (4 * eff) + ar))


def test_replicas_of_t_ranks_are_checked_where_the_model_and_the_nodes_allow_them():
    m = llama()
    cm = CostModel(m, one_group(gpus=8, gpn=4))
    assert cm.stage_costs([stage(tp_replicas(2, 2), (0, m.num_layers))], 2).stages
    with pytest.raises(CostModelError, match="one node"):  # ranks 2..5 straddle two nodes
        cm.placement((Replica("a", "G-16", 1, (2, 3, 4, 5)),))
    with pytest.raises(CostModelError, match="same number"):
        cm.placement((Replica("a", "G-16", 1, (0, 1)), Replica("a", "G-16", 1, (2, 3, 4))))
    assert "does not divide" in tp_unfit(llama(heads=8, kv=2), 4)
    assert tp_unfit(llama(heads=8, kv=2), 3) and tp_unfit(llama(), 2) is None
    with pytest.raises(CostModelError, match="key/value heads"):
        CostModel(llama(heads=8, kv=2), one_group(), tp={"a": 4})
    with pytest.raises(CostModelError, match="GPUs per node"):
        CostModel(m, one_group(gpus=6, gpn=6), tp={"a": 4})


def test_the_search_view_shows_a_replica_as_one_gpu_and_builds_consecutive_ranks():
    cm = CostModel(llama(), one_group(gpus=16, gpn=8), tp={"a": 4})
    g = cm.cluster.groups[0]
    assert (g.size, g.gpus_per_node, cm.hardware.groups[0].size) == (4, 2, 16)
    reps = cm.slice_replicas(g, 2, 1, 4)
    assert [r.ranks for r in reps] == [(4, 5, 6, 7), (8, 9, 10, 11)]
    assert [r.ranks for r in cm.gpu_replicas([(g, 3)], [1])] == [(12, 13, 14, 15)]


def test_plan_costs_reads_the_degree_off_the_replicas():
    m = llama()
    cm = CostModel(m, one_group())  # no degrees given: the plan's ranks say them
    plan = Plan(m.name, m.num_layers, m.seq_len, 8, 2, 4, "1f1b",
                (stage(tp_replicas(4, 2), (0, m.num_layers)),), m.dtype,
                loss_scaling="dynamic")
    got = cm.plan_costs(plan.validate()).stages[0]
    want = CostModel(m, one_group(), tp={"a": 4}).stage_costs(
        [stage(tp_replicas(4, 2), (0, m.num_layers))], 2).stages[0]
    assert got == want and plan.world_size == 8


def test_the_physical_limit_counts_every_gpu_alone_whatever_the_degrees():
    m, cl = llama(), one_group()
    p = SearchProblem(CostModel(m, cl), 8)
    q = p.with_tp({"a": 4})
    assert physical_limit_s(q) == physical_limit_s(p)
    assert tp_limit_s(q) > tp_limit_s(p) == pytest.approx(physical_limit_s(p))


# -- the search and the advice ---------------------------------------------------------------

def test_the_search_takes_a_degree_where_only_that_fits_and_max_tp_1_names_it():
    m, cl = llama(), one_group(mem_gb=0.25, gpus=4, gpn=4)
    with pytest.raises(PlanningError) as e:
        plan_job(m, cl, 8, options=PlannerOptions(max_tp=1))
    assert "max_tp=2 (tensor parallelism: replicas of 2 GPUs of one node" in str(e.value)
    res = plan_job(m, cl, 8)
    plan = res.plan
    assert res.sim.feasible and {s.tp for s in plan.stages} == {2}
    assert sorted(r for s in plan.stages for r in s.ranks) == [0, 1, 2, 3]
    for s in plan.stages:
        for r in s.replicas:
            assert list(r.ranks) == list(range(r.ranks[0], r.ranks[0] + 2))
    assert Plan.from_dict(plan.to_dict()) == plan  # 'tp' written and read back


def test_where_one_gpu_per_replica_fits_the_plan_is_the_one_without():
    m, cl = llama(blocks=4), one_group(mem_gb=16.0, gpus=4, gpn=4)
    with_tp = plan_job(m, cl, 16)
    without = plan_job(m, cl, 16, options=PlannerOptions(max_tp=1))
    assert with_tp.plan == without.plan or \
        with_tp.sim.iteration_s < without.sim.iteration_s


def test_max_tp_must_be_a_searched_degree():
    with pytest.raises(PlanningError, match="max_tp 3"):
        PlannerOptions(max_tp=3)


def test_a_measured_tensor_parallel_all_reduce_replaces_the_intra_node_link():
    from hapt_hf.planner.profile import LinkMeasurement

    m, cl = llama(), one_group()
    g = cl.groups[0]
    prof = Profile({}, [LinkMeasurement("a", "a", 20.0, 40.0, tp=2)])
    nbytes = 2 * 1024 * 1024 * 2  # two samples' block output at fp16
    want = 2 * (2 * (2 - 1) / 2 * nbytes * 8 / 20e9 + 2 * 40e-6)
    assert CostModel(m, cl, prof).tp_allreduce_s(g, 2, 2, 1) == pytest.approx(want)
    # no measurement at 4: the intra-node link of the cluster file
    assert CostModel(m, cl, prof).tp_allreduce_s(g, 2, 4, 1) == \
        CostModel(m, cl).tp_allreduce_s(g, 2, 4, 1)


def test_the_layout_bound_prices_a_replica_at_its_degree_and_no_replay_beats_it():
    from benchmarks.bound import lower_bound_s
    from hapt_hf.planner.search import Layout, simulate_layout

    m = llama(blocks=4)
    cm = CostModel(m, one_group(gpus=4, gpn=4), tp={"a": 2})
    g = cm.cluster.groups[0]
    shapes = (cm.slice_replicas(g, 1, 0, 2), cm.slice_replicas(g, 1, 1, 2))
    lay = Layout.build(shapes, ((0, 3), (3, m.num_layers)), (False, False), 2, (2, 1), "1f1b")
    bound = lower_bound_s(cm, lay.stages, 2, 4)
    assert simulate_layout(cm, lay, 4, exact=True).iteration_s >= bound * (1 - 1e-9)
    # priced at degree 2: less compute than the same ranks priced one GPU a replica
    one = CostModel(m, one_group(gpus=4, gpn=4))
    one_lay = Layout.build((one.slice_replicas(g, 1, 0, 2), one.slice_replicas(g, 1, 2, 2)),
                           lay.bounds, (False, False), 2, (2, 1), "1f1b")
    assert bound < lower_bound_s(one, one_lay.stages, 2, 4)


def test_a_model_without_a_tensor_parallel_plan_keeps_one_gpu_a_replica():
    gpt2 = ModelSpec.from_config("gpt2-tiny", 128)
    assert "no tensor-parallel plan" in gpt2.tp_plan_refusal
    assert tp_unfit(gpt2, 2) == gpt2.tp_plan_refusal
    with pytest.raises(CostModelError, match="no tensor-parallel plan"):
        CostModel(gpt2, one_group(), tp={"a": 2})
    assert llama().tp_plan_refusal == ""


def _two_groups() -> Cluster:
    from hapt_hf.planner.cluster import GroupLink

    g = [GpuGroup(n, GpuType(f"G-{n}", 100.0, 16.0), 1, 8, LinkSpec(200, 10), LinkSpec(50, 20))
         for n in ("a", "b")]
    return Cluster("two", tuple(g), (GroupLink("a", "b", LinkSpec(100, 10)),))


def test_the_screen_weighs_uniform_degrees_then_moves_one_group_from_the_winner():
    from hapt_hf.planner.search.tensor_parallel import choose_degrees

    problem = SearchProblem(CostModel(llama(hidden=4096, inter=11008, heads=32, kv=8),
                                      _two_groups()), 64, PlannerOptions(tp_screens=10))
    times = {(2, 2): 9.0, (4, 4): 8.0, (8, 8): 8.5, (2, 4): 8.2, (8, 4): 7.5, (4, 2): 9.9,
             (4, 8): 7.9, (8, 2): 9.9}
    asked = []

    def weigh(p):
        key = (p.tp["a"], p.tp["b"])
        asked.append(key)
        return times[key], key

    tp, kept, choices = choose_degrees(problem, weigh, base_s=10.0)
    assert asked[:3] == [(2, 2), (4, 4), (8, 8)]  # every group at one degree first
    assert tp == {"a": 8, "b": 4} and kept == (8, 4)  # then one group moved at a time
    assert len(asked) == len(set(asked)) == len(choices)
    # no degree above 1 beats the plan without: no descent, nothing kept
    asked.clear()
    assert choose_degrees(problem, weigh, base_s=7.0)[0] is None and len(asked) == 3
    # an assignment whose own limit is no faster than the plan without is not searched
    asked.clear()
    assert choose_degrees(problem, weigh, base_s=tp_limit_s(problem))[0] is None
    assert asked == []
    # at most tp_screens assignments are searched
    asked.clear()
    choose_degrees(problem.with_options(tp_screens=2), weigh, base_s=10.0)
    assert len(asked) == 2


def test_the_report_names_each_run_of_tensor_parallel_stages():
    from hapt_hf.planner.report import build_report, format_report

    m, cl = llama(), one_group(mem_gb=0.25, gpus=4, gpn=4)
    res = plan_job(m, cl, 8)
    text = format_report(build_report(res.plan, res.sim))
    first = res.plan.stages[0].index
    last = res.plan.stages[-1].index
    span = f"stage {first}" if first == last else f"stages {first}-{last}"
    assert (f"tensor parallel  {span} (a): replicas of 2 GPUs of one node, each GPU holding "
            "1/2 of every block's projections") in text
    one = plan_job(m, one_group(mem_gb=16.0, gpus=4, gpn=4), 8,
                   options=PlannerOptions(max_tp=1))
    assert "tensor parallel" not in format_report(build_report(one.plan, one.sim))
