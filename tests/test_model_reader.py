"""Figures read off the model itself agree with the hand formulas of the planner's oracles."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from hapt_hf.errors import UnsupportedModel
from benchmarks.chain_check import attention_for, tiny_config
from hapt_hf.planner.model_spec import ModelSpec, ModelSpecError
from hapt_hf.profiling.model_figures import MeasuringReader
from hapt_hf.profiling.model_reader import read_layer_counts, read_layer_specs, read_model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_read_counts_match_the_formulas(model_type, attn):
    config = tiny_config(model_type, blocks=2)
    spec = ModelSpec.from_formula(config, 32, attn_implementation=attn)
    got = read_layer_counts(config, 32, attn)
    assert [c.params for c in got] == [l.params for l in spec.layers]
    assert sum(c.params for c in got) == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    for c, layer in zip(got, spec.layers):
        assert c.fwd_flops == pytest.approx(layer.fwd_flops, rel=0.02)
        assert c.bwd_flops == pytest.approx(layer.bwd_flops, rel=0.02)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [64, 512])  # 512: kept bytes fitted from shorter runs
def test_reader_spec_matches_the_llama_formula(seq_len, dtype):
    config = tiny_config("llama", blocks=2)
    formula = ModelSpec.from_formula(config, seq_len, dtype)
    read = read_layer_specs(config, seq_len, dtype)
    assert [l.kind for l in read] == [l.kind for l in formula.layers]
    for got, want in zip(read, formula.layers):
        assert got.params == want.params
        assert got.fwd_flops == pytest.approx(want.fwd_flops, rel=0.02)
        assert got.bwd_flops == pytest.approx(want.bwd_flops, rel=0.02)
        assert got.act_out_bytes == want.act_out_bytes
        assert got.act_in_bytes == want.act_in_bytes
        kept, budget = (l.act_keep_bytes + l.act_keep_fixed_bytes for l in (got, want))
        assert kept == pytest.approx(budget, rel=0.10), got.kind


def test_model_spec_reads_a_type_without_a_hand_formula():
    config = tiny_config("gemma3_text", blocks=2)  # sliding and full blocks alternate
    spec = ModelSpec.from_config(config, 64, "bf16", reader=MeasuringReader())
    assert spec.family == "gemma3_text" and spec.num_blocks == 2 and not spec.can_split_blocks
    assert spec.total_params == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    blocks = spec.layers[1:-1]
    assert blocks[0].signature != blocks[1].signature  # sliding / full attention
    assert all(l.act_keep_bytes > 0 for l in spec.layers)
    assert all(l.fwd_flops > 0 for l in spec.layers[1:])  # the embedding is a lookup


def test_model_spec_refuses_a_new_type_without_the_reader():
    with pytest.raises(UnsupportedModel, match="hapt_hf.model_spec"):
        ModelSpec.from_config(tiny_config("qwen3", blocks=2), 64)
    for reader in (None, MeasuringReader()):
        with pytest.raises(UnsupportedModel, match="not supported"):
            ModelSpec.from_config(_unverified_config(), 64, reader=reader)


def _unverified_config():
    from transformers import PretrainedConfig
    config = PretrainedConfig()
    config.model_type = "no_such_type"
    return config


def test_moe_flops_count_the_experts_that_run():
    config = tiny_config("mixtral", blocks=2)
    h, i = config.hidden_size, config.intermediate_size
    dense = read_layer_counts(tiny_config("mistral", blocks=2), 32, "eager")
    moe = read_layer_counts(config, 32, "eager")
    # a block differs from Mistral's by its experts (top_k of them run per token, 3 matmuls of
    # h x i each) instead of one MLP, plus the router's h x num_experts
    experts = 2 * 32 * 3 * h * i * (config.num_experts_per_tok - 1)
    router = 2 * 32 * h * config.num_local_experts
    assert moe[1].fwd_flops == dense[1].fwd_flops + experts + router


def test_a_405b_class_config_reads_without_real_memory():
    """Kept bytes are measured on fake tensors: reading a 405B-class model allocates no layer
    (a real CPU block of this shape would take 13 GB). Timed in docs/benchmarks.md."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "model_reader.py"
    done = subprocess.run([sys.executable, str(script), "--type", "qwen3"], capture_output=True,
                          text=True, check=True, timeout=300)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["layers"] == 128 and got["params"] > 400e9
    assert got["peak_rss_growth_bytes"] < 256 * 2 ** 20


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reader_half_blocks_match_the_llama_formula(dtype, attn):
    config = tiny_config("llama", blocks=2)
    formula = ModelSpec.from_formula(config, 64, dtype, attn_implementation=attn).split_blocks()
    read = read_model(config, 64, dtype, attn)
    assert read.half_refusal == "" and len(read.half_layers) == formula.num_layers
    for got, want in zip(read.half_layers, formula.layers):
        assert (got.index, got.kind, got.params) == (want.index, want.kind, want.params)
        assert got.fwd_flops == pytest.approx(want.fwd_flops, rel=0.02)
        assert got.bwd_flops == pytest.approx(want.bwd_flops, rel=0.02)
        assert got.profile_share == pytest.approx(want.profile_share, rel=0.02)
        assert bool(got.profile_signature) == bool(want.profile_signature)
        kept, budget = (l.act_keep_bytes + l.act_keep_fixed_bytes for l in (got, want))
        assert kept == pytest.approx(budget, rel=0.10), got.signature


def _cluster():
    from hapt_hf.planner.cluster import Cluster, builtin_cluster_path
    return Cluster.load(builtin_cluster_path("cpu_demo_4"))


def test_generic_blocks_of_llama_shape_are_planned_in_halves():
    from hapt_hf.planner.search import PlannerOptions, plan_job
    config = tiny_config("qwen3", blocks=3)
    spec = ModelSpec.from_config(config, 32, "fp32", reader=MeasuringReader())
    assert spec.can_split_blocks and spec.half_refusal == ""
    halves = spec.split_blocks()
    assert halves.num_layers == 2 * 3 + 2 and halves.total_params == spec.total_params
    block = AutoModelForCausalLM.from_config(config).model.layers[0]
    attn = sum(p.numel() for m in (block.input_layernorm, block.self_attn) for p in m.parameters())
    assert [l.params for l in halves.layers[1:3]] == [attn, spec.layers[1].params - attn]
    plan = plan_job(spec, _cluster(), 16, options=PlannerOptions(layer_unit="half")).plan
    assert plan.layer_unit == "half" and plan.num_layers == halves.num_layers


@pytest.mark.parametrize("model_type", ["phi", "gptj", "gpt_neox", "falcon"])
def test_parallel_blocks_refuse_halves_and_are_planned_whole(model_type):
    from hapt_hf.planner.search import PlannerOptions, PlanningError, plan_job
    config = tiny_config(model_type, blocks=2)
    if model_type == "falcon":
        config.parallel_attn = True  # the default, said here: the refusal depends on it
    attn = attention_for(config)  # sdpa where the type has it (GPT-J before transformers 5.24 has not)
    spec = ModelSpec.from_config(config, 32, "fp32", attn_implementation=attn, reader=MeasuringReader())
    assert not spec.can_split_blocks and "in parallel" in spec.half_refusal
    with pytest.raises(ModelSpecError, match=f"'half' is not possible .*{model_type}.*in parallel"):
        spec.split_blocks()
    with pytest.raises(PlanningError, match="in parallel"):
        plan_job(spec, _cluster(), 16, options=PlannerOptions(layer_unit="half"))
    assert plan_job(spec, _cluster(), 16).plan.layer_unit == "block"  # 'auto': whole blocks
