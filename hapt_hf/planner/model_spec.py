"""ModelSpec: the layer sequence the planner cuts, built from a transformers config (no weights).

The sequence is ``[embedding, block_0 .. block_{N-1}, head]``:

- the embedding owns the token embedding (and learned positions, OPT's ``project_in``);
- each block owns its norms, attention and MLP;
- the head owns the final norm (OPT's ``project_out``) and the LM head. With tied embeddings the
  head owns no copy of the embedding matrix, so ``total_params`` equals the model's parameter
  count; the head's FLOPs still include the vocabulary projection.

Conventions (per sample = one sequence of ``seq_len`` tokens):

- FLOPs: ``2 * seq_len * (weights of every matmul applied to each token)`` plus, per block,
  ``4 * seq_len**2 * attention_width`` for the score and context matmuls. The causal half is NOT
  subtracted: dense kernels compute the whole square. Backward = 2x forward.
- Activation memory kept for backward: the breakdown of Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models" (2022), ``34*s*h + 5*a*s**2`` bytes at 16-bit, with
  each tensor counted at the model's dtype, the MLP at its real width (SwiGLU keeps 4 tensors of
  the intermediate width), what transformers' modules keep beyond the paper's fused kernels
  (RMSNorm's normalised copy, the Python-written ``gelu_new``), and 1-byte dropout masks only
  where the config's dropout is on. The ``5*a*s**2`` score terms are kept only with
  ``eager_attention=True``: SDPA's fused kernels keep a per-row fp32 log-sum-exp instead. The
  tests hold the estimate to within 10% of what autograd saves for a block on CPU.

Half blocks (HAPT's fine-grained layers, :meth:`ModelSpec.split_blocks`): each block becomes an
attention half (input norm, attention, residual) and an MLP half (post-attention norm, MLP,
residual), each with its own exact parameters and FLOPs. Both send the residual stream
(``s*h``). Of the kept activations, the attention half keeps the attention terms, the MLP half
the MLP terms, and the norm copies and residual-dropout masks are split evenly (one norm and one
mask per half). A profile measured per whole block is shared between the halves in proportion to
their FLOPs (``LayerSpec.profile_signature`` / ``profile_share``, read by the cost model).

Length: over 400 lines because the per-family readers and the per-sample figures share one
private record (``_Shape``); kept together, every figure can be traced from the config field it
comes from within this file. Loading configs lives in :mod:`hapt_hf.planner.model_configs`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hapt_hf.core.families import SUPPORTED_MODEL_TYPES
from hapt_hf.core.layers import BLOCK, HALF, num_layers
from hapt_hf.core.precision import DTYPE_BYTES, DTYPES, canonical_dtype
from hapt_hf.errors import ModelSpecError, UnsupportedModel

from .model_configs import (BUILTIN_MODELS, HUB_ALIASES, PROFILE_NAMES, config_from_job_dict,
                            model_config)

__all__ = ["LayerSpec", "ModelSpec", "ModelSpecError", "DTYPE_BYTES", "SUPPORTED_FAMILIES",
           "BUILTIN_MODELS", "model_config"]

SUPPORTED_FAMILIES = SUPPORTED_MODEL_TYPES
"""Every ``config.model_type`` the planner describes (the families of hapt_hf.core.families)."""
_INDEX_BYTES = 8  # token ids are int64


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
    profile_signature: str = ""
    """For a block half: the whole block's signature, looked up when a profile has no entry
    for the half itself; '' otherwise."""
    profile_share: float = 1.0
    """For a block half: its share of the whole block's measured time (its share of the FLOPs)."""


@dataclass(frozen=True)
class _Shape:
    """What the per-family readers extract from a config: counts, before per-sample figures."""

    family: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_blocks: int
    tied: bool
    embed_params: int
    embed_matmul: int
    """Weights of matmuls in the embedding layer (OPT's project_in), applied per token."""
    block_params: int
    block_matmul: int
    attn_params: int
    """Parameters of a block's attention half (input norm + attention); 0: cannot be halved."""
    attn_matmul: int
    head_params: int
    head_matmul: int
    """Includes the vocabulary projection even when tied (its FLOPs are spent either way)."""
    gated_mlp: bool
    attn_dropout: bool
    """Dropout on the attention probabilities (keeps a mask and a copy of the s x s scores)."""
    resid_dropout: bool
    """Dropout on the attention and MLP outputs (two 1-byte masks)."""
    act_extra: int
    """Tensors of the MLP width the activation keeps beyond its input (HF's gelu_new: 3)."""
    max_positions: int | None
    """Learned position table size (gpt2/opt): seq_len may not exceed it; None for RoPE."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: a sequence of layers with per-sample costs."""

    name: str
    """The name or path it was built from (shown in plans and tables)."""
    family: str
    """'gpt2' | 'llama' | 'mistral' | 'qwen2' | 'opt' (LLaMA-shaped families share code)."""
    hidden_size: int
    num_blocks: int
    """Transformer blocks; the layer sequence has ``num_blocks + 2`` entries."""
    vocab_size: int
    seq_len: int
    """Tokens per sample the per-layer figures assume."""
    dtype: str
    """'fp32' | 'fp16' | 'bf16': bytes per activation element and per parameter."""
    tied_embeddings: bool
    """Input embedding and LM head share one matrix (owned by the embedding layer)."""
    layers: tuple[LayerSpec, ...]
    num_heads: int = 0
    num_kv_heads: int = 0
    """Key/value heads (fewer than num_heads with grouped-query attention)."""
    intermediate_size: int = 0
    """MLP width (SwiGLU's gate/up width for LLaMA-shaped families)."""
    profile_name: str | None = None
    """Name of this model in a measured profile file (e.g. 'OPT-350'), if it has one."""
    layer_unit: str = BLOCK
    """'block': ``layers`` is ``[embedding, blocks.., head]``; 'half': every block is two layers,
    ``[embedding, b0.attn, b0.mlp, b1.attn, ..., head]``."""
    half_layers: tuple[LayerSpec, ...] = ()
    """The half-block sequence :meth:`split_blocks` returns; () where blocks cannot be halved."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def can_split_blocks(self) -> bool:
        """Half figures exist and ``layers`` is still the whole-block sequence they came with
        (a hand-edited sequence is planned as it is)."""
        return (self.layer_unit == BLOCK and bool(self.half_layers)
                and len(self.layers) == num_layers(self.num_blocks, BLOCK))

    def split_blocks(self) -> "ModelSpec":
        """The same model with every block cut into its attention and MLP halves."""
        if self.layer_unit == HALF:
            return self
        if not self.can_split_blocks:
            raise ModelSpecError(
                f"model {self.name!r} ({self.family}) has no half-block figures for its layer "
                f"sequence: its blocks cannot be cut in two (halves exist for gpt2 and "
                f"LLaMA-shaped families, on the sequence from_config built); plan with "
                f"layer_unit 'block'")
        return replace(self, layers=self.half_layers, layer_unit=HALF, half_layers=())

    def with_layer_unit(self, layer_unit: str) -> "ModelSpec":
        """This model's layer sequence in a plan's ``layer_unit`` ('block' or 'half'): what a
        plan.json's layer ranges index, e.g. to replay or check a saved plan."""
        if layer_unit == self.layer_unit:
            return self
        if layer_unit == HALF:
            return self.split_blocks()
        raise ModelSpecError(f"layer_unit {layer_unit!r}: a model split into halves cannot be "
                             f"joined back; build the ModelSpec again for layer_unit 'block'")

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config, seq_len: int, dtype: str = "fp32", name: str | None = None,
                    profile_name: str | None = None, eager_attention: bool = False) -> "ModelSpec":
        """From a transformers ``PretrainedConfig`` (or a config path / built-in name, as
        :func:`model_config` reads them); no weights are created."""
        if isinstance(config, (str, Path)):
            name = name or str(config)
            config = model_config(config)
        dtype = _check_dtype(dtype)
        family = getattr(config, "model_type", None)
        reader = _READERS.get(family)
        if reader is None:
            raise UnsupportedModel(
                f"model family {family!r} is not supported; supported families: "
                f"{', '.join(SUPPORTED_FAMILIES)}. Pass a config of one of these model types.")
        shape = reader(config)
        _check_seq_len(seq_len, shape)
        layers = _layers(shape, int(seq_len), dtype, eager_attention)
        halves = _half_layers(layers, shape, int(seq_len), dtype, eager_attention) \
            if shape.attn_params else ()
        return cls(name=name or getattr(config, "name_or_path", "") or family, family=family,
                   hidden_size=shape.hidden, num_blocks=shape.num_blocks, vocab_size=shape.vocab,
                   seq_len=int(seq_len), dtype=dtype, tied_embeddings=shape.tied, layers=layers,
                   num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                   intermediate_size=shape.intermediate, profile_name=profile_name,
                   half_layers=halves)

    @classmethod
    def from_name_or_path(cls, name_or_path: str, seq_len: int, dtype: str = "fp32") -> "ModelSpec":
        """A local config.json / directory holding one, or a built-in name (``BUILTIN_MODELS``)."""
        key = HUB_ALIASES.get(str(name_or_path), str(name_or_path))
        return cls.from_config(model_config(name_or_path), seq_len, dtype, name=str(name_or_path),
                               profile_name=PROFILE_NAMES.get(key))

    @classmethod
    def from_job_dict(cls, d: dict, seq_len: int, dtype: str) -> "ModelSpec":
        """From a scenario's ``job: model: {family, hidden_size, num_layers, ...}`` mapping."""
        config = config_from_job_dict(d, seq_len)
        name = d.get("name") or d.get("profile_name") or f"{d['family']}-h{d['hidden_size']}"
        return cls.from_config(config, seq_len, dtype, name=str(name),
                               profile_name=d.get("profile_name"))

    @classmethod
    def from_job_model(cls, model: dict | str, seq_len: int, dtype: str) -> "ModelSpec":
        """A ``job: model:`` value: a mapping (``from_job_dict``) or a name/path."""
        if isinstance(model, dict):
            return cls.from_job_dict(model, seq_len, dtype)
        if isinstance(model, (str, Path)):
            return cls.from_name_or_path(str(model), seq_len, dtype)
        raise ModelSpecError(f"job.model must be a model name, a path or a mapping, "
                             f"got {type(model).__name__}")


# --- per-family readers ---------------------------------------------------------------------

def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _act_extra(name: str) -> int:
    # transformers' "gelu_new" is written as Python ops (x, x**3, tanh...) and autograd keeps
    # three more tensors than a fused activation; the others are single fused kernels
    # ReLU's saved output is the very tensor the next matmul keeps, so it adds one less
    return {"gelu_new": 3, "relu": -1}.get(name, 0)


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _gpt2_shape(c) -> _Shape:
    if getattr(c, "add_cross_attention", False):
        raise ModelSpecError("gpt2 config with add_cross_attention=True is an encoder-decoder "
                             "block; set add_cross_attention to false")
    h, v, inner = c.n_embd, c.vocab_size, c.n_inner or 4 * c.n_embd
    ln = 2 * h  # LayerNorm weight + bias
    block_matmul = h * 3 * h + h * h + h * inner + inner * h
    block = ln + _linear(h, 3 * h, True) + _linear(h, h, True) + ln \
        + _linear(h, inner, True) + _linear(inner, h, True)
    tied = _tied(c)
    return _Shape("gpt2", h, inner, c.n_head, c.n_head, h // c.n_head, v, c.n_layer, tied,
                  embed_params=v * h + c.n_positions * h, embed_matmul=0,
                  block_params=block, block_matmul=block_matmul,
                  attn_params=ln + _linear(h, 3 * h, True) + _linear(h, h, True),
                  attn_matmul=4 * h * h,
                  head_params=ln + (0 if tied else v * h), head_matmul=v * h,
                  gated_mlp=False, attn_dropout=c.attn_pdrop > 0, resid_dropout=c.resid_pdrop > 0,
                  act_extra=_act_extra(c.activation_function), max_positions=c.n_positions)


def _llama_shape(c) -> _Shape:
    """LLaMA, Mistral and Qwen2 share one block shape; Qwen2 adds q/k/v biases."""
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    qkv_bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
    o_bias = c.model_type == "llama" and bool(getattr(c, "attention_bias", False))
    mlp_bias = c.model_type == "llama" and bool(getattr(c, "mlp_bias", False))
    attn = (_linear(h, heads * hd, qkv_bias) + 2 * _linear(h, kv * hd, qkv_bias)
            + _linear(heads * hd, h, o_bias))
    mlp = 2 * _linear(h, i, mlp_bias) + _linear(i, h, mlp_bias)
    matmul = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * i
    tied = _tied(c)
    return _Shape(c.model_type, h, i, heads, kv, hd, v, c.num_hidden_layers, tied,
                  embed_params=v * h, embed_matmul=0,
                  block_params=attn + mlp + 2 * h, block_matmul=matmul,  # 2 RMSNorm weights
                  attn_params=attn + h, attn_matmul=h * heads * hd + 2 * h * kv * hd + heads * hd * h,
                  head_params=h + (0 if tied else v * h), head_matmul=v * h,
                  gated_mlp=True, attn_dropout=getattr(c, "attention_dropout", 0) > 0,
                  resid_dropout=False, act_extra=_act_extra(c.hidden_act), max_positions=None)


def _opt_shape(c) -> _Shape:
    h, f, v, proj = c.hidden_size, c.ffn_dim, c.vocab_size, c.word_embed_proj_dim
    bias = bool(getattr(c, "enable_bias", True))
    ln = 2 * h if getattr(c, "layer_norm_elementwise_affine", True) else 0
    block = 4 * _linear(h, h, bias) + _linear(h, f, bias) + _linear(f, h, bias) + 2 * ln
    proj_mm = proj * h if proj != h else 0  # project_in / project_out, no bias
    final_ln = ln if c.do_layer_norm_before and not getattr(c, "_remove_final_layer_norm", False) \
        else 0
    tied = _tied(c)
    # learned positions carry OPT's offset of 2 extra rows
    embed = v * proj + (c.max_position_embeddings + 2) * h + proj_mm
    return _Shape("opt", h, f, c.num_attention_heads, c.num_attention_heads,
                  h // c.num_attention_heads, v, c.num_hidden_layers, tied,
                  embed_params=embed, embed_matmul=proj_mm,
                  block_params=block, block_matmul=4 * h * h + 2 * h * f,
                  # OPT's post-attention norm placement varies; its blocks are not cut in two
                  attn_params=0, attn_matmul=0,
                  head_params=final_ln + proj_mm + (0 if tied else v * proj),
                  head_matmul=proj_mm + v * proj,
                  gated_mlp=False, attn_dropout=c.attention_dropout > 0,
                  resid_dropout=c.dropout > 0, act_extra=_act_extra(c.activation_function),
                  max_positions=c.max_position_embeddings)


_READERS = {"gpt2": _gpt2_shape, "llama": _llama_shape, "mistral": _llama_shape,
            "qwen2": _llama_shape, "opt": _opt_shape}


# --- per-sample figures ---------------------------------------------------------------------

def _block_keep_bytes(s: int, x: _Shape, b: int, eager_attention: bool) -> float:
    """Korthikanti et al.'s per-block breakdown, tensor by tensor, at ``b`` bytes per element."""
    return sum(_half_keep_bytes(s, x, b, eager_attention))


def _half_keep_bytes(s: int, x: _Shape, b: int, eager_attention: bool) -> tuple[float, float]:
    """(attention half, MLP half) of :func:`_block_keep_bytes`: each half has one norm and one
    residual-dropout mask, so those split evenly."""
    h, aw, kvw, i = x.hidden, x.heads * x.head_dim, x.kv_heads * x.head_dim, x.intermediate
    # attention: QKV input, Q, K, V, out-projection input
    attn = b * s * (h + aw + 2 * kvw + aw)
    if eager_attention:  # softmax output, plus its dropout mask (1 B) and dropout output
        attn += x.heads * s * s * ((2 * b + 1) if x.attn_dropout else b)
        attn += 2 * b * s * (aw - kvw)  # grouped K/V are copied to every head before matmul
    else:  # fused kernels keep the fp32 log-sum-exp per row and head
        attn += 4 * x.heads * s
    # MLP: input, then gate/up/act/product (SwiGLU) or fc1 output + activation output (GeLU)
    mlp = b * s * h + ((4 if x.gated_mlp else 2) + x.act_extra) * b * s * i
    # LayerNorm keeps its input; transformers' RMSNorm keeps its input and the normalised copy
    norms = (4 if x.gated_mlp else 2) * b * s * h
    masks = 2 * s * h if x.resid_dropout else 0  # attention-output and MLP-output dropout masks
    shared = (norms + masks) / 2
    return float(attn + shared), float(mlp + shared)


def _layers(x: _Shape, s: int, dtype: str, eager_attention: bool) -> tuple[LayerSpec, ...]:
    b = DTYPE_BYTES[dtype]
    hidden_bytes = float(b * s * x.hidden)
    tag = f"h{x.hidden}:s{s}:{dtype}"
    attn_sig = f"a{x.heads}:kv{x.kv_heads}" + ("" if x.head_dim * x.heads == x.hidden
                                                 else f":d{x.head_dim}")
    embed_fwd = 2.0 * s * x.embed_matmul
    # backward of a lookup needs only the token ids; OPT's project_in also keeps its input
    proj_in_bytes = b * s * (x.embed_matmul // x.hidden)
    embedding = LayerSpec(0, "embedding", f"{x.family}-embedding:v{x.vocab}:{tag}",
                          x.embed_params, embed_fwd, 2 * embed_fwd, hidden_bytes,
                          act_keep_bytes=float(_INDEX_BYTES * s + proj_in_bytes),
                          act_in_bytes=float(_INDEX_BYTES * s))
    block_fwd = 2.0 * s * x.block_matmul + 4.0 * s * s * x.heads * x.head_dim
    block_sig = f"{x.family}:h{x.hidden}:i{x.intermediate}:{attn_sig}:s{s}:{dtype}"
    keep = _block_keep_bytes(s, x, b, eager_attention)
    blocks = [LayerSpec(1 + k, "block", block_sig, x.block_params, block_fwd, 2 * block_fwd,
                        hidden_bytes, keep, hidden_bytes) for k in range(x.num_blocks)]
    head_fwd = 2.0 * s * x.head_matmul
    # head keeps the final norm's input, OPT's project_out input, the LM head's input and the
    # logits (model dtype + an fp32 copy for the softmax of the loss)
    lm_in_bytes = b * s * (x.embed_matmul // x.hidden or x.hidden)
    head_keep = hidden_bytes * (2 if x.embed_matmul else 1) + lm_in_bytes + s * x.vocab * (b + 4)
    head = LayerSpec(1 + x.num_blocks, "head", f"{x.family}-head:v{x.vocab}:{tag}",
                     x.head_params, head_fwd, 2 * head_fwd, 0.0, float(head_keep), hidden_bytes)
    return (embedding, *blocks, head)


def _half_layers(layers: tuple[LayerSpec, ...], x: _Shape, s: int, dtype: str,
                 eager_attention: bool) -> tuple[LayerSpec, ...]:
    """``[embedding, b0.attn, b0.mlp, ..., head]`` from the whole-block sequence."""
    keep = _half_keep_bytes(s, x, DTYPE_BYTES[dtype], eager_attention)
    attn_fwd = 2.0 * s * x.attn_matmul + 4.0 * s * s * x.heads * x.head_dim
    out = [layers[0]]
    for block in layers[1:-1]:
        halves = (("attn", x.attn_params, attn_fwd, keep[0]),
                  ("mlp", block.params - x.attn_params, block.fwd_flops - attn_fwd, keep[1]))
        for tag, params, fwd, kept in halves:
            out.append(LayerSpec(len(out), "block", f"{block.signature}:{tag}", params, fwd,
                                 2 * fwd, block.act_out_bytes, kept, block.act_in_bytes,
                                 profile_signature=block.signature,
                                 profile_share=fwd / block.fwd_flops))
    out.append(replace(layers[-1], index=len(out)))
    return tuple(out)


def _check_dtype(dtype: str) -> str:
    d = canonical_dtype(dtype)
    if d is None:
        raise ModelSpecError(f"dtype {dtype!r} is not known; use one of {', '.join(DTYPES)}")
    return d


def _check_seq_len(seq_len, x: _Shape) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ModelSpecError(f"seq_len must be a positive integer, got {seq_len!r}")
    if x.max_positions is not None and seq_len > x.max_positions:
        raise ModelSpecError(
            f"seq_len {seq_len} exceeds the {x.family} model's learned position table "
            f"({x.max_positions} positions); lower seq_len or raise max_position_embeddings")
