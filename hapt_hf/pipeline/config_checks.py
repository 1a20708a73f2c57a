"""Config settings that no chain of stages reproduces: the reasons the stage builder refuses them.

Read off the config alone (and, for recurrence, the base model's forward signature), before any
model is built: encoder-decoder models, recurrent or other non-attention layers, the router's
auxiliary loss, layer drop, and layers that read more than the hidden state from earlier ones;
and the tensor-parallel degrees a config's heads and MLP width do not allow.
"""
from __future__ import annotations

import inspect

from transformers import PretrainedConfig

from hapt_hf.core.tp import tp_refusal

__all__ = ["recurrent_refusal", "refusal", "tp_size_refusal"]


def refusal(config: PretrainedConfig) -> str | None:
    """Why this config's settings cannot be cut into stages exactly, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return (f"{config.model_type!r} is an encoder-decoder model (config.is_encoder_decoder); only "
                "decoder-only causal LMs can be cut into pipeline stages")
    problem = recurrent_refusal(config)
    if problem is not None:
        return problem
    if getattr(config, "output_router_logits", False):
        return ("config.output_router_logits is True: the router's auxiliary loss is a non-linear "
                "function of every layer's routing over the whole batch, which pipeline stages and "
                "micro-batches cannot reproduce; set config.output_router_logits = False")
    if getattr(config, "layerdrop", 0.0):
        return (f"config.layerdrop is {config.layerdrop}; skipping random blocks cannot be split "
                "across stages: set config.layerdrop = 0.0")
    return _side_stream_refusal(config)


def _side_stream_refusal(config: PretrainedConfig) -> str | None:
    """Why layers read more than the hidden state from earlier ones (which stages do not pass
    on), or None."""
    per_layer = getattr(config, "hidden_size_per_layer_input", 0)
    if per_layer:
        return (f"config.hidden_size_per_layer_input is {per_layer}: every layer also reads its "
                "own embedding of the input ids, a second stream beside the hidden state that "
                "pipeline stages do not carry; only configs without per-layer inputs "
                "(hidden_size_per_layer_input 0) are cut")
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared:
        return (f"config.num_kv_shared_layers is {shared}: the last layers reuse the keys and "
                "values of earlier layers, which pipeline stages do not pass on; only configs "
                "with num_kv_shared_layers 0 are cut")
    return None


def recurrent_refusal(config: PretrainedConfig) -> str | None:
    """Why this config's layers are not all attention layers (recurrent, convolutional or other
    per-layer kinds), or None."""
    # a multimodal wrapper keeps its layer kinds in its text config
    text = getattr(config, "text_config", None) or config
    kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return (f"config.layer_types holds {sorted(kinds)}: only full and sliding-window attention "
                "layers are cut (layers with recurrent or other per-layer state are not)")
    state = _recurrent_state_argument(getattr(config, "model_type", ""))
    if state is not None:
        return (f"the base model's forward carries a recurrent state ({state!r}) instead of a KV "
                "cache: only full and sliding-window attention layers are cut (layers with "
                "recurrent or other per-layer state are not)")
    return None


def _recurrent_state_argument(model_type: str) -> str | None:
    """The argument through which the type's base model passes a recurrent state (Mamba's
    ``cache_params``, RWKV's ``state``), or None. Models whose config names no layer kinds
    (RWKV, xLSTM) show their recurrence only there."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    cls = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type, ""), None)
    try:
        params = inspect.signature(cls.forward).parameters if cls is not None else {}
    except (TypeError, ValueError):
        return None
    return next((p for p in ("cache_params", "state") if p in params), None)


def tp_size_refusal(config: PretrainedConfig, t: int) -> str | None:
    """Why ``t``-way tensor parallelism cannot split this model's blocks (``t`` does not divide
    its attention heads, key/value heads or MLP width), or None."""
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    kv = getattr(text, "num_key_value_heads", None)
    width = getattr(text, "intermediate_size", None) or 4 * int(text.hidden_size)
    return tp_refusal(t, heads, None if kv is None else int(kv), int(width))
