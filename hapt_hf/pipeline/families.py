"""Family adapters: where each causal-LM family shape keeps its layers and how a stage runs them.

One adapter per family SHAPE, not per model: "gpt2" (GPT2LMHeadModel), "llama" (LlamaForCausalLM
and the models laid out like it: Mistral, Qwen2) and "opt" (OPTForCausalLM). An adapter names the
module paths of the layer sequence `[embedding, block_0 .. block_{N-1}, head]` inside the full
Hugging Face model, and runs the family's own transformers modules exactly as the full model's
forward does (same causal mask builder, same position ids, same rotary embedding), so a chain of
stages reproduces the full model's numerics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig
from transformers.activations import ACT2FN

from hapt_hf.compat.transformers_api import SLIDING_ATTENTION, attention_mask as build_mask
from hapt_hf.core.families import family

__all__ = ["BlockInputs", "FamilyAdapter", "adapter_for", "num_blocks", "supported_families"]


@dataclass(frozen=True)
class BlockInputs:
    """What every block of a stage needs besides the hidden states, computed once per forward.

    Args:
        position_ids: [1 or b, s] positions, as the full model derives them.
        masks: attention mask per attention kind ("full_attention", "sliding_attention"), in the
            form the configured attention implementation expects (None where it needs none).
        position_embeddings: (cos, sin) from the rotary module, or None for families without RoPE.
    """

    position_ids: Tensor
    masks: dict[str, Tensor | None]
    position_embeddings: tuple[Tensor, Tensor] | None


@dataclass(frozen=True)
class FamilyAdapter:
    """Where a family keeps its layers inside the full model, and how to call them.

    Subclasses override what differs between family shapes: the embedding, position ids and
    the mask rule. Paths of modules a config may leave out (OPT's projections) are skipped.

    Args:
        name: the family shape ("gpt2", "llama", "opt").
        model_types: the `config.model_type` values built with this shape.
        embedding_paths: modules the first stage owns (token and position embeddings, dropout).
        blocks_path: the ModuleList of transformer blocks.
        head_paths: modules the last stage owns, applied in order (final norm, ..., LM head).
        rotary_path: the rotary embedding module every block stage needs, or None.
        input_embedding_key / output_embedding_key: state_dict keys of the two ends that
            `tie_word_embeddings` ties.
    """

    name: str
    model_types: tuple[str, ...]
    embedding_paths: tuple[str, ...]
    blocks_path: str
    head_paths: tuple[str, ...]
    rotary_path: str | None
    input_embedding_key: str
    output_embedding_key: str
    attention_half: tuple[str, str] | None = None
    """(norm, attention) submodule names of a block: its first half when blocks are cut in two;
    None where the family's block cannot be cut exactly."""
    mlp_half: tuple[str, ...] | None = None
    """Submodule names of a block's second half: its norm, then the MLP's module(s)."""
    half_refusal: str = ""
    """Why a block cannot be cut in two ("" where it can)."""

    def position_ids(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Position ids when the caller gives none. GPT2Model and LlamaModel use a plain arange
        (padding does not shift positions), broadcast over the batch."""
        del attention_mask
        return torch.arange(x.shape[1], device=x.device).unsqueeze(0)

    def embed(self, root: nn.Module, input_ids: Tensor, position_ids: Tensor,
              attention_mask: Tensor | None) -> Tensor:
        """The first stage's embedding, as the full model's forward computes it."""
        return root.get_submodule(self.embedding_paths[0])(input_ids)

    def attention_kind(self, config: PretrainedConfig, block_index: int) -> str:
        """Which mask block `block_index` attends with, following the full model's own rule."""
        return "full_attention"

    def mask_position_ids(self, position_ids: Tensor) -> Tensor | None:
        """The position ids the full model hands its mask builder."""
        return position_ids

    def block_inputs(self, root: nn.Module, config: PretrainedConfig, hidden: Tensor,
                     attention_mask: Tensor | None, position_ids: Tensor,
                     block_indices: "range | list[int]") -> BlockInputs:
        """Masks and rotary embeddings for this stage's blocks (the same calls the full model makes)."""
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        kinds = {self.attention_kind(config, i) for i in block_indices}
        # The full model builds its mask with the (empty) KV cache it creates when config.use_cache
        # is on; the cache's presence decides, for one, whether position ids that restart mark
        # packed sequences. Pass the same so the masks agree; blocks never see the cache.
        cache = DynamicCache(config=config) if getattr(config, "use_cache", False) else None
        mask_positions = self.mask_position_ids(position_ids)
        masks = {kind: build_mask(kind, config=config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, past_key_values=cache,
                                  position_ids=mask_positions) for kind in kinds}
        rope = None
        if self.rotary_path is not None:
            rope = root.get_submodule(self.rotary_path)(hidden, position_ids=position_ids)
        return BlockInputs(position_ids=position_ids, masks=masks, position_embeddings=rope)

    def run_block(self, block: nn.Module, hidden: Tensor, inputs: BlockInputs, mask_kind: str) -> Tensor:
        """One block's forward with the arguments the full model passes it (no KV cache: the
        cache argument is left at its default, None, under either of its names)."""
        kwargs: dict[str, Any] = {"attention_mask": inputs.masks[mask_kind],
                                  "position_ids": inputs.position_ids, "use_cache": False}
        if inputs.position_embeddings is not None:
            kwargs["position_embeddings"] = inputs.position_embeddings
        return block(hidden, **kwargs)

    def run_attention_half(self, block: nn.Module, hidden: Tensor, inputs: BlockInputs,
                           mask_kind: str, config: PretrainedConfig) -> Tensor:
        """The block's forward up to and including the attention residual, with the very calls
        and arguments the block's own forward makes (GPT2Block, LlamaDecoderLayer). ``block``
        holds only this half's submodules; ``config`` gives what the block read off it."""
        norm, attn = (getattr(block, name) for name in self.attention_half)
        kwargs: dict[str, Any] = {"attention_mask": inputs.masks[mask_kind],
                                  "position_ids": inputs.position_ids, "use_cache": False}
        if inputs.position_embeddings is not None:
            kwargs["position_embeddings"] = inputs.position_embeddings
        attn_output, _ = attn(norm(hidden), **kwargs)
        return hidden + attn_output

    def run_mlp_half(self, block: nn.Module, hidden: Tensor, config: PretrainedConfig) -> Tensor:
        """The rest of the block's forward: norm, MLP, residual."""
        norm, mlp = (getattr(block, name) for name in self.mlp_half)
        return hidden + mlp(norm(hidden))

    def head(self, root: nn.Module, hidden: Tensor) -> Tensor:
        """Final norm (and any projection) then LM head: the logits."""
        for path in self.head_paths:
            if _has(root, path):
                hidden = root.get_submodule(path)(hidden)
        return hidden

    def check_config(self, config: PretrainedConfig) -> str | None:
        """Why this config cannot be cut into stages exactly, or None."""
        return None


@dataclass(frozen=True)
class _Gpt2Adapter(FamilyAdapter):
    def embed(self, root, input_ids, position_ids, attention_mask):
        wte, wpe, drop = (root.get_submodule(p) for p in self.embedding_paths)
        hidden = wte(input_ids)
        return drop(hidden + wpe(position_ids).to(hidden.device))


@dataclass(frozen=True)
class _LlamaAdapter(FamilyAdapter):
    def attention_kind(self, config, block_index):
        layer_types = getattr(config, "layer_types", None)
        if layer_types:  # Qwen2: per-layer kinds
            return layer_types[block_index]
        # Mistral: one sliding window for every layer when the config sets one; LLaMA: none.
        return SLIDING_ATTENTION if getattr(config, "sliding_window", None) is not None else "full_attention"


@dataclass(frozen=True)
class _OptAdapter(FamilyAdapter):
    def position_ids(self, x, attention_mask):
        # OPTDecoder counts positions over the padding mask (left padding shifts them).
        mask = _position_mask(x, attention_mask)
        return (torch.cumsum(mask, dim=1) * mask - 1).long()

    def embed(self, root, input_ids, position_ids, attention_mask):
        hidden = root.get_submodule(self.embedding_paths[0])(input_ids)
        positions = root.get_submodule(self.embedding_paths[1])(
            _position_mask(input_ids, attention_mask), 0, position_ids=position_ids)
        if _has(root, self.embedding_paths[2]):
            hidden = root.get_submodule(self.embedding_paths[2])(hidden)
        return hidden + positions.to(hidden.device)

    def mask_position_ids(self, position_ids):
        return None  # OPTDecoder builds its causal mask without position ids

    # OPTDecoderLayer's forward, cut after its attention residual. Pre-norm blocks (every OPT
    # size but 350m) norm each half's input; post-norm blocks (do_layer_norm_before False) norm
    # each half's residual sum, so the cut still falls between two complete residual steps.
    def run_attention_half(self, block, hidden, inputs, mask_kind, config):
        norm, attn = (getattr(block, name) for name in self.attention_half)
        pre = config.do_layer_norm_before
        out, _ = attn(hidden_states=norm(hidden) if pre else hidden,
                      position_ids=inputs.position_ids, attention_mask=inputs.masks[mask_kind])
        hidden = hidden + nn.functional.dropout(out, p=config.dropout, training=block.training)
        return hidden if pre else norm(hidden)

    def run_mlp_half(self, block, hidden, config):
        norm, fc1, fc2 = (getattr(block, name) for name in self.mlp_half)
        pre = config.do_layer_norm_before
        shape = hidden.shape
        residual = hidden.reshape(-1, hidden.size(-1))  # the block's fc layers run on 2-D rows
        out = fc2(ACT2FN[config.activation_function](fc1(norm(residual) if pre else residual)))
        out = nn.functional.dropout(out, p=config.dropout, training=block.training)
        hidden = (residual + out).view(shape)
        return hidden if pre else norm(hidden)

    def check_config(self, config):
        if getattr(config, "layerdrop", 0.0) > 0.0:
            return (f"config.layerdrop is {config.layerdrop}; skipping random blocks cannot be "
                    "split across stages: set config.layerdrop = 0.0")
        return None


def _position_mask(x: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return torch.ones(x.shape[0], x.shape[1], device=x.device)
    return attention_mask


_ADAPTERS: tuple[FamilyAdapter, ...] = (
    _Gpt2Adapter(
        name="gpt2", model_types=family("gpt2").model_types,
        embedding_paths=("transformer.wte", "transformer.wpe", "transformer.drop"),
        blocks_path="transformer.h", head_paths=("transformer.ln_f", "lm_head"), rotary_path=None,
        input_embedding_key="transformer.wte.weight", output_embedding_key="lm_head.weight",
        attention_half=("ln_1", "attn"), mlp_half=("ln_2", "mlp")),
    _LlamaAdapter(
        name="llama", model_types=family("llama").model_types,
        embedding_paths=("model.embed_tokens",),
        blocks_path="model.layers", head_paths=("model.norm", "lm_head"), rotary_path="model.rotary_emb",
        input_embedding_key="model.embed_tokens.weight", output_embedding_key="lm_head.weight",
        attention_half=("input_layernorm", "self_attn"), mlp_half=("post_attention_layernorm", "mlp")),
    _OptAdapter(
        name="opt", model_types=family("opt").model_types,
        embedding_paths=("model.decoder.embed_tokens", "model.decoder.embed_positions",
                         "model.decoder.project_in"),
        blocks_path="model.decoder.layers",
        head_paths=("model.decoder.final_layer_norm", "model.decoder.project_out", "lm_head"),
        rotary_path=None,
        input_embedding_key="model.decoder.embed_tokens.weight", output_embedding_key="lm_head.weight",
        attention_half=("self_attn_layer_norm", "self_attn"),
        mlp_half=("final_layer_norm", "fc1", "fc2")),
)


def supported_families() -> list[str]:
    """The family shapes a stage can be built for."""
    return [a.name for a in _ADAPTERS]


def adapter_for(model_type: str) -> FamilyAdapter | None:
    """The adapter whose family covers `model_type`, or None (the caller raises with the fix)."""
    for adapter in _ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    return None


def num_blocks(config: PretrainedConfig) -> int:
    """Number of transformer blocks (the layer sequence has two more: embedding and head)."""
    return int(config.num_hidden_layers)


def _has(root: nn.Module, path: str) -> bool:
    """Whether the optional module at `path` exists (OPT's projections are None for most sizes)."""
    try:
        return root.get_submodule(path) is not None
    except AttributeError:
        return False
