"""Which causal LMs the stage builder cuts: tiny configs and the chain check behind docs/models.md.

``tiny_config(model_type)`` builds a small config (a few blocks, hidden 64, dropout off) from the
model type's own config class; ``check_chain(config, cuts)`` builds the full model and a chain
of stages with the same seed and compares logits, summed loss and every parameter's gradient.
tests/pipeline/test_generic_stage.py and scripts/model_matrix.py both use them: a yardstick read from
the checkout (``benchmarks.chain_check``), not part of the installed package.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from hapt_hf.compat.transformers_api import causal_lm_loss_sum
from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.pipeline.stage import build_stage

__all__ = ["ChainResult", "attention_for", "tiny_config", "check_chain", "chain_ranges"]

VOCAB, SEQ, BATCH = 128, 16, 2
_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
          "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
          "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
          "sliding_window": 6, "rotary_dim": 8, "output_router_logits": False,
          "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
          "moe_topk": 2, "index_n_heads": 2, "index_head_dim": 16,
          "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_ffn_dim": 128,
          "encoder_ffn_dim": 128, "decoder_layers": 2, "encoder_layers": 2,
          # per-layer input embeddings and layers reusing earlier layers' keys and values
          # (Gemma 3n, Gemma 4) are refused (config_checks.refusal): the configs without them
          "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 0,
          "num_kv_shared_layers": 0}
# Multi-head latent attention (DeepSeek V2/V3 and kin): the rotary part of each head is
# qk_rope_head_dim wide and the config's head_dim is that width (the rotary tables' size); the
# keys and values come from a shared low-rank projection with as many heads as the queries.
_MLA_SIZES = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
              "qk_head_dim": 16, "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4}


def _type_sizes(model_type: str, blocks: int) -> dict:
    """Settings a type names its own way, or that its published checkpoints set and
    transformers' default config lacks (the default does not build its model)."""
    if model_type == "gpt_neo":
        # attention kinds as [[kinds, repeats], ...], expanding to exactly `blocks` layers:
        # global and local alternating, a local window below the test's sequence
        kinds = [[["global", "local"], blocks // 2]] + ([[["global"], 1]] if blocks % 2 else [])
        return {"attention_types": kinds, "window_size": 6}
    if model_type == "dbrx":
        # sub-configs of their own; DBRX checkpoints set rope_theta and clip_qkv there (the
        # default has neither, and its attention reads both)
        return {"d_model": 64, "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4,
                                              "moe_top_k": 2},
                "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}}
    if model_type == "lfm2_moe":
        # the default names no layer kinds: every layer attention, as LFM2's default (its
        # convolution layers are refused by their kind), the first dense, the others MoE
        return {"layer_types": ["full_attention"] * blocks, "num_dense_layers": 1}
    if model_type == "cohere_compass_text":
        # rotary settings per attention kind (the default gives none)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        return {"rope_parameters": {"full_attention": rope, "sliding_attention": rope}}
    return {}


def tiny_config(model_type: str, blocks: int = 3) -> PretrainedConfig:
    """A small config of ``model_type``: ``blocks`` layers, hidden 64, every dropout off, fp32.

    Where the config has per-layer attention kinds with a sliding window, they alternate
    sliding / full so both masks are exercised.
    """
    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    overlay = {**_SIZES, **(_MLA_SIZES if "kv_lora_rank" in known else {})}
    sizes = {**{k: v for k, v in overlay.items() if k in known}, **_type_sizes(model_type, blocks)}
    config = AutoConfig.for_model(model_type, num_hidden_layers=blocks, **sizes)
    kinds = getattr(config, "layer_types", None)
    if kinds and "sliding_attention" in kinds:
        config = AutoConfig.for_model(
            model_type, num_hidden_layers=blocks, **sizes,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(blocks)])
    for name, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    return config


@dataclass(frozen=True)
class ChainResult:
    """Largest absolute differences of a chain of stages against the full model."""

    logits: float
    loss: float
    grads: float
    params_matched: int
    """Parameters of the full model whose gradient was compared (all of them, once)."""


def chain_ranges(blocks: int, stages: int, layer_unit: str = "block") -> list[tuple[int, int]]:
    """Even cuts of the layer sequence into ``stages`` contiguous ranges."""
    total = blocks + 2 if layer_unit == "block" else 2 * blocks + 2
    bounds = [round(i * total / stages) for i in range(stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def attention_for(config: PretrainedConfig) -> str:
    """The builder's default attention (sdpa) where the model offers it, else eager."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    except ValueError:
        return "eager"
    return DEFAULT_ATTN_IMPLEMENTATION


def check_chain(config: PretrainedConfig, ranges: list[tuple[int, int]], layer_unit: str = "block",
                seed: int = 0, unverified: bool = False) -> ChainResult:
    """Run the full model and the chain of stages over ``ranges`` on one batch (with padding).

    ``unverified`` builds types not yet verified (the check that verifies them)."""
    attn = attention_for(config)
    torch.manual_seed(seed)
    full = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    full.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0  # left padding: masks and positions must follow it
    labels = ids.clone()
    labels[0, :3] = -100
    logits_ref = full(input_ids=ids, attention_mask=mask).logits
    loss_ref = causal_lm_loss_sum(logits_ref, labels, config.vocab_size)
    loss_ref.backward()
    stages = [build_stage(config, r, seed=seed, layer_unit=layer_unit, attn_implementation=attn,
                          unverified=unverified) for r in ranges]
    for s in stages:
        s.train()
    x = ids
    for s in stages[:-1]:
        x = s(x, attention_mask=mask)
    logits = stages[-1](x, attention_mask=mask)
    loss = stages[-1].loss_sum(logits, labels)
    loss.backward()
    ref = dict(full.named_parameters())  # a tied head is listed once, as the embedding
    got = _chain_grads(stages)
    if set(got) != set(ref):
        raise AssertionError(f"the chain's parameters differ from the full model's: "
                             f"{sorted(set(got) ^ set(ref))}")
    grads = max(_grad_diff(n, got[n], p.grad) for n, p in ref.items())
    return ChainResult(logits=(logits - logits_ref).abs().max().item(),
                       loss=abs(loss.item() - loss_ref.item()), grads=grads, params_matched=len(got))


def _grad_diff(name: str, got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """Largest difference of one parameter's gradients; a parameter without one (frozen, such as
    a MoE router's score-correction bias) must have none in both."""
    if got is None or ref is None:
        if got is not ref:
            raise AssertionError(f"{name} has a gradient in only one of the chain and the full model")
        return 0.0
    return (got - ref).abs().max().item()


def _chain_grads(stages) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient over the chain (None where it has none); a tied head's gradient
    added to the embedding's, as the runtime sums them."""
    got: dict[str, torch.Tensor | None] = {}
    for s in stages:
        tied = s.tied_parameters()
        for name, p in s.named_parameters():
            if tied and s.is_last and name == s.adapter.output_embedding_key:
                name = s.adapter.input_embedding_key
            if p.grad is None:
                got.setdefault(name, None)
            else:
                got[name] = p.grad.clone() if got.get(name) is None else got[name] + p.grad
    return got
