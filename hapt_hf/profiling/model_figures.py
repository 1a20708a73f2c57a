"""The one way in to a model's figures: :func:`model_spec` (``hapt_hf.model_spec``).

:func:`model_spec` reads every accepted model type's figures off the model itself with the
measuring reader (:class:`MeasuringReader`: :func:`~hapt_hf.profiling.model_reader.read_model`
and :func:`choose_attention`), so the same config gives the same ModelSpec whatever ran before
in the process. ``hapt-hf plan``, ``simulate``, ``profile`` and the launch path pass the same
reader to :meth:`~hapt_hf.planner.model_spec.ModelSpec.from_config`; the planner's own
``ModelSpec.from_config(config)`` without a reader is the torch-free hand formula of gpt2,
llama, mistral, qwen2 and opt.

:func:`choose_attention` is where the attention is chosen when a job names none: sdpa where the
model's class supports it, else eager. Every side that needs the choice (a ModelSpec read from
a config, the launch path, the CLI, the profiler) takes it from here; the plan then carries it
(``Plan.attn_implementation``), and the runtime builds its stages with the plan's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hapt_hf.compat.transformers_api import supports_sdpa
from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.core.layers import BLOCK, HALF
from hapt_hf.errors import ModelSpecError
from hapt_hf.planner.model_spec import AS_ASKED, MODELS_BEST, ModelSpec, ReadModel

__all__ = ["model_spec", "choose_attention", "MeasuringReader"]

FALLBACK_ATTENTION = "eager"
"""What every model runs: the choice where its class does not support sdpa."""


def choose_attention(config: Any, asked: str | None = None) -> tuple[str, str]:
    """``(attn_implementation, why)`` for ``config``: ``asked`` where the model runs it; where
    ``asked`` is None, the model's best: sdpa where the model's class supports it, else eager.

    An ``asked`` the model cannot run is refused, naming it and the model's best.
    """
    if asked is not None and asked not in ATTN_IMPLEMENTATIONS:
        raise ModelSpecError(f"attn_implementation {asked!r} is not known; use one of "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    model_type = getattr(config, "model_type", None)
    sdpa = supports_sdpa(config)
    if asked is None:
        if sdpa:
            return DEFAULT_ATTN_IMPLEMENTATION, MODELS_BEST
        return FALLBACK_ATTENTION, (f"{model_type} does not support "
                                    f"{DEFAULT_ATTN_IMPLEMENTATION}; {MODELS_BEST}")
    if asked == DEFAULT_ATTN_IMPLEMENTATION and not sdpa:
        raise ModelSpecError(
            f"attn_implementation {asked!r}: model type {model_type!r} does not support it; "
            f"set attn_implementation to {FALLBACK_ATTENTION!r} or leave it out (the model's "
            f"best: {FALLBACK_ATTENTION})")
    return asked, AS_ASKED


@dataclass(frozen=True)
class MeasuringReader:
    """The reader :meth:`ModelSpec.from_config` takes to read every accepted type's figures off
    the model (parameters and FLOPs on the meta device, kept bytes on fake tensors) and to
    choose its attention (:func:`choose_attention`)."""

    def attention(self, config: Any, asked: str | None) -> tuple[str, str]:
        return choose_attention(config, asked)

    def read(self, config: Any, seq_len: int, dtype: str,
             attn_implementation: str) -> ReadModel:
        from .model_reader import read_model  # torch and the model classes, when first read
        return read_model(config, seq_len, dtype, attn_implementation)


def model_spec(config_or_name: Any, seq_len: int, dtype: str = "fp32",
               attn_implementation: str | None = None, layer_unit: str = BLOCK) -> ModelSpec:
    """The ModelSpec of a model, read off the model itself, for any accepted model type.

    Args:
        config_or_name: a transformers ``PretrainedConfig``, a local config.json (or a
            directory holding one), a built-in name (``hapt_hf.planner.model_spec.
            BUILTIN_MODELS``) or a ``job: model:`` mapping. Nothing is downloaded.
        seq_len: tokens per sample the per-layer figures are for.
        dtype: the compute dtype ('fp32', 'bf16', 'fp16'; weights and optimizer state stay fp32).
        attn_implementation: 'sdpa' or 'eager'; None: the model's best (sdpa where the model's
            class supports it, else eager). One the model cannot run is refused.
        layer_unit: 'block' (``[embedding, blocks.., head]``) or 'half' (every block cut into
            its attention and MLP halves, where the model's blocks can be).
    """
    if layer_unit not in (BLOCK, HALF):
        raise ModelSpecError(f"layer_unit {layer_unit!r} is not known; use {BLOCK!r} or "
                             f"{HALF!r}")
    reader = MeasuringReader()
    if isinstance(config_or_name, (dict, str, Path)):
        spec = ModelSpec.from_job_model(config_or_name, seq_len, dtype, attn_implementation,
                                        reader)
    else:
        spec = ModelSpec.from_config(config_or_name, seq_len, dtype,
                                     attn_implementation=attn_implementation, reader=reader)
    return spec.with_layer_unit(layer_unit)
