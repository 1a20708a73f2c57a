"""The planner's tensor-parallel levers beside the split blocks: each cost term of sequence
parallelism and of the vocabulary-split LM head against a hand computation, and stages of one
group at degrees of their own."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hapt_hf.core.precision import REPLICATED
from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, LinkSpec
from hapt_hf.planner.cost_model import (CostModel, CostModelError, head_rank_keep_bytes,
                                        head_rank_params, head_split, sp_unfit, tp_efficiency)
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Replica, Stage
from hapt_hf.planner.search import PlannerOptions, SearchProblem
from hapt_hf.planner.search.options import Layout
from hapt_hf.planner.search.tensor_parallel import degree_mixes

SEQ, HIDDEN, VOCAB = 1024, 1024, 1000
BW_GBPS, LAT_US = 200.0, 10.0


def llama(family="llama", tied=False, blocks=2) -> ModelSpec:
    return ModelSpec.from_job_dict({"family": family, "hidden_size": HIDDEN,
                                    "intermediate_size": 4096, "num_layers": blocks,
                                    "num_heads": 8, "num_kv_heads": 4, "vocab_size": VOCAB,
                                    "tie_word_embeddings": tied}, SEQ, "fp16")


def one_group(gpus=8, gpn=8) -> Cluster:
    return Cluster("tp", (GpuGroup("a", GpuType("G-16", 100.0, 16.0), gpus // gpn, gpn,
                                   LinkSpec(BW_GBPS, LAT_US), LinkSpec(50, 20)),), ())


def reps(t: int, width: int, samples: int = 1, first: int = 0) -> tuple[Replica, ...]:
    return tuple(Replica("a", "G-16", samples, tuple(range(first + i * t, first + (i + 1) * t)))
                 for i in range(width))


def allgather_s(t: int, nbytes: float) -> float:
    return (t - 1) / t * nbytes * 8 / (BW_GBPS * 1e9) + (t - 1) * LAT_US * 1e-6


def allreduce_s(t: int, nbytes: float) -> float:
    return 2 * allgather_s(t, nbytes)


# -- sequence parallelism --------------------------------------------------------------------

def test_sequence_parallelism_keeps_what_the_runtime_keeps_of_a_block():
    m = llama()
    cm = CostModel(m, one_group())
    blk = m.layers[1]
    for t in (2, 4):
        # what the runtime keeps: 34/t of the 34 parts (the attention's and the MLP's
        # gathered inputs kept split and gathered again), against (10 + 24/t) / 34 without;
        # weight copies 1/t, once for the step's micro-batches in flight
        assert cm.activation_bytes(3, 1, 2, tp=t, sp=True) == pytest.approx(
            3 * blk.act_keep_bytes * (34 / t) / 34)
        assert cm.activation_bytes(3, 1, 2, tp=t) == pytest.approx(
            3 * blk.act_keep_bytes * (10 + 24 / t) / 34)
        assert cm.weight_copy_bytes(1, 2, tp=t) == pytest.approx(blk.act_keep_fixed_bytes / t)
        assert cm.memory_bytes(3, 1, 2, 5, tp=t) == pytest.approx(
            cm.static_bytes(1, 2, tp=t) + 5 * cm.activation_bytes(3, 1, 2, tp=t)
            + blk.act_keep_fixed_bytes / t + cm.working_bytes(3, 1, 2, t))
        assert cm.weight_copy_bytes(1, 2, True, tp=t) == 0.0  # a recomputed block keeps none
        # a recomputed block keeps its input split on the sequence
        assert cm.activation_bytes(3, 1, 2, True, tp=t, sp=True) == pytest.approx(
            3 * blk.act_in_bytes / t)
        assert cm.working_bytes(3, 1, 2, t, True) == pytest.approx(
            3 * blk.act_keep_bytes * (34 / t) / 34)
        # the weights do not change
        assert cm.memory_bytes(1, 1, 2, 0, tp=t, sp=True) == pytest.approx(
            cm.static_bytes(1, 2, tp=t) + blk.act_keep_bytes * (34 / t) / 34)
    # the embedding and the head are no blocks: as without
    L = m.num_layers
    for a, b in ((0, 1), (L - 1, L)):
        assert cm.activation_bytes(2, a, b, tp=4, sp=True) == cm.activation_bytes(2, a, b, tp=4)


def test_a_sequence_parallel_stage_pays_its_all_gathers_and_the_same_all_reduces():
    m = llama(blocks=3)
    cm = CostModel(m, one_group())
    t, samples = 4, 2
    layers = (1, 3)  # two blocks
    plain = cm.stage_costs([Stage(0, layers, reps(t, 2, samples))], 4).stages[0]
    sp = cm.stage_costs([Stage(0, layers, reps(t, 2, samples), sequence_parallel=True)],
                        4).stages[0]
    # the stage's output gathered on the sequence forward, its input's gradient backward:
    # samples x seq x hidden at 2 bytes (fp16)
    edge = allgather_s(t, samples * SEQ * HIDDEN * 2)
    assert cm.sp_edge_s(cm.hardware.groups[0], samples, t, *layers) == pytest.approx(edge)
    assert sp.forward_s == pytest.approx(plain.forward_s + edge)
    # backward: the edge, and each block's attention and MLP inputs gathered again for the
    # projections' weight gradients (their slices were kept): 2 all-gathers a block
    again = 2 * 2 * allgather_s(t, samples * SEQ * HIDDEN * 2)
    assert cm.sp_regather_s(cm.hardware.groups[0], samples, t, *layers) == pytest.approx(again)
    assert sp.backward_s == pytest.approx(plain.backward_s + edge + again)
    # a recomputing stage gathers them in its recomputed forward (priced with it) only
    plain_rc = cm.stage_costs([Stage(0, layers, reps(t, 2, samples), recompute=True)],
                              4).stages[0]
    sp_rc = cm.stage_costs([Stage(0, layers, reps(t, 2, samples), recompute=True,
                                  sequence_parallel=True)], 4).stages[0]
    assert sp_rc.backward_s == pytest.approx(plain_rc.backward_s + edge)
    # reduce-scatter + all-gather move what the all-reduce moved: the blocks' times stand
    g = cm.hardware.groups[0]
    f1, b1 = cm.compute_s(g, samples, 1, 3)
    eff = tp_efficiency(t, HIDDEN)
    ar = 2 * allreduce_s(t, samples * SEQ * HIDDEN * 2)  # two a block, per pass
    assert plain.forward_s == pytest.approx(f1 / (t * eff) + 2 * ar)
    assert plain.backward_s == pytest.approx(b1 / (t * eff) + 2 * ar)
    assert sp.activation_bytes < plain.activation_bytes
    assert sp.static_bytes == plain.static_bytes and sp.allreduce_s == plain.allreduce_s
    # a stage without a block gathers nothing
    assert cm.sp_edge_s(g, samples, t, 0, 1) == 0.0


def test_sequence_parallelism_where_the_runtime_runs_it_and_nowhere_else():
    m = llama()
    assert sp_unfit(m, 4) is None and CostModel(m, one_group()).sp_allowed(4)
    assert not CostModel(m, one_group()).sp_allowed(1)
    assert "half" in sp_unfit(m.split_blocks(), 4)  # a stage may end inside a block
    assert sp_unfit(llama("qwen2"), 2) is None
    # a plan that does not make o_proj row-wise: its output is not reduce-scattered
    plan = tuple((k, v) for k, v in m.tp_plan if not k.endswith("o_proj"))
    assert "o_proj" in sp_unfit(replace(m, tp_plan=plan), 2)
    assert "pre-norm" in sp_unfit(replace(m, family="phi3"), 2)
    cm = CostModel(m.split_blocks(), one_group())
    with pytest.raises(CostModelError, match="sequence parallelism"):
        cm.stage_costs([Stage(0, (0, cm.model.num_layers), reps(2, 2),
                              sequence_parallel=True)], 2)


# -- the vocabulary-split head ---------------------------------------------------------------

def test_the_head_splits_by_vocabulary_rows_where_the_runtime_splits_it():
    m = llama()
    cm = CostModel(m, one_group())
    g, L, head = cm.hardware.groups[0], m.num_layers, m.layers[-1]
    assert head_split(m, 4) and not head_split(m, 1)
    assert not head_split(llama(tied=True), 4)  # tied to the whole embedding: whole
    assert not head_split(m, 8)  # 8 does not divide the 4 key/value heads
    for t in (2, 4):
        # the final norm whole, ceil(V/t) rows of the V x hidden matrix
        rows = math.ceil(VOCAB / t)
        assert head_rank_params(m, t) == head.params - VOCAB * HIDDEN + rows * HIDDEN
        assert cm.static_bytes(L - 1, L, tp=t) == pytest.approx(head_rank_params(m, t) * 16)
        samples, eff = 2, tp_efficiency(t, HIDDEN)
        f1, b1 = cm.compute_s(g, samples, L - 1, L)
        # forward: the matmul's 1/t, then the loss on the logits left split: an all-reduce
        # of one fp32 number a token (the largest logit), one of two (the sum of the
        # exponentials, the target's logit); backward: 1/t, then the head input's gradient
        # all-reduced (samples x seq x hidden at 2 bytes)
        loss = allreduce_s(t, samples * SEQ * 4) + allreduce_s(t, 2 * samples * SEQ * 4)
        reduce = allreduce_s(t, samples * SEQ * HIDDEN * 2)
        assert cm.head_comm_s(g, samples, t) == pytest.approx((loss, reduce))
        f, b = cm.compute_s(g, samples, L - 1, L, tp=t)
        assert f == pytest.approx(f1 / (t * eff) + loss)
        assert b == pytest.approx(b1 / (t * eff) + reduce)
        # the optimizer step updates the rank's rows
        assert cm.update_s(g, samples, L - 1, L, tp=t) == pytest.approx(
            cm.update_s(g, samples, L - 1, L) * head_rank_params(m, t) / head.params)
        # the head keeps its rank's ceil(V/t) columns of the loss's fp32 softmax, not V
        # (tests/pipeline/test_vocab_parallel.py: what the runtime's loss saves); the rest whole
        assert cm.activation_bytes(samples, L - 1, L, tp=t) == pytest.approx(
            cm.activation_bytes(samples, L - 1, L) - samples * SEQ * 4 * (VOCAB - rows))
        assert head_rank_keep_bytes(m, t) == pytest.approx(
            head.act_keep_bytes - SEQ * 4 * (VOCAB - rows))
    tied = CostModel(llama(tied=True), one_group())
    assert tied.compute_s(g, 2, L - 1, L, tp=4) == tied.compute_s(g, 2, L - 1, L)
    assert tied.static_bytes(L - 1, L, tp=4) == tied.static_bytes(L - 1, L)


# -- a degree per stage ----------------------------------------------------------------------

def test_a_group_is_cut_again_at_two_neighbouring_degrees_on_the_same_gpus():
    m = llama(blocks=8)
    problem = SearchProblem.build(m, one_group(gpus=16), 16,
                                  options=PlannerOptions(max_tp=4))
    cm = problem.cost_model
    # four stages of two replicas of two GPUs: ranks 0..15
    stages = tuple(Stage(i, (2 * i, 2 * i + 2) if i < 3 else (6, m.num_layers),
                         reps(2, 2, 2, first=4 * i), 4 - i, False, REPLICATED)
                   for i in range(4))
    lay = Layout(stages, 4, "h1f1b")
    got = {key: shapes for key, shapes in degree_mixes(problem, lay)}
    # 16 GPUs in stages of 2 replicas: j stages at the higher degree, k at the lower
    assert set(got) == {("a", 2, 0, 1, 8), ("a", 2, 1, 1, 6), ("a", 2, 2, 1, 4),
                        ("a", 2, 3, 1, 2),
                        ("a", 4, 1, 2, 2), ("a", 4, 2, 2, 0)}
    for (_, high, j, low, k), shapes in got.items():
        assert [len(s) for s in shapes] == [2] * (j + k)
        assert [s[0].tp for s in shapes] == [high] * j + [low] * k
        ranks = [r for s in shapes for rep in s for r in rep.ranks]
        assert ranks == list(range(16))  # the group's GPUs, in order, each once
        for s in shapes:  # every replica inside one node of 8, samples split evenly
            assert all(len({x // 8 for x in rep.ranks}) == 1 and rep.samples == 2
                       for rep in s)
        # every stage priced at its own degree
        costs = cm.stage_costs([Stage(i, (0, 1), s) for i, s in enumerate(shapes)], 4)
        assert len(costs.stages) == j + k
    # degrees the model or max_tp refuse are not offered
    assert all(max(s[0].tp for s in shapes) <= 4 for shapes in got.values())


def test_the_head_plans_the_planner_reads_without_torch_are_transformers_own():
    from transformers import AutoConfig

    from hapt_hf.compat.transformers_api import causal_lm_tp_plan
    from hapt_hf.planner.model_spec import HEAD_TP_PLANS

    for family in ("llama", "mistral", "qwen2", "gpt2", "opt"):
        got = causal_lm_tp_plan(AutoConfig.for_model(family))
        assert dict(HEAD_TP_PLANS.get(family, ())) == (got or {}), family


def test_tp_stage_rounds_is_checked():
    from hapt_hf.planner.search import PlanningError
    with pytest.raises(PlanningError, match="tp_stage_rounds"):
        PlannerOptions(tp_stage_rounds=-1)
