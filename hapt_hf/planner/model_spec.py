"""ModelSpec: the layer sequence the planner cuts, built from a transformers config (no weights).

SKELETON: fields are the contract; the helper owning this file fills in the bodies.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerSpec", "ModelSpec", "ModelSpecError", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


class ModelSpecError(ValueError):
    """A model name/config the planner cannot describe; the message says what to fix."""


@dataclass(frozen=True)
class LayerSpec:
    """One entry of ``[embedding, block_0 .. block_{N-1}, head]``.

    Per-sample figures (one sequence of ``ModelSpec.seq_len`` tokens, ``ModelSpec.dtype``):
    multiply by the number of samples a GPU processes.
    """

    index: int
    """Position in the layer sequence (0 = embedding)."""
    kind: str
    """'embedding' | 'block' | 'head'."""
    signature: str
    """Equal for layers of the same shape: they share one profile entry."""
    params: int
    """Parameters this layer owns (a tied head owns none of the embedding matrix)."""
    fwd_flops: float
    """Forward FLOPs per sample."""
    bwd_flops: float
    """Backward FLOPs per sample (about 2x forward)."""
    act_out_bytes: float
    """Bytes per sample this layer sends to the next layer (a stage boundary after it)."""
    act_keep_bytes: float
    """Bytes per sample this layer keeps alive for its backward pass."""
    act_in_bytes: float = 0.0
    """Bytes per sample of this layer's input (what recompute keeps instead of act_keep)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    """'gpt2' | 'llama' | 'mistral' | 'qwen2' | 'opt' (LLaMA-shaped families share code)."""
    hidden_size: int
    num_blocks: int
    vocab_size: int
    seq_len: int
    dtype: str
    tied_embeddings: bool
    layers: tuple[LayerSpec, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)

    @classmethod
    def from_config(cls, config, seq_len: int, dtype: str = "fp32", name: str | None = None) -> "ModelSpec":
        raise NotImplementedError

    @classmethod
    def from_name_or_path(cls, name_or_path: str, seq_len: int, dtype: str = "fp32") -> "ModelSpec":
        raise NotImplementedError

    @classmethod
    def from_job_dict(cls, d: dict, seq_len: int, dtype: str) -> "ModelSpec":
        """From a scenario's ``job: model: {family, hidden_size, num_layers, ...}`` mapping."""
        raise NotImplementedError
