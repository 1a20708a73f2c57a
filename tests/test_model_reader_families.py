"""The families with a hand formula (gpt2, llama, mistral, qwen2, opt) are read off the model
too: the reader's figures against the formulas as oracles, whole blocks and halves, and
ModelSpec.from_config returning the reader's figures wherever it is given the reader."""
from __future__ import annotations

import pytest

from benchmarks.chain_check import tiny_config
from hapt_hf.planner.model_spec import ModelSpec, ModelSpecError, model_config
from hapt_hf.profiling.model_figures import MeasuringReader
from hapt_hf.profiling.model_reader import read_model

SEQ = 64

CASES = {
    "gpt2": ("gpt2", {}),
    "gpt2-dropout": ("gpt2", {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}),
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {}),  # tiny window (6) below SEQ: an explicit mask
    "qwen2": ("qwen2", {}),
    "opt": ("opt", {}),
    "opt-postnorm-dropout": ("opt", {"do_layer_norm_before": False, "dropout": 0.1,
                                     "attention_dropout": 0.1}),
}


def _config(case: str):
    model_type, overrides = CASES[case]
    config = tiny_config(model_type, blocks=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _kept(layer) -> float:
    return layer.act_keep_bytes + layer.act_keep_fixed_bytes


def _assert_near(read, formula, kept: bool = True) -> None:
    """Parameters exact, FLOPs within 2%, kept bytes within 10% (where ``kept``), the boundary
    bytes equal."""
    assert [(l.index, l.kind) for l in read] == [(l.index, l.kind) for l in formula]
    for got, want in zip(read, formula):
        where = f"layer {got.index} ({want.signature})"
        assert got.params == want.params, where
        assert got.fwd_flops == pytest.approx(want.fwd_flops, rel=0.02), where
        assert got.bwd_flops == pytest.approx(want.bwd_flops, rel=0.02), where
        assert (got.act_out_bytes, got.act_in_bytes) == (want.act_out_bytes, want.act_in_bytes)
        if kept:
            assert _kept(got) == pytest.approx(_kept(want), rel=0.10), where
        assert got.profile_share == pytest.approx(want.profile_share, rel=0.02), where
        assert bool(got.profile_signature) == bool(want.profile_signature), where


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reader_matches_the_formula_in_blocks_and_halves(case, dtype, attn):
    config = _config(case)
    formula = ModelSpec.from_formula(config, SEQ, dtype, attn_implementation=attn)
    read = read_model(config, SEQ, dtype, attn)
    _assert_near(read.layers, formula.layers)
    assert formula.can_split_blocks and read.half_refusal == ""  # every family is cut in halves
    # A post-norm OPT attention half feeds its input straight to q, k and v: measured on a
    # one-half stage, whose input is a leaf, autocast casts it once for the three (the formula
    # counts a block inside a stage: three casts). The halves then only split the block's bytes.
    post_norm_16bit = not getattr(config, "do_layer_norm_before", True) and dtype != "fp32"
    _assert_near(read.half_layers, formula.split_blocks().layers, kept=not post_norm_16bit)
    for block, attn, mlp in zip(read.layers[1:-1], read.half_layers[1:-1:2], read.half_layers[2:-1:2]):
        assert _kept(attn) + _kept(mlp) == pytest.approx(_kept(block)), block.signature


@pytest.mark.parametrize("case", ["opt", "opt-postnorm-dropout"])
def test_opt_halves_read_are_the_modules_a_half_stage_holds(case):
    """The reader's OPT halves hold exactly the parameters of the stages the runtime builds
    for them, and ModelSpec plans OPT in those halves."""
    from hapt_hf.pipeline.stage import build_stage
    config = _config(case)
    read = read_model(config, SEQ, "fp32", "sdpa")
    assert len(read.half_layers) == 2 * config.num_hidden_layers + 2
    for half in read.half_layers:
        stage = build_stage(config, (half.index, half.index + 1), layer_unit="half")
        tied = {id(p) for p in stage.tied_parameters()} if half.kind == "head" else set()
        assert half.params == sum(p.numel() for p in stage.parameters() if id(p) not in tied)
    spec = ModelSpec.from_config(config, SEQ, "fp32", reader=MeasuringReader())
    assert spec.can_split_blocks and spec.split_blocks().num_layers == len(read.half_layers)
    assert _figures(spec.half_layers) == _figures(read.half_layers)


def _figures(layers) -> list[tuple]:
    return [(l.index, l.kind, l.params, l.fwd_flops, l.bwd_flops, l.act_out_bytes,
             l.act_keep_bytes, l.act_in_bytes, l.act_keep_fixed_bytes, l.profile_share)
            for l in layers]


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mistral", "qwen2", "opt"])
def test_from_config_takes_the_readers_figures_when_given_it(model_type):
    config = tiny_config(model_type, blocks=2)
    formula = ModelSpec.from_formula(config, SEQ, "bf16")
    assert _figures(ModelSpec.from_config(config, SEQ, "bf16").layers) == \
        _figures(formula.layers)  # no reader: the torch-free hand formula
    read = read_model(config, SEQ, "bf16", "sdpa")
    spec = ModelSpec.from_config(config, SEQ, "bf16", reader=MeasuringReader())
    assert _figures(spec.layers) == _figures(read.layers)
    assert _figures(spec.half_layers) == _figures(read.half_layers)
    assert spec.half_refusal == read.half_refusal
    assert _figures(spec.layers) != _figures(formula.layers)  # measured, not the formula's
    # the signatures still name the shape as the formula does: stored profiles keep applying
    assert [l.signature for l in spec.layers] == [l.signature for l in formula.layers]
    if spec.can_split_blocks:
        halves = spec.split_blocks().layers
        assert [(l.signature, l.profile_signature) for l in halves] == \
            [(l.signature, l.profile_signature) for l in formula.split_blocks().layers]


def test_the_plan_command_reads_gpt2_in_halves():
    """`hapt-hf plan` builds its ModelSpec through the CLI's reader: the README's GPT-2 gets
    the reader's figures and can still be cut in halves."""
    from hapt_hf.cli.inputs import model_spec
    spec = model_spec("gpt2", SEQ, "fp16", "the test")
    read = read_model(model_config("gpt2"), SEQ, "fp16", "sdpa")
    assert _figures(spec.layers) == _figures(read.layers)
    assert spec.can_split_blocks and spec.split_blocks().num_layers == 2 * spec.num_blocks + 2


def test_a_gpt2_config_error_is_still_reported_with_the_reader():
    config = tiny_config("gpt2", blocks=2)
    with pytest.raises(ModelSpecError, match="seq_len 4096 exceeds the gpt2 model's learned position"):
        ModelSpec.from_config(config, 4096, "fp32", reader=MeasuringReader())
