"""Figures read off the model itself agree with the hand formulas of the planner's oracles."""
from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from hapt_hf.pipeline.coverage import tiny_config
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.profiling.model_reader import read_layer_counts


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_read_counts_match_the_formulas(model_type, attn):
    config = tiny_config(model_type, blocks=2)
    spec = ModelSpec.from_config(config, 32, attn_implementation=attn)
    got = read_layer_counts(config, 32, attn)
    assert [c.params for c in got] == [l.params for l in spec.layers]
    assert sum(c.params for c in got) == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    for c, layer in zip(got, spec.layers):
        assert c.fwd_flops == pytest.approx(layer.fwd_flops, rel=0.02)
        assert c.bwd_flops == pytest.approx(layer.bwd_flops, rel=0.02)
