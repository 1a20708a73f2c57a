"""Per-layer figures read off a causal LM itself (built on the meta device, no weights, no compute).

The first piece of a ModelSpec for model types without a hand formula in
:mod:`hapt_hf.planner.model_spec`: exact parameters per layer of ``[embedding, blocks.., head]``
and forward / backward FLOPs per sample counted by ``FlopCounterMode`` over one meta forward at
``seq_len``. The score and context matmuls (``aten.bmm``, counted as the whole s x s square)
follow the planner's convention: eager attention as counted, backward 2x; sdpa's causal kernels
half of it forward and 5/4 of it backward (they recompute the scores). Everything else:
backward = 2x forward. Activation bytes are not read yet, so this is not wired into the planner.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from hapt_hf.pipeline.generic import generic_adapter

__all__ = ["LayerCount", "read_layer_counts"]

_ATTN_OPS = ("aten.bmm",)


@dataclass(frozen=True)
class LayerCount:
    """One layer's figures per sample (one sequence of ``seq_len`` tokens)."""

    params: int
    """Parameters this layer owns (a tied head owns none of the embedding matrix)."""
    fwd_flops: float
    bwd_flops: float


def read_layer_counts(config: PretrainedConfig, seq_len: int,
                      attn_implementation: str = "sdpa") -> list[LayerCount]:
    """``[embedding, block_0 .. block_{N-1}, head]`` read off the model built on meta."""
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    adapter = generic_adapter(full)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():  # inputs_embeds: the id-based checks read token values
        full(inputs_embeds=torch.zeros(1, seq_len, config.hidden_size, device="meta"))
    counts = {k.partition(".")[2]: v for k, v in counter.get_flop_counts().items()}
    n = len(full.get_submodule(adapter.blocks_path))
    blocks = [f"{adapter.blocks_path}.{i}" for i in range(n)]
    groups = [list(adapter.embedding_paths), *([b] for b in blocks), list(adapter.head_paths)]
    seen: set[int] = set()
    out = []
    for paths in groups:
        params = 0
        for path in paths:
            for p in full.get_submodule(path).parameters():
                if id(p) not in seen:  # a tied head's matrix is the embedding's
                    seen.add(id(p))
                    params += p.numel()
        out.append(_count(params, [counts.get(p, {}) for p in paths], attn_implementation))
    return out


def _count(params: int, per_module: list[dict], attn_implementation: str) -> LayerCount:
    attn = sum(v for ops in per_module for op, v in ops.items() if str(op) in _ATTN_OPS)
    dense = sum(v for ops in per_module for v in ops.values()) - attn
    if attn_implementation == "eager":
        return LayerCount(params, float(dense + attn), float(2 * (dense + attn)))
    return LayerCount(params, dense + attn / 2, 2 * dense + attn * 5 / 4)
