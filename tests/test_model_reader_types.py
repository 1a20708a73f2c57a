"""Types whose forward reads values a meta model has none of are read all the same: experts
grouped by their routing (DBRX's ``nonzero``, JetMoE's tokens per expert as a list), a mask
builder reading the position ids (Cohere Compass, Moshi), a mask term on a non-first stage
(BioGPT). Their figures against a real CPU run of the tiny model, and `hapt-hf plan` on them."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from hapt_hf.cli import main
from benchmarks.chain_check import attention_for, tiny_config
from hapt_hf.pipeline.stage import build_stage
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Plan
from hapt_hf.profiling.model_figures import MeasuringReader
from hapt_hf.profiling.model_reader import read_layer_counts

TYPES = ("dbrx", "jetmoe", "biogpt", "cohere_compass_text", "moshi")
SEQ = 32


def _real_forward_flops(config) -> int:
    """FLOPs of one real CPU forward of the tiny model (its routing decided by real data)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.requires_grad_(False)  # the counter's module tracker cannot hook DBRX's leaf views
    ids = torch.randint(3, config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones(1, SEQ, dtype=torch.long))
    return counter.get_total_flops()


@pytest.mark.parametrize("model_type", TYPES)
def test_model_spec_of_the_type_is_its_real_model(model_type):
    config = tiny_config(model_type, blocks=2)
    spec = ModelSpec.from_config(config, SEQ, "fp32", attn_implementation=attention_for(config),
                                 reader=MeasuringReader())
    assert spec.family == model_type and spec.num_blocks == 2
    assert spec.total_params == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert all(l.fwd_flops > 0 and l.bwd_flops > 0 for l in spec.layers[1:])  # embedding: lookup
    assert all(l.act_keep_bytes > 0 for l in spec.layers[1:])


@pytest.mark.parametrize("model_type", TYPES)
def test_read_flops_equal_a_real_forward(model_type):
    """Eager counts every op as run: the sum over the layers is the real model's forward, whose
    experts ran on the tokens its router really sent them (tokens x top-k expert passes in all,
    however they fell)."""
    config = tiny_config(model_type, blocks=2)
    read = read_layer_counts(config, SEQ, "eager")
    assert sum(c.fwd_flops for c in read) == _real_forward_flops(config)


def test_dbrx_flops_count_the_top_k_share_of_its_experts():
    def block(top_k):
        config = tiny_config("dbrx", blocks=2)
        config.ffn_config.moe_top_k = top_k
        return config, read_layer_counts(config, SEQ, "eager")[1]

    config, one = block(1)
    _, two = block(2)
    h, f = config.d_model, config.ffn_config.ffn_hidden_size
    # one more expert a token: its three h x f matmuls (w1, v1, w2) on every token
    assert two.fwd_flops - one.fwd_flops == 2 * SEQ * 3 * h * f


def test_biogpt_later_stage_runs_without_a_padding_mask():
    """Without a batch mask BioGPT's base makes a [b, s] float mask of ones, which the stage's
    stand-in for the position embedding it does not own must not take for a hidden state."""
    config = tiny_config("biogpt", blocks=2)
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(config))
    stages = [build_stage(config, r, attn_implementation=attention_for(config)) for r in
              ((0, 2), (2, 4))]
    for stage in stages:
        stage.load_state_dict({k: v for k, v in full.state_dict().items()
                               if k in stage.state_dict()}, strict=True)
    ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = stages[1](stages[0](ids))
        torch.testing.assert_close(logits, full(input_ids=ids).logits, rtol=1e-5, atol=4e-5)


CLUSTER = """\
name: small
groups:
  - {name: v100, gpu: V100-32, nodes: 1, gpus_per_node: 2}
job:
  seq_len: 32
  global_batch_size: 8
  dtype: fp32
"""


@pytest.mark.parametrize("model_type", ["dbrx", "moshi"])
def test_plan_plans_the_type(model_type, tmp_path, capsys):
    config = tiny_config(model_type, blocks=2)
    config.save_pretrained(tmp_path / "model")
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    out_json = tmp_path / "plan.json"
    code = main(["plan", "--cluster", str(tmp_path / "cluster.yaml"), "--model",
                 str(tmp_path / "model"), "--attn-implementation", attention_for(config),
                 "-o", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = Plan.load(out_json).validate()
    assert plan.num_layers == 4 and plan.model_name == str(tmp_path / "model")


def test_top_k_over_data_less_scores_is_real_and_evenly_spread():
    from hapt_hf.profiling.routing import balanced_routing
    scores = torch.empty(2, 15, 8, device="meta")  # (batch, tokens, experts)
    with balanced_routing():
        values, experts = scores.topk(3, dim=-1)
    assert experts.device.type == "cpu" and experts.shape == (2, 15, 3)
    assert values.shape == (2, 15, 3) and torch.all(values == 1 / 3)
    assert all(len(set(row.tolist())) == 3 for row in experts.view(-1, 3))  # 3 distinct a token
    load = torch.bincount(experts.flatten(), minlength=8)
    assert load.sum() == 2 * 15 * 3 and load.max() - load.min() <= 1
