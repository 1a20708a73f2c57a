"""The planner's memory model against what autograd really keeps, family by family.

Every layer kind (embedding, block, head) of every family is built as the runtime builds it
(``build_stage``) and run forward under saved-tensor hooks; the bytes saved for the backward
(weights excluded) must be within 10% of ``act_keep_bytes * samples + act_keep_fixed_bytes``.
Dropout is off: PyTorch's CPU dropout keeps wider masks than the GPU kernels the model counts.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from hapt_hf.core.precision import STATE_BYTES_PER_PARAM
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import ModelSpec, model_config
from hapt_hf.profiling import layer_memory

FAMILIES = ["gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny", "opt-tiny"]
_DROPOUT = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout", "attention_dropout")


def _config(name: str, **overrides):
    cfg = model_config(name)
    for k in _DROPOUT:
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _check(rows) -> None:
    assert {r.kind for r in rows} == {"embedding", "block", "head"}
    for r in rows:
        assert r.ratio == pytest.approx(1.0, abs=0.10), \
            f"{r.kind}: planner {r.planned_bytes:.0f} B, autograd {r.measured_bytes:.0f} B"


@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_kept_bytes_match_autograd_in_fp32(name, attn, seq_len):
    torch.manual_seed(0)
    _check(layer_memory(_config(name), seq_len, "fp32", attn))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_kept_bytes_match_autograd_under_autocast(name, attn):
    # bf16 compute over fp32 weights, two samples: the per-sample tensors and the per-micro-batch
    # weight copies (and GPT-2's shared position ids) are both exercised
    torch.manual_seed(0)
    _check(layer_memory(_config(name), 128, "bf16", attn, micro_batch=2))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_shorter_than_the_sequence(attn):
    # Mistral's window below seq_len makes the attention mask explicit: sdpa keeps it per block
    torch.manual_seed(0)
    _check(layer_memory(_config("mistral-tiny", sliding_window=32), 128, "fp32", attn))


@pytest.mark.parametrize("name", FAMILIES)
def test_training_state_is_counted_exactly(name):
    # fp32 weights, fp32 gradients, two fp32 Adam moments: 16 bytes a parameter, any precision
    cfg = _config(name)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    state = params * (4 + 4) + sum(p.numel() * 2 * 4 for p in model.parameters())
    for dtype in ("fp32", "bf16"):
        spec = ModelSpec.from_config(cfg, 64, dtype)
        cm = CostModel(spec, Cluster.load("cpu_demo_4"))
        assert spec.total_params == params
        assert cm.static_bytes(0, spec.num_layers) == state == params * STATE_BYTES_PER_PARAM
