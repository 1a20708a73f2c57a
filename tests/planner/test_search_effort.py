"""benchmarks/search_effort.py's local search: from a plan with a boundary moved off, the moves
under zero_bubble find their way back to a plan no slower than the planner's own; plans cut
between half blocks are replayed on the model's halves."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.inputs import scenario_path
from benchmarks.search_effort import local_search
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.job import load_job
from hapt_hf.planner.search import PlannerOptions, plan_job
from hapt_hf.planner.search.kinds import replay_kind


def _plan(name: str):
    job = load_job(scenario_path(name))
    return job, plan_job(job.model, job.cluster, job.global_batch_size, job.profile,
                         PlannerOptions(include_baselines=False))


def _moved(plan, by: int):
    """``plan`` with its first boundary ``by`` layers earlier."""
    st = list(plan.stages)
    (a0, b0), (_, b1) = st[0].layers, st[1].layers
    st[0], st[1] = replace(st[0], layers=(a0, b0 - by)), replace(st[1], layers=(b0 - by, b1))
    return replace(plan, stages=tuple(st))


@pytest.mark.parametrize("name", ["harp_v100x2_a100x1", "consumer_rtx4080x4_rtx4090x4"])
def test_local_search_recovers_from_a_moved_boundary(name):
    job, res = _plan(name)
    first, best, lay, runs = local_search(job, _moved(res.plan, 2), budget=60)
    assert first > res.sim.iteration_s * 1.01  # the moved boundary costs time
    assert best <= res.sim.iteration_s * (1 + 1e-9) and 0 < runs <= 60
    # what it reports is the full replay of the layout it returns, which covers every layer
    model = job.model.with_layer_unit(res.plan.layer_unit)
    assert replay_kind(CostModel(model, job.cluster, job.profile), lay,
                       res.plan.num_microbatches).iteration_s == pytest.approx(best)
    edges = [a for a, _ in lay.bounds] + [lay.bounds[-1][1]]
    assert edges[0] == 0 and edges[-1] == model.num_layers and edges == sorted(set(edges))
    assert lay.schedule == "zero_bubble"


def test_interleaved_splits_replay_each_cut_and_the_even_one_as_the_planner_weighs_it():
    from benchmarks.search_effort import interleaved_splits
    from hapt_hf.planner.search.kinds import interleaved_layout
    from hapt_hf.planner.search.plans import layout_of_plan

    job, res = _plan("consumer_rtx4080x4_rtx4090x4")
    plan = res.plan.with_schedule("h1f1b")
    rows = interleaved_splits(job, plan, virtuals=(2,), fractions=(0.2, 0.5))
    assert [(v, fr, rc) for v, fr, rc, _, _ in rows] == [
        (2, 0.2, False), (2, 0.2, True), (2, 0.5, False), (2, 0.5, True)]
    # every rank holds an even number of layers here: the 50% cut is the planner's even one
    assert all(s.num_layers % 2 == 0 for s in plan.stages)
    cm = CostModel(job.model.with_layer_unit(plan.layer_unit), job.cluster, job.profile)
    even = interleaved_layout(layout_of_plan(cm, plan), plan.num_microbatches, 2)
    assert rows[2][4] == pytest.approx(replay_kind(cm, even, plan.num_microbatches).iteration_s)
    # recomputing the early chunks only adds their forwards again: never faster
    assert rows[3][4] >= rows[2][4] and rows[1][4] >= rows[0][4]
    assert rows[0][4] != pytest.approx(rows[2][4])  # another cut, another replay


def test_what_ifs_scale_the_collectives_and_the_state_and_restore_them():
    from benchmarks.search_effort import distributed_optimizer_memory, tp_comm_exposed
    from hapt_hf.core.precision import REPLICATED, SHARDED

    job = load_job(scenario_path("scale_llama70b_mixed256"))
    fast = next(g for g in job.cluster.groups if g.intra_node.bandwidth_gbps >= 1000)
    slow = next(g for g in job.cluster.groups if g.intra_node.bandwidth_gbps < 1000)

    def prices():
        cm = CostModel(job.model, job.cluster, job.profile)
        return {g.name: (cm.tp_allreduce_s(g, 2, 4, 3), cm.head_comm_s(g, 2, 4),
                         cm.sp_edge_s(g, 2, 4, 1, 5), cm.sp_regather_s(g, 2, 4, 1, 5))
                for g in (fast, slow)}

    def flat(p):
        return [p[0], *p[1], p[2], p[3]]

    before = prices()
    assert all(x > 0 for p in before.values() for x in flat(p))
    with tp_comm_exposed(0.25):
        quarter = prices()
    with tp_comm_exposed(0.0, only_below_gbps=1000):
        fast_hidden = prices()
    for g in (fast.name, slow.name):
        assert flat(quarter[g]) == pytest.approx([0.25 * x for x in flat(before[g])])
    assert flat(fast_hidden[fast.name]) == [0.0] * 5
    assert flat(fast_hidden[slow.name]) == flat(before[slow.name])
    assert prices() == before  # restored

    cm = CostModel(job.model, job.cluster, job.profile)
    params = cm.shard(4).params[9] - cm.shard(4).params[1]
    state = (cm.static_bytes(1, 9, SHARDED, 4, 4), cm.static_bytes(1, 9, REPLICATED, 4, 4),
             cm.weight_copy_bytes(1, 9, tp=4))
    assert state[0] == pytest.approx(params * (4 + 4 + 8 / 4)) and state[2] > 0
    with distributed_optimizer_memory():
        cm2 = CostModel(job.model, job.cluster, job.profile)
        assert cm2.static_bytes(1, 9, SHARDED, 4, 4) == pytest.approx(params * (2 + 2 + 12 / 4))
        assert cm2.static_bytes(1, 9, REPLICATED, 4, 4) == pytest.approx(params * 16)
        assert cm2.weight_copy_bytes(1, 9, tp=4) == 0.0
    cm3 = CostModel(job.model, job.cluster, job.profile)
    assert (cm3.static_bytes(1, 9, SHARDED, 4, 4), cm3.static_bytes(1, 9, REPLICATED, 4, 4),
            cm3.weight_copy_bytes(1, 9, tp=4)) == state
