"""Partial recompute in the planner: a stage whose first ``k`` blocks recompute
(``Stage.recompute_layers``) priced block by block, and the search choosing the fewest that fit."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Replica, Stage
from hapt_hf.planner.search import PlannerOptions, plan_job
from hapt_hf.planner.search.state import fewest_recomputed, partial_recompute
from hapt_hf.planner.simulate import backward_split


def llama(blocks: int = 4) -> ModelSpec:
    return ModelSpec.from_job_dict({"family": "llama", "hidden_size": 1024,
                                    "intermediate_size": 4096, "num_layers": blocks,
                                    "num_heads": 8, "num_kv_heads": 4, "vocab_size": 1000},
                                   2048, "fp16")


def one_group(memory_gb: float = 16.0, gpus: int = 4) -> Cluster:
    return Cluster("pr", (GpuGroup("a", GpuType("G", 100.0, memory_gb), 1, gpus,
                                   LinkSpec(200, 10), LinkSpec(50, 20)),), ())


def test_first_k_blocks_priced_as_recomputed_the_rest_as_kept():
    m = llama()
    cm = CostModel(m, one_group())
    g = cm.group("a")
    # layers: emb 0, blocks 1-4, head 5; a stage [0, 5) recomputing its first 2 blocks
    assert cm.recompute_end(0, 5, False, 2) == 3 and cm.recompute_end(2, 5, False, 2) == 4
    assert cm.recompute_end(0, 5, True) == 5 and cm.recompute_end(0, 5, False) == 0
    want = cm.activation_bytes(3, 0, 3, True) + cm.activation_bytes(3, 3, 5)
    assert cm.activation_bytes(3, 0, 5, units=2) == pytest.approx(want, rel=1e-12)
    assert cm.activation_bytes(3, 0, 5) > want > cm.activation_bytes(3, 0, 5, True)
    f, b = cm.compute_s(g, 3, 0, 5)
    _, b_all = cm.compute_s(g, 3, 0, 5, True)
    _, b_two = cm.compute_s(g, 3, 0, 5, units=2)
    fwd_two = cm.compute_s(g, 3, 1, 3)[0]  # the two recomputed blocks' forward
    assert b_two == pytest.approx(b + fwd_two, rel=1e-12)
    assert b < b_two < b_all == pytest.approx(b + cm.compute_s(g, 3, 1, 5)[0], rel=1e-12)


def test_stage_cost_of_a_partial_recompute():
    m = llama()
    cm = CostModel(m, one_group())
    reps = tuple(Replica("a", "G", 3, (i,)) for i in range(2))
    none = Stage(0, (0, 6), reps)
    part, full = replace(none, recompute_layers=2), replace(none, recompute=True)
    c0, c2, c4 = (cm.stage_costs([s], 6).stages[0] for s in (none, part, full))
    assert c0.activation_bytes > c2.activation_bytes > c4.activation_bytes
    assert c2.activation_bytes == pytest.approx(cm.activation_bytes(3, 0, 6, units=2))
    assert c2.recompute_s == pytest.approx(cm.compute_s(cm.group("a"), 3, 1, 3)[0])
    assert c2.backward_s == pytest.approx(c0.backward_s + c2.recompute_s)
    assert c0.recompute_s == c4.recompute_s == 0.0
    # the recomputed forward runs before the input gradient, outside the split
    i2, w2 = backward_split(c2, 0.5)
    i0, w0 = backward_split(c0, 0.5)
    assert w2 == pytest.approx(w0) and i2 == pytest.approx(i0 + c2.recompute_s)


def test_fewest_recomputed_bisects():
    calls = []

    def fits(k):
        calls.append(k)
        return k >= 5
    assert fewest_recomputed(fits, 9) == 5 and len(calls) <= 5
    assert fewest_recomputed(lambda k: True, 9) == 0
    assert fewest_recomputed(lambda k: k >= 9, 9) == 9


def test_partial_recompute_is_the_fewest_blocks_that_fit():
    m = llama(8)
    cm = CostModel(m, one_group(memory_gb=3.0))
    reps = (Replica("a", "G", 1, (0,)),)
    cap = cm.capacity_bytes(cm.group("a"))
    k, opt, sp = partial_recompute(cm, reps, 1, 0, 9, 2, allow_sharded=False)
    assert 0 < k < 8 and not sp
    assert cm.memory_bytes(1, 0, 9, 2, units=k) <= cap < cm.memory_bytes(1, 0, 9, 2, units=k - 1)


def test_search_recomputes_the_fewest_first_blocks_and_is_faster():
    # 1.6 GB GPUs: the first stages cannot hold their micro-batches in flight without recompute
    m, c = llama(8), one_group(memory_gb=1.6)
    with_part = plan_job(m, c, 32, options=PlannerOptions(max_tp=1))
    without = plan_job(m, c, 32, options=PlannerOptions(max_tp=1, allow_partial_recompute=False))
    assert any(s.recompute for s in without.plan.stages)
    assert not any(s.recompute_layers for s in without.plan.stages)
    part = [s for s in with_part.plan.stages if s.recompute_layers]
    assert part and all(0 < s.recompute_layers < s.block_units(m.num_layers) for s in part)
    assert with_part.sim.iteration_s < without.sim.iteration_s
    # the plan round-trips and replays the same
    again = type(with_part.plan).from_dict(with_part.plan.to_dict())
    assert [s.recompute_layers for s in again.stages] == \
        [s.recompute_layers for s in with_part.plan.stages]
