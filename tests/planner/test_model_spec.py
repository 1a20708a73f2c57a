"""ModelSpec against instantiated tiny transformers models: exact parameter counts per layer."""
from __future__ import annotations

import json

import pytest
import transformers
import yaml

from hapt_hf.planner.model_spec import (BUILTIN_MODELS, ModelSpec, ModelSpecError, model_config)

from benchmarks.inputs import scenario_paths

SCENARIOS = scenario_paths()
SEQ = 32


def _tiny_configs():
    llama_like = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64)
    return {
        "gpt2-tied": transformers.GPT2Config(n_embd=48, n_layer=3, n_head=4, vocab_size=128,
                                             n_positions=64, bos_token_id=0, eos_token_id=0),
        "gpt2-untied": transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=128,
                                               n_positions=64, n_inner=100, bos_token_id=0,
                                               eos_token_id=0, tie_word_embeddings=False),
        "llama-untied": transformers.LlamaConfig(**llama_like, tie_word_embeddings=False),
        "llama-bias": transformers.LlamaConfig(**llama_like, attention_bias=True, mlp_bias=True),
        "mistral": transformers.MistralConfig(**llama_like),
        "mistral-headdim": transformers.MistralConfig(**dict(llama_like, head_dim=32)),
        "qwen2-tied": transformers.Qwen2Config(**llama_like, tie_word_embeddings=True),
        "opt-proj": transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                           num_attention_heads=4, vocab_size=128,
                                           max_position_embeddings=64, word_embed_proj_dim=32,
                                           bos_token_id=0, eos_token_id=0, pad_token_id=1),
        "opt-postnorm": transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=128,
                                               max_position_embeddings=64,
                                               word_embed_proj_dim=64,
                                               do_layer_norm_before=False, bos_token_id=0,
                                               eos_token_id=0, pad_token_id=1),
    }


def _numel(*modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def _parts(model, family):
    """(embedding modules, first decoder block, head modules) of an instantiated model."""
    if family == "gpt2":
        t = model.transformer
        return (t.wte, t.wpe), t.h, (t.ln_f,)
    if family == "opt":
        d = model.model.decoder
        return (d.embed_tokens, d.embed_positions, d.project_in), d.layers, \
            (d.final_layer_norm, d.project_out)
    return (model.model.embed_tokens,), model.model.layers, (model.model.norm,)


def _matmul_weights(block) -> int:
    return sum(p.numel() for p in block.parameters() if p.dim() == 2)


@pytest.mark.parametrize("key", list(_tiny_configs()))
def test_params_match_instantiated_model(key):
    cfg = _tiny_configs()[key]
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = ModelSpec.from_config(cfg, seq_len=SEQ)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    embed, blocks, head = _parts(model, cfg.model_type)
    assert spec.layers[0].params == _numel(*embed)
    assert [l.params for l in spec.layers[1:-1]] == [_numel(b) for b in blocks]
    lm_head = 0 if cfg.tie_word_embeddings else model.lm_head.weight.numel()
    assert spec.layers[-1].params == _numel(*head) + lm_head
    assert spec.num_layers == cfg.num_hidden_layers + 2
    assert spec.tied_embeddings == bool(cfg.tie_word_embeddings)


@pytest.mark.parametrize("key", list(_tiny_configs()))
def test_flops_and_activation_conventions(key):
    cfg = _tiny_configs()[key]
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = ModelSpec.from_config(cfg, seq_len=SEQ, dtype="bf16")
    _, blocks, _ = _parts(model, cfg.model_type)
    attn_width = spec.num_heads * (getattr(cfg, "head_dim", None)
                                   or spec.hidden_size // spec.num_heads)
    block = spec.layers[1]
    matmul = _matmul_weights(blocks[0])
    # sdpa (the default): causal kernels compute half the score square, recompute it backward
    assert block.fwd_flops == 2 * SEQ * matmul + 2 * SEQ**2 * attn_width
    assert block.bwd_flops == 4 * SEQ * matmul + 5 * SEQ**2 * attn_width
    eager = ModelSpec.from_config(cfg, seq_len=SEQ, dtype="bf16", attn_implementation="eager")
    assert eager.layers[1].fwd_flops == 2 * SEQ * matmul + 4 * SEQ**2 * attn_width
    head = spec.layers[-1]
    proj = getattr(cfg, "word_embed_proj_dim", spec.hidden_size)
    assert head.fwd_flops >= 2 * SEQ * spec.vocab_size * proj  # vocab projection even if tied
    for layer in (*spec.layers[::spec.num_layers - 1], *eager.layers):
        assert layer.bwd_flops == 2 * layer.fwd_flops
    # sent on in the compute dtype; the loss's log-softmax is fp32 whatever it is
    hidden_bytes = SEQ * spec.hidden_size * 2
    assert [l.act_out_bytes for l in spec.layers] == [hidden_bytes] * (spec.num_layers - 1) + [0]
    assert head.act_keep_bytes >= SEQ * spec.vocab_size * 4
    # autocast keeps a 16-bit copy of every matmul weight per micro-batch
    assert block.act_keep_fixed_bytes == 2 * matmul
    assert len({l.signature for l in spec.layers[1:-1]}) == 1
    assert len({l.signature for l in spec.layers}) == 3


def test_block_memory_reduces_to_korthikanti_for_gpt():
    # the paper counts 34*s*h + 5*a*s**2 bytes with every tensor at 2 bytes and 1-byte dropout
    # masks; in fp32 the same tensors take 4 bytes (masks stay 1 byte): 66*s*h + 9*a*s**2.
    # It assumes a fused GeLU; transformers' default "gelu_new" keeps 3 more tensors.
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  activation_function="gelu")
    s, h, a = 128, 64, 4
    eager = ModelSpec.from_config(cfg, seq_len=s, dtype="fp32", attn_implementation="eager")
    assert eager.layers[1].act_keep_bytes == 66 * s * h + 9 * a * s * s
    fused = ModelSpec.from_config(cfg, seq_len=s, dtype="fp32")
    assert fused.layers[1].act_keep_bytes == 66 * s * h + 4 * a * s  # log-sum-exp per row


def test_attention_implementation_sets_what_a_block_keeps():
    cfg = model_config("llama-tiny")
    for s in (64, 512):
        eager = ModelSpec.from_config(cfg, s, attn_implementation="eager").layers[1]
        sdpa = ModelSpec.from_config(cfg, s, attn_implementation="sdpa").layers[1]
        # eager keeps the fp32 probabilities of every head and the GQA copies of K and V
        grouped = 2 * 4 * s * (4 * 16 - 2 * 16)
        assert eager.act_keep_bytes - sdpa.act_keep_bytes == 4 * 4 * s * s + grouped - 4 * 4 * s
        assert eager.signature == sdpa.signature + ":eager"
    with pytest.raises(ModelSpecError, match="attn_implementation 'flash'.*eager, sdpa"):
        ModelSpec.from_config(cfg, 64, attn_implementation="flash")


def test_builtin_names_match_published_sizes():
    # parameter counts as published on the models' cards
    assert ModelSpec.from_name_or_path("gpt2", 1024).total_params == 124_439_808
    assert ModelSpec.from_name_or_path("llama-2-7b", 4096).total_params == 6_738_415_616
    assert ModelSpec.from_name_or_path("facebook/opt-350m", 2048).total_params == 331_196_416


@pytest.mark.parametrize("name", [n for n in BUILTIN_MODELS if n.endswith("-tiny")])
def test_builtin_tiny_models_instantiate_with_same_count(name):
    model = transformers.AutoModelForCausalLM.from_config(model_config(name))
    spec = ModelSpec.from_name_or_path(name, 64)
    assert spec.total_params == sum(p.numel() for p in model.parameters())


def test_local_config_directory(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    from_dir = ModelSpec.from_name_or_path(str(tmp_path), 16)
    from_file = ModelSpec.from_name_or_path(str(tmp_path / "config.json"), 16)
    assert from_dir.layers == ModelSpec.from_config(cfg, 16).layers == from_file.layers


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_job_builds(path):
    job = yaml.safe_load(open(path))["job"]
    spec = ModelSpec.from_job_dict(job["model"], job["seq_len"], job["dtype"])
    assert spec.num_blocks == job["model"]["num_layers"]
    assert spec.num_layers == job["model"]["num_layers"] + 2
    assert spec.hidden_size == job["model"]["hidden_size"]
    assert spec.profile_name == job["model"].get("profile_name")
    assert spec.dtype == job["dtype"] and spec.seq_len == job["seq_len"]


def test_llama_70b_job_has_published_size():
    job = dict(family="llama", hidden_size=8192, intermediate_size=28672, num_layers=80,
               num_heads=64, num_kv_heads=8, vocab_size=128256)
    spec = ModelSpec.from_job_dict(job, 4096, "bf16")
    assert spec.total_params == 70_553_706_496  # Llama-3-70B model card
    assert spec.layers[1].signature == "llama:h8192:i28672:a64:kv8:s4096:bf16"


def test_unsupported_family_lists_supported():
    with pytest.raises(ModelSpecError, match="'bert'.*gpt2, llama, mistral, qwen2, opt"):
        ModelSpec.from_config(transformers.BertConfig(), seq_len=16)
    with pytest.raises(ModelSpecError, match="family 'falcon'"):
        ModelSpec.from_job_dict(dict(family="falcon", hidden_size=64, num_layers=2,
                                     num_heads=4, vocab_size=100), 16, "fp32")


@pytest.mark.parametrize("call, match", [
    (lambda: ModelSpec.from_name_or_path("meta-llama/NotAModel", 16), "config.json"),
    (lambda: ModelSpec.from_name_or_path("gpt2", 4096), "n_positions|position table"),
    (lambda: ModelSpec.from_name_or_path("gpt2", 16, dtype="fp8"), "dtype 'fp8'"),
    (lambda: ModelSpec.from_name_or_path("gpt2", 0), "seq_len"),
    (lambda: ModelSpec.from_job_dict(dict(family="gpt2", hidden_size=64, num_layer=2,
                                          num_heads=4, vocab_size=10), 16, "fp32"),
     "unknown key.*num_layer"),
    (lambda: ModelSpec.from_job_dict(dict(family="gpt2", hidden_size=64, num_layers=2,
                                          num_heads=4), 16, "fp32"), "missing.*vocab_size"),
    (lambda: ModelSpec.from_job_dict(dict(family="llama", hidden_size=-1, num_layers=2,
                                          num_heads=4, vocab_size=10), 16, "fp32"),
     "hidden_size must be a positive integer"),
])
def test_bad_input_names_the_field(call, match):
    with pytest.raises(ModelSpecError, match=match):
        call()


def test_bad_local_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ModelSpecError, match="model_type"):
        ModelSpec.from_name_or_path(str(bad), 16)


def test_from_config_takes_a_name_too():
    assert ModelSpec.from_config("llama-tiny", 16) == ModelSpec.from_name_or_path("llama-tiny", 16)
