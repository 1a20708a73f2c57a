"""Model configs the planner can describe: built-in names, local config.json, ``job:`` mappings.

Every reader returns a transformers ``PretrainedConfig`` (no weights, never a download);
:class:`~hapt_hf.planner.model_spec.ModelSpec` turns one into the layer sequence. transformers
is imported inside the functions that build configs, so importing the planner stays light.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hapt_hf.core.families import SUPPORTED_MODEL_TYPES, accepted_model_types, generic_refusal
from hapt_hf.errors import ModelSpecError, UnsupportedModel

__all__ = ["BUILTIN_MODELS", "HUB_ALIASES", "PROFILE_NAMES", "model_config",
           "config_from_job_dict"]

_TINY_LLAMA = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                   max_position_embeddings=256)
BUILTIN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # GPT-2 sizes as published by OpenAI; "gpt2" is transformers.GPT2Config()'s defaults
    "gpt2": ("gpt2", {}),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25)),
    "opt-125m": ("opt", dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                             num_attention_heads=12, vocab_size=50272,
                             max_position_embeddings=2048, word_embed_proj_dim=768)),
    "opt-350m": ("opt", dict(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
                             num_attention_heads=16, vocab_size=50272,
                             max_position_embeddings=2048, word_embed_proj_dim=512,
                             do_layer_norm_before=False)),
    "tinyllama-1.1b": ("llama", dict(hidden_size=2048, intermediate_size=5632,
                                     num_hidden_layers=22, num_attention_heads=32,
                                     num_key_value_heads=4, vocab_size=32000,
                                     max_position_embeddings=2048)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32,
                                 vocab_size=32000, max_position_embeddings=4096)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8,
                                 vocab_size=128256, max_position_embeddings=8192)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=32000)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2,
                                 vocab_size=151936, tie_word_embeddings=True)),
    # tiny models for CPU tests and demos
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, vocab_size=1000, n_positions=256,
                               bos_token_id=0, eos_token_id=0)),
    "llama-tiny": ("llama", dict(_TINY_LLAMA, tie_word_embeddings=False)),
    "mistral-tiny": ("mistral", dict(_TINY_LLAMA)),
    "qwen2-tiny": ("qwen2", dict(_TINY_LLAMA)),
    "opt-tiny": ("opt", dict(hidden_size=64, ffn_dim=256, num_hidden_layers=4,
                             num_attention_heads=4, vocab_size=1000, max_position_embeddings=256,
                             word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0,
                             pad_token_id=1)),
}
HUB_ALIASES = {"openai-community/gpt2": "gpt2", "openai-community/gpt2-medium": "gpt2-medium",
                "openai-community/gpt2-large": "gpt2-large", "openai-community/gpt2-xl": "gpt2-xl",
                "facebook/opt-125m": "opt-125m", "facebook/opt-350m": "opt-350m",
                "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": "tinyllama-1.1b",
                "meta-llama/Llama-2-7b-hf": "llama-2-7b",
                "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
                "mistralai/Mistral-7B-v0.1": "mistral-7b", "Qwen/Qwen2-0.5B": "qwen2-0.5b"}

# built-in models that published measurements (hapt_hf/data/profiles) know by another name
PROFILE_NAMES = {"opt-350m": "OPT-350"}


def _config_class(family: str, generic: bool = False):
    """The config class of a hand-formula family, or (``generic``: a config.json) of any
    accepted type; a job's ``model:`` mapping names its fields for the hand-formula families."""
    import transformers

    classes = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig,
               "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
               "opt": transformers.OPTConfig}
    if family in classes:
        return classes[family]
    if generic and family in accepted_model_types():  # a verified type: transformers' own class
        return transformers.AutoConfig.for_model(family).__class__
    if generic:  # a config.json of a type the matrix knows: its status says why
        raise UnsupportedModel(generic_refusal(family))
    raise UnsupportedModel(f"model family {family!r} is not supported; supported: the families "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)} and the verified types of "
                           f"docs/models.md")


def model_config(name_or_path: str | Path):
    """A transformers config for a local config.json (or a directory holding one) or a built-in
    name; never downloads. Built-in names: ``BUILTIN_MODELS`` (plus a few hub aliases)."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return _config_from_json(path)
    key = HUB_ALIASES.get(str(name_or_path), str(name_or_path))
    if key in BUILTIN_MODELS:
        family, kwargs = BUILTIN_MODELS[key]
        return _config_class(family)(**kwargs)
    raise ModelSpecError(
        f"model {str(name_or_path)!r} is neither a local config nor a built-in model; pass a local "
        f"directory holding config.json (no downloads are made), or one of: "
        f"{', '.join(BUILTIN_MODELS)}")


def _config_from_json(path: Path):
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"model config {path} is not readable JSON ({e}); "
                             f"pass a Hugging Face config.json") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ModelSpecError(f"model config {path} has no 'model_type'; pass a Hugging Face "
                             f"config.json (model_type one of {', '.join(SUPPORTED_MODEL_TYPES)})")
    family = d.pop("model_type")
    return _config_class(family, generic=True)(**d)


_JOB_KEYS = {"family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
             "intermediate_size", "max_position_embeddings", "tie_word_embeddings",
             "word_embed_proj_dim", "head_dim", "profile_name", "name"}
_JOB_REQUIRED = ("family", "hidden_size", "num_layers", "num_heads", "vocab_size")


def config_from_job_dict(d: dict, seq_len: int):
    if not isinstance(d, dict):
        raise ModelSpecError(f"job.model must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - _JOB_KEYS)
    if unknown:
        raise ModelSpecError(f"job.model has unknown key(s) {unknown}; known keys: "
                             f"{', '.join(sorted(_JOB_KEYS))}")
    missing = [k for k in _JOB_REQUIRED if k not in d]
    if missing:
        raise ModelSpecError(f"job.model is missing {missing}; add them (required: "
                             f"{', '.join(_JOB_REQUIRED)})")
    for k in ("hidden_size", "num_layers", "num_heads", "vocab_size", "intermediate_size",
              "num_kv_heads", "max_position_embeddings", "word_embed_proj_dim", "head_dim"):
        if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 1):
            raise ModelSpecError(f"job.model.{k} must be a positive integer, got {d[k]!r}")
    family, h = d["family"], d["hidden_size"]
    if h % d["num_heads"] and "head_dim" not in d:
        raise ModelSpecError(f"job.model.hidden_size {h} is not divisible by num_heads "
                             f"{d['num_heads']}; fix one of them or give head_dim")
    cls = _config_class(family)
    positions = d.get("max_position_embeddings", seq_len)
    if family == "gpt2":
        # GPT-2's special-token id (50256) lies outside a smaller vocabulary; the planner needs
        # no special tokens, so keep them inside it rather than have transformers warn.
        special = min(50256, int(d["vocab_size"]) - 1)
        return cls(n_embd=h, n_layer=d["num_layers"], n_head=d["num_heads"],
                   vocab_size=d["vocab_size"], n_positions=positions,
                   bos_token_id=special, eos_token_id=special,
                   n_inner=d.get("intermediate_size"),
                   tie_word_embeddings=d.get("tie_word_embeddings", True))
    if family == "opt":
        return cls(hidden_size=h, ffn_dim=d.get("intermediate_size", 4 * h),
                   num_hidden_layers=d["num_layers"], num_attention_heads=d["num_heads"],
                   vocab_size=d["vocab_size"], max_position_embeddings=positions,
                   word_embed_proj_dim=d.get("word_embed_proj_dim", h),
                   tie_word_embeddings=d.get("tie_word_embeddings", True))
    # LLaMA's SwiGLU width rule when none is given: 2/3 of 4h, rounded up to a multiple of 256
    inter = d.get("intermediate_size", -(-(8 * h // 3) // 256) * 256)
    extra = {"head_dim": d["head_dim"]} if "head_dim" in d else {}
    return cls(hidden_size=h, intermediate_size=inter, num_hidden_layers=d["num_layers"],
               num_attention_heads=d["num_heads"],
               num_key_value_heads=d.get("num_kv_heads", d["num_heads"]),
               vocab_size=d["vocab_size"], max_position_embeddings=positions,
               tie_word_embeddings=d.get("tie_word_embeddings", False), **extra)
