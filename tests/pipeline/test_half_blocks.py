"""Stages cut inside transformer blocks (layer_unit="half"): numerics, init, checkpoints."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from hapt_hf.pipeline import checkpoint_io, init_replay
from hapt_hf.pipeline.stage import BlockPart, StageBuildError, block_parts, build_stage
from transformers import OPTConfig

from benchmarks.chain_check import tiny_config
from tests.pipeline.test_stage import (TOL, assert_grads_match, batch, gpt2, llama, opt, qwen2,
                                       reference, run_chain, token_count)

# Half layer sequence of a 3-block model: 0 embedding, 1 b0.attn, 2 b0.mlp, 3 b1.attn, 4 b1.mlp,
# 5 b2.attn, 6 b2.mlp, 7 head.
PARTITIONS = {
    # embedding + b0.attn | b0.mlp .. b1.attn | b1.mlp .. head
    "cut_inside_every_stage": [(0, 2), (2, 4), (4, 8)],
    # a stage that is one attention half only, then one MLP half only
    "single_halves": [(0, 3), (3, 4), (4, 5), (5, 8)],
    # cut between whole blocks in half units, plus the head alone
    "whole_blocks_in_half_units": [(0, 3), (3, 7), (7, 8)],
    # two stages: block 1's attention half ends the first, its MLP half starts the second
    "two_stages": [(0, 4), (4, 8)],
}


def opt_postnorm(blocks: int) -> OPTConfig:
    """OPT-350m's block shape: each half norms its residual sum (do_layer_norm_before False)."""
    config = opt(blocks, projected=True)
    config.do_layer_norm_before = False
    return config


@pytest.mark.parametrize("family", [gpt2, llama, qwen2, opt, opt_postnorm],
                         ids=["gpt2_tied", "llama_untied", "qwen2_sliding", "opt_prenorm",
                              "opt_postnorm_projected"])
@pytest.mark.parametrize("partition", list(PARTITIONS), ids=list(PARTITIONS))
def test_half_chain_equals_full_model(family: Callable, partition: str) -> None:
    config = family(3)
    ref = reference(config)
    stages = [build_stage(config, r, layer_unit="half") for r in PARTITIONS[partition]]
    ids, mask, labels = batch(padded=True)

    out = ref(ids, attention_mask=mask, labels=labels)
    assert_close(run_chain(stages, ids, mask), out.logits, **TOL)
    loss = run_chain(stages, ids, mask, labels) / token_count(labels)
    assert_close(loss, out.loss, **TOL)
    out.loss.backward()
    loss.backward()
    assert_grads_match(stages, ref)


def test_opt_split_block_keeps_each_half_on_its_stage() -> None:
    config = opt(3)
    first, second = (build_stage(config, r, layer_unit="half") for r in [(0, 4), (4, 8)])
    a, b = set(first.hf_state_dict()), set(second.hf_state_dict())
    assert not a & b and set(reference(config).state_dict()) == a | b
    block = "model.decoder.layers.1"
    assert {f"{block}.self_attn.q_proj.weight", f"{block}.self_attn_layer_norm.weight"} <= a
    assert {f"{block}.fc1.weight", f"{block}.fc2.weight", f"{block}.final_layer_norm.weight"} <= b


def test_split_block_tensors_live_on_one_stage_each() -> None:
    config = llama(3)
    first, second = (build_stage(config, r, layer_unit="half") for r in [(0, 4), (4, 8)])
    a, b = set(first.hf_state_dict()), set(second.hf_state_dict())
    assert not a & b
    assert set(reference(config).state_dict()) == a | b
    # block 1 is split: attention half on the first stage, MLP half on the second
    assert "model.layers.1.self_attn.q_proj.weight" in a and "model.layers.1.input_layernorm.weight" in a
    assert "model.layers.1.mlp.up_proj.weight" in b and "model.layers.1.post_attention_layernorm.weight" in b
    assert first.parts == (BlockPart(0, "full"), BlockPart(1, "attn"))
    assert second.parts == (BlockPart(1, "mlp"), BlockPart(2, "full"))


def test_block_parts_merge_whole_blocks() -> None:
    assert block_parts((1, 5), 3, "half") == (BlockPart(0, "full"), BlockPart(1, "full"))
    assert block_parts((2, 6), 3, "half") == (BlockPart(0, "mlp"), BlockPart(1, "full"),
                                              BlockPart(2, "attn"))
    assert block_parts((0, 5), 3, "block") == (BlockPart(0, "full"), BlockPart(1, "full"),
                                               BlockPart(2, "full"))


@pytest.mark.parametrize("family", [gpt2, llama, opt], ids=["gpt2", "llama", "opt"])
def test_half_seed_init_is_bit_identical(family: Callable, monkeypatch) -> None:
    config = family(3)
    ref_state = reference(config, seed=3).state_dict()
    monkeypatch.setattr(init_replay, "full_model_init",
                        lambda *a, **k: pytest.fail("seed init fell back to the full model"))
    ranges = [(0, 2), (2, 5), (5, 8)]
    gathered = checkpoint_io.gather_state_dicts(
        build_stage(config, r, seed=3, layer_unit="half").hf_state_dict() for r in ranges)
    assert set(gathered) == set(ref_state)
    for key, value in ref_state.items():
        assert torch.equal(gathered[key], value), key


def test_half_checkpoint_load_and_recompute(tmp_path) -> None:
    config = gpt2(3)
    saved = reference(config, seed=11)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    ids, mask, labels = batch(padded=True)
    expected = saved(ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    stages = [build_stage(config, r, checkpoint_dir=tmp_path, layer_unit="half", recompute=True)
              for r in [(0, 3), (3, 6), (6, 8)]]
    full_state = saved.state_dict()
    for stage in stages:
        for key, value in stage.hf_state_dict().items():
            assert torch.equal(value, full_state[key]), key
    loss = run_chain(stages, ids, mask, labels) / token_count(labels)
    assert_close(loss, expected.loss, **TOL)
    loss.backward()
    assert_grads_match(stages, saved)


def test_half_refused_where_not_exact() -> None:
    with pytest.raises(StageBuildError, match="layer_unit 'half' is not supported for the "
                                              "gpt_neox family .* in parallel"):
        build_stage(tiny_config("gpt_neox"), (0, 2), layer_unit="half")
    with pytest.raises(StageBuildError, match="layer_unit 'quarter' is unknown"):
        build_stage(gpt2(3), (0, 2), layer_unit="quarter")
    with pytest.raises(StageBuildError, match=r"0 <= start < end <= 8"):
        build_stage(gpt2(3), (0, 9), layer_unit="half")


def test_launch_accepts_half_plans_of_the_right_length() -> None:
    from hapt_hf.integration.plan_resolution import check_model_matches_plan, format_plan
    from hapt_hf.planner.plan import Plan, PlanError, Stage

    def plan(num_layers: int, layer_unit: str) -> Plan:
        stages = (Stage.even(0, (0, 4), "g", "cpu", (0,), 2, micro_batch_size=2),
                  Stage.even(1, (4, num_layers), "g", "cpu", (1,), 1, micro_batch_size=2))
        return Plan("m", num_layers, 16, 8, 2, 4, "1f1b", stages, layer_unit=layer_unit).validate()

    config = gpt2(3)
    check_model_matches_plan(plan(8, "half"), config, 16)
    check_model_matches_plan(plan(5, "block"), config, 16)
    with pytest.raises(PlanError, match=r"cuts 8 layers but the model has 3 blocks .* = 5 layers "
                                        r"with layer_unit 'block'"):
        check_model_matches_plan(plan(8, "block"), config, 16)
    with pytest.raises(PlanError, match=r"cuts 10 layers .* = 8 layers with layer_unit 'half'"):
        check_model_matches_plan(plan(10, "half"), config, 16)
    assert "emb b0.attn b0.mlp b1.attn" in format_plan(plan(8, "half"))
