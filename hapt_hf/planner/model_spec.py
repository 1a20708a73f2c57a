"""ModelSpec: the layer sequence the planner cuts, built from a transformers config (no weights).

Where the figures come from is the caller's choice, never the process's history:
:meth:`ModelSpec.from_config` with ``reader=None`` (the default) stays torch-free and gives
gpt2, llama, mistral, qwen2 and opt this module's hand formulas (:meth:`ModelSpec.from_formula`,
also the oracle the measuring reader is tested against), and refuses every other type. With a
:class:`ModelReader` every accepted type's figures are read off the model:
:func:`hapt_hf.model_spec` (the public entry point, :mod:`hapt_hf.profiling.model_figures`)
passes the measuring one, as ``hapt-hf plan``, ``simulate``, ``profile`` and the launch path
do. The formulas follow the conventions below; the reader keeps the formulas' signatures for
these five families, so profiles stored under them apply to both.

The attention a ModelSpec is budgeted for (``attn_implementation``) is the caller's where it
names one; where it names none, the reader's choice of the model's best (sdpa where the model
class supports it, else eager); without a reader, sdpa, which the five formula families all
run.

The sequence is ``[embedding, block_0 .. block_{N-1}, head]``:

- the embedding owns the token embedding (and learned positions, OPT's ``project_in``);
- each block owns its norms, attention and MLP;
- the head owns the final norm (OPT's ``project_out``) and the LM head. With tied embeddings the
  head owns no copy of the embedding matrix, so ``total_params`` equals the model's parameter
  count; the head's FLOPs still include the vocabulary projection.

Conventions (per sample = one sequence of ``seq_len`` tokens; ``dtype`` is the compute dtype):

- FLOPs: ``2 * seq_len * (weights of every matmul applied to each token)`` plus, per block, the
  score and context matmuls: ``eager`` computes the whole ``4 * seq_len**2 * attention_width``
  square (backward 2x); ``sdpa``'s fused causal kernels skip the masked half (``2 * s**2 * aw``)
  and recompute the scores in the backward (``5 * s**2 * aw``). Everything else: backward = 2x
  forward.
- Precision as the runtime trains (:mod:`hapt_hf.core.precision`): weights, gradients and Adam
  state in fp32 (16 bytes per parameter), compute in ``dtype`` under autocast. The residual
  stream, the norms (autocast runs them in fp32) and the loss's log-softmax stay fp32; matmul
  inputs and outputs, Q/K/V and the MLP's tensors are ``dtype``. With a 16-bit ``dtype`` each
  linear keeps its own cast of an fp32 input (LLaMA's q, k, v each), and a micro-batch keeps
  autocast's 16-bit copies of the layer's matmul weights (``LayerSpec.act_keep_fixed_bytes``,
  whatever the micro-batch size; the runtime shares one copy among a step's micro-batches in
  flight, so the cost model counts it once a step).
- Activation memory kept for backward: the tensor-by-tensor breakdown of Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models" (2022), with each tensor at
  the dtype above, the MLP at its real width (SwiGLU keeps 4 tensors of the intermediate width),
  what transformers' modules keep beyond the paper's fused kernels (RMSNorm's normalised copy,
  the Python-written ``gelu_new``) and 1-byte dropout masks where the config's dropout is on
  (GPU kernels; PyTorch's CPU dropout keeps wider masks). ``eager`` attention keeps the s x s
  probabilities (fp32 softmax output, plus its 16-bit copy under autocast, plus dropout mask and
  output); ``sdpa`` keeps a per-row fp32 log-sum-exp instead, and an s x s fp32 mask per block
  where a sliding window shorter than ``seq_len`` makes the mask explicit. tests/planner/
  test_memory_model.py holds every family to within 10% of what autograd saves on CPU.
- Bytes sent to the next stage (``act_out_bytes``) are at the compute dtype; what a stage keeps
  of its input for recompute (``act_in_bytes``) is the fp32 residual stream.

Half blocks (HAPT's fine-grained layers, :meth:`ModelSpec.split_blocks`): each block becomes an
attention half (input norm, attention, residual) and an MLP half (post-attention norm, MLP,
residual), each with its own exact parameters and FLOPs. Both send the residual stream
(``s*h``). Of the kept activations, the attention half keeps the attention terms, the MLP half
the MLP terms, and the norm copies and residual-dropout masks are split evenly (one norm and one
mask per half). A profile measured per whole block is shared between the halves in proportion to
their FLOPs (``LayerSpec.profile_signature`` / ``profile_share``, read by the cost model).

Loading configs lives in :mod:`hapt_hf.planner.model_configs`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.core.families import SUPPORTED_MODEL_TYPES, accepted_model_types, generic_refusal
from hapt_hf.core.layers import BLOCK, HALF, num_layers
from hapt_hf.core.tp import tp_plan_problem
from hapt_hf.core.precision import DTYPE_BYTES, DTYPES, MASTER_BYTES, canonical_dtype
from hapt_hf.errors import ModelSpecError, UnsupportedModel

from .model_configs import (BUILTIN_MODELS, HUB_ALIASES, PROFILE_NAMES, config_from_job_dict,
                            model_config)

__all__ = ["LayerSpec", "ModelSpec", "ModelSpecError", "DTYPE_BYTES", "SUPPORTED_FAMILIES",
           "BUILTIN_MODELS", "model_config", "ReadModel", "ModelReader", "AS_ASKED",
           "MODELS_BEST", "HEAD_TP_PLANS"]

SUPPORTED_FAMILIES = SUPPORTED_MODEL_TYPES
"""Every ``config.model_type`` the planner describes (the families of hapt_hf.core.families)."""
_INDEX_BYTES = 8  # token ids are int64
AS_ASKED = "as asked"
"""``ModelSpec.attn_reason`` where the caller named the attention."""
MODELS_BEST = "the model's best"
"""``ModelSpec.attn_reason`` where the caller named none and the model runs sdpa."""
ENTRY_POINT = "hapt_hf.model_spec"
"""Where a model type without a hand formula gets its figures (named in the refusal)."""


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
    act_keep_fixed_bytes: float = 0.0
    """Bytes a micro-batch keeps for the backward whatever its size: autocast's 16-bit copies
    of the layer's matmul weights (0 in fp32; recompute keeps none), and GPT-2's position ids,
    one row for the whole micro-batch. The runtime shares the weight copies among a step's
    micro-batches in flight, so the cost model counts all of it once a step
    (:meth:`~hapt_hf.planner.cost_model.CostModel.weight_copy_bytes`; GPT-2's row of position
    ids, a few KB, is then counted once where each micro-batch keeps its own)."""
    profile_signature: str = ""
    """For a block half: the whole block's signature, looked up when a profile has no entry
    for the half itself; '' otherwise."""
    profile_share: float = 1.0
    """For a block half: its share of the whole block's measured time (its share of the FLOPs)."""
    tp_whole_params: int | None = None
    """Of a block's parameters, those a tensor-parallel replica keeps whole on each of its
    ranks (its norms and the biases of its row-wise projections); the rest, the projections
    the model's tensor-parallel plan shards, split ``t`` ways. None: estimated by
    :meth:`ModelSpec.tp_whole_params`."""


@dataclass(frozen=True)
class ReadModel:
    """What the installed reader returns for a model config (any accepted type)."""

    layers: tuple[LayerSpec, ...]
    """``[embedding, block_0 .. block_{N-1}, head]``."""
    half_layers: tuple[LayerSpec, ...] = ()
    """``[embedding, b0.attn, b0.mlp, ..., head]``; () where the blocks cannot be cut in two."""
    half_refusal: str = ""
    """Why the blocks cannot be cut in two (their attention and MLP run in parallel...); ''
    where ``half_layers`` are given."""


class ModelReader(Protocol):
    """What reads a model's figures off the model itself. It needs torch, so it lives above the
    planner (:class:`hapt_hf.profiling.model_figures.MeasuringReader`) and is passed to
    :meth:`ModelSpec.from_config` explicitly."""

    def attention(self, config: Any, asked: str | None) -> tuple[str, str]:
        """``(attn_implementation, why)``: ``asked`` where the model runs it (an error naming it
        otherwise), the model's best where ``asked`` is None."""
        ...

    def read(self, config: Any, seq_len: int, dtype: str,
             attn_implementation: str) -> ReadModel:
        """Every layer's figures, and the halves' where the blocks can be cut in two."""
        ...


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
    attn_inputs: int = 1
    """Linears that read the attention norm's output (fused QKV: 1; q, k, v apart: 3): under
    autocast each keeps its own 16-bit cast of it."""
    mlp_inputs: int = 1
    """Linears that read the MLP norm's output (SwiGLU's gate and up: 2)."""
    rms_norm: bool = False
    """RMSNorm (keeps its input and the normalised copy) instead of LayerNorm (its input)."""
    position_ids: str = ""
    """Learned positions' indices the embedding keeps: 'per_batch' (one row per micro-batch,
    GPT-2), 'per_sample' (OPT, from the attention mask) or '' (RoPE: none)."""
    final_norm: bool = True
    """The head starts with a norm (OPT with post-norm blocks has none)."""
    sliding_window: int | None = None
    """Attention window shorter than the model's reach (Mistral), or None."""
    embed_dropout: bool = False
    """Dropout on the embedding's output (GPT-2's embd_pdrop): a 1-byte mask."""
    block_whole: int = 0
    """Parameters of a block that tensor parallelism leaves whole (norms, row-wise biases)."""
    attn_whole: int = 0
    """The same for the block's attention half."""


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
    """'fp32' | 'fp16' | 'bf16': the compute dtype (weights and optimizer state stay fp32)."""
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
    half_refusal: str = ""
    """Why the blocks cannot be halved, where the model itself says (read off its blocks)."""
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    """'eager' | 'sdpa': the attention the runtime builds, which sets what attention keeps."""
    attn_reason: str = ""
    """Why ``attn_implementation``: 'as asked', or the model's best with why (e.g. 'gemma2 does
    not support sdpa; the model's best'); '' for a spec put together by hand."""
    tp_plan_refusal: str = ""
    """Why the model's blocks cannot be sharded among a replica's ranks whatever the degree
    (its config has no tensor-parallel plan the runtime runs); '' where they can, or for a
    spec put together by hand (the head counts and MLP width still decide)."""
    tp_plan: tuple[tuple[str, str], ...] = ()
    """The config's tensor-parallel plan (``config.base_model_tp_plan``) as (module, style)
    pairs: whether its blocks run sequence parallel (:func:`hapt_hf.core.tp.sp_refusal`)."""
    head_tp_plan: tuple[tuple[str, str], ...] = ()
    """The causal-LM class's own tensor-parallel plan beyond the base model (its ``lm_head``
    entry): whether a tensor-parallel last stage splits the head by vocabulary rows
    (:func:`hapt_hf.core.tp.head_sharded`). Without a reader, the class's plan of the formula
    families (:data:`HEAD_TP_PLANS`, checked against transformers by the tests)."""

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
        if not self.can_split_blocks and self.half_refusal:
            raise ModelSpecError(
                f"layer_unit 'half' is not possible for model {self.name!r} ({self.family}): "
                f"{self.half_refusal}; plan with layer_unit 'block'")
        if not self.can_split_blocks:
            raise ModelSpecError(
                f"model {self.name!r} ({self.family}) has no half-block figures for its layer "
                f"sequence: its blocks cannot be cut in two (halves exist for gpt2, opt, "
                f"LLaMA-shaped blocks, on the sequence from_config built); plan with "
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

    def tp_whole_params(self, layer: LayerSpec) -> int:
        """Parameters of ``layer`` that a tensor-parallel replica keeps whole on every rank:
        all of the embedding's and the head's (they are not sharded); a block's norms and
        row-wise biases (``LayerSpec.tp_whole_params``, else its norms' weights and biases at
        most, ``4 x hidden`` a block and half that a half, a bound that keeps the estimate on
        the side of more memory)."""
        if layer.kind != "block":
            return layer.params
        if layer.tp_whole_params is not None:
            return layer.tp_whole_params
        per = 2 if layer.profile_signature else 4  # a half holds one of the block's two norms
        return min(layer.params, per * self.hidden_size)

    def tp_allreduces(self, layer: LayerSpec) -> int:
        """All-reduces of the activations one forward (and again one backward) of ``layer``
        runs on a tensor-parallel replica: 2 a block (after the attention's and the MLP's
        row-wise projections), 1 a half, none for the embedding and the head."""
        if layer.kind != "block":
            return 0
        return 1 if layer.profile_signature else 2

    def boundary_bytes(self, last_layer: int, samples: int) -> float:
        """Bytes that cross a stage boundary after layer ``last_layer`` for ``samples`` samples
        (one micro-batch's activations forward, the same again as their gradient backward), at
        the compute dtype: what the runtime sends and the cost model prices."""
        return samples * self.layers[last_layer].act_out_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config, seq_len: int, dtype: str = "fp32", name: str | None = None,
                    profile_name: str | None = None, attn_implementation: str | None = None,
                    reader: ModelReader | None = None) -> "ModelSpec":
        """From a transformers ``PretrainedConfig`` (or a config path / built-in name, as
        :func:`model_config` reads them); no weights are created.

        ``reader=None``: the hand formula's figures (:meth:`from_formula`, torch-free) for gpt2,
        llama, mistral, qwen2 and opt; every other type is refused, naming
        :func:`hapt_hf.model_spec`, which reads it. With a ``reader`` every accepted type's
        figures are read off the model (under the formulas' signatures for those five).
        ``attn_implementation`` None: the model's best (the reader's choice; sdpa without one).
        Whether its blocks can be sharded among a replica's ranks is read off the config's
        tensor-parallel plan (``tp_plan_refusal``).
        """
        config, name = _config_and_name(config, name)
        spec = cls._from_config(config, seq_len, dtype, name, profile_name, attn_implementation,
                                reader)
        return _with_tp_plans(spec, config)

    @classmethod
    def _from_config(cls, config, seq_len: int, dtype: str, name: str | None,
                     profile_name: str | None, attn_implementation: str | None,
                     reader: ModelReader | None) -> "ModelSpec":
        """:meth:`from_config` without the config's tensor-parallel plan read."""
        config, name = _config_and_name(config, name)
        dtype = _check_dtype(dtype)
        if attn_implementation is not None:
            _check_attn(attn_implementation)
        family = getattr(config, "model_type", None)
        if family not in _READERS and family not in accepted_model_types():
            raise UnsupportedModel(generic_refusal(family))  # the matrix's status says why
        if reader is None:
            if family not in _READERS:
                raise UnsupportedModel(
                    f"model type {family!r} has no hand formula: its figures are read off the "
                    f"model with torch. Build its ModelSpec with {ENTRY_POINT}(config, "
                    f"seq_len=...) (ModelSpec.from_config(..., reader=None) gives the hand "
                    f"formulas of {', '.join(_READERS)} only)")
            attn, why = (attn_implementation, AS_ASKED) if attn_implementation is not None \
                else (DEFAULT_ATTN_IMPLEMENTATION, MODELS_BEST)
            return replace(cls.from_formula(config, seq_len, dtype, name, profile_name, attn),
                           attn_reason=why)
        attn, why = reader.attention(config, attn_implementation)
        _check_attn(attn)
        if family not in _READERS:
            return cls._from_reader(config, seq_len, dtype, name, profile_name, attn, why,
                                    reader)
        shape = _READERS[family](config)  # the config's checks, sizes and profile names
        _check_seq_len(seq_len, shape)
        read = reader.read(config, int(seq_len), dtype, attn)
        layers, halves = _named(read, _signatures(shape, int(seq_len), dtype, attn == "eager"))
        return cls._of_shape(shape, int(seq_len), dtype, layers, halves, name, profile_name,
                             attn, half_refusal=read.half_refusal, attn_reason=why)

    @classmethod
    def from_formula(cls, config, seq_len: int, dtype: str = "fp32", name: str | None = None,
                     profile_name: str | None = None,
                     attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION) -> "ModelSpec":
        """The hand formula's figures of a gpt2, llama, mistral, qwen2 or opt config (this
        module's docstring): what :meth:`from_config` returns without a reader (the planner
        used as a library without torch), and the oracle the reader's figures are tested
        against."""
        config, name = _config_and_name(config, name)
        dtype = _check_dtype(dtype)
        eager_attention = _check_attn(attn_implementation) == "eager"
        family = getattr(config, "model_type", None)
        if family not in _READERS:
            raise UnsupportedModel(f"model type {family!r} has no hand formula (only "
                                   f"{', '.join(_READERS)} have); use {ENTRY_POINT}")
        shape = _READERS[family](config)
        _check_seq_len(seq_len, shape)
        layers = _layers(shape, int(seq_len), dtype, eager_attention)
        halves = _half_layers(layers, shape, int(seq_len), dtype, eager_attention) \
            if shape.attn_params else ()
        return _with_tp_plans(cls._of_shape(shape, int(seq_len), dtype, layers, halves, name,
                                            profile_name, attn_implementation), config)

    @classmethod
    def _of_shape(cls, shape: "_Shape", seq_len: int, dtype: str, layers, halves,
                  name: str | None, profile_name: str | None, attn_implementation: str,
                  half_refusal: str = "", attn_reason: str = "") -> "ModelSpec":
        return cls(name=name or shape.family, family=shape.family,
                   hidden_size=shape.hidden, num_blocks=shape.num_blocks, vocab_size=shape.vocab,
                   seq_len=seq_len, dtype=dtype, tied_embeddings=shape.tied, layers=layers,
                   num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                   intermediate_size=shape.intermediate, profile_name=profile_name,
                   half_layers=halves, half_refusal=half_refusal,
                   attn_implementation=attn_implementation, attn_reason=attn_reason)

    @classmethod
    def _from_reader(cls, config, seq_len: int, dtype: str, name: str | None,
                     profile_name: str | None, attn_implementation: str, attn_reason: str,
                     reader: ModelReader) -> "ModelSpec":
        """An accepted type without a hand formula: the reader's figures (half-block figures
        where the stage builder cuts its blocks in two)."""
        family = getattr(config, "model_type", None)
        _check_seq_len(seq_len, None)
        read = reader.read(config, seq_len, dtype, attn_implementation)
        layers = read.layers
        return cls(name=name or getattr(config, "name_or_path", "") or family, family=family,
                   hidden_size=int(config.hidden_size), num_blocks=len(layers) - 2,
                   vocab_size=int(config.vocab_size), seq_len=seq_len, dtype=dtype,
                   tied_embeddings=_tied(config), layers=layers,
                   num_heads=int(getattr(config, "num_attention_heads", 0) or 0),
                   num_kv_heads=int(getattr(config, "num_key_value_heads", 0) or 0),
                   intermediate_size=int(getattr(config, "intermediate_size", 0) or 0),
                   profile_name=profile_name, attn_implementation=attn_implementation,
                   attn_reason=attn_reason, half_layers=read.half_layers,
                   half_refusal=read.half_refusal)

    @classmethod
    def from_name_or_path(cls, name_or_path: str, seq_len: int, dtype: str = "fp32",
                          attn_implementation: str | None = None,
                          reader: ModelReader | None = None) -> "ModelSpec":
        """A local config.json / directory holding one, or a built-in name (``BUILTIN_MODELS``);
        ``attn_implementation`` and ``reader`` as :meth:`from_config` takes them."""
        key = HUB_ALIASES.get(str(name_or_path), str(name_or_path))
        return cls.from_config(model_config(name_or_path), seq_len, dtype, name=str(name_or_path),
                               profile_name=PROFILE_NAMES.get(key),
                               attn_implementation=attn_implementation, reader=reader)

    @classmethod
    def from_job_dict(cls, d: dict, seq_len: int, dtype: str,
                      attn_implementation: str | None = None,
                      reader: ModelReader | None = None) -> "ModelSpec":
        """From a scenario's ``job: model: {family, hidden_size, num_layers, ...}`` mapping;
        ``attn_implementation`` and ``reader`` as :meth:`from_config` takes them."""
        config = config_from_job_dict(d, seq_len)
        name = d.get("name") or d.get("profile_name") or f"{d['family']}-h{d['hidden_size']}"
        return cls.from_config(config, seq_len, dtype, name=str(name),
                               profile_name=d.get("profile_name"),
                               attn_implementation=attn_implementation, reader=reader)

    @classmethod
    def from_job_model(cls, model: dict | str, seq_len: int, dtype: str,
                       attn_implementation: str | None = None,
                       reader: ModelReader | None = None) -> "ModelSpec":
        """A ``job: model:`` value: a mapping (``from_job_dict``) or a name/path."""
        if isinstance(model, dict):
            return cls.from_job_dict(model, seq_len, dtype, attn_implementation, reader)
        if isinstance(model, (str, Path)):
            return cls.from_name_or_path(str(model), seq_len, dtype, attn_implementation, reader)
        raise ModelSpecError(f"job.model must be a model name, a path or a mapping, "
                             f"got {type(model).__name__}")


HEAD_TP_PLANS = {family: (("lm_head", "colwise_gather_output"),)
                 for family in ("llama", "mistral", "qwen2")}
"""The causal-LM classes' own tensor-parallel plans (``LlamaForCausalLM._tp_plan``...) of
the formula families that have one, as transformers 5.24 writes them (gpt2 and opt have
none): what the planner reads without torch. A reader's model takes the same table."""


def _with_tp_plans(spec: "ModelSpec", config) -> "ModelSpec":
    """``spec`` with what the config's tensor-parallel plans allow: its blocks sharded
    (``tp_plan_refusal``), run sequence parallel (``tp_plan``), its head split
    (``head_tp_plan``)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    family = str(getattr(config, "model_type", spec.family))
    return replace(spec, tp_plan_refusal=_tp_plan_refusal(config),
                   tp_plan=tuple(sorted(plan.items())),
                   head_tp_plan=HEAD_TP_PLANS.get(family, ()))


def _tp_plan_refusal(config) -> str:
    """Why no replica of several ranks can hold this model's blocks ('' where one can, the
    degree aside): :func:`hapt_hf.core.tp.tp_plan_problem`, the runtime's rule."""
    return tp_plan_problem(str(getattr(config, "model_type", "?")),
                           getattr(config, "base_model_tp_plan", None)) or ""


def _config_and_name(config, name: str | None) -> tuple[Any, str | None]:
    """A config (read where a path or built-in name is given) and the name to show it by."""
    if isinstance(config, (str, Path)):
        return model_config(config), name or str(config)
    return config, name or getattr(config, "name_or_path", "") or None


def _named(read: ReadModel, signatures: tuple[str, str, str]
           ) -> tuple[tuple[LayerSpec, ...], tuple[LayerSpec, ...]]:
    """The reader's layers (and halves) under the hand-formula families' signatures, which
    name the config's shape, so profiles stored under them still apply."""
    embed, block, head = signatures
    layers = (replace(read.layers[0], signature=embed),
              *(replace(l, signature=block) for l in read.layers[1:-1]),
              replace(read.layers[-1], signature=head))
    halves = read.half_layers
    if halves:
        halves = (replace(halves[0], signature=embed),
                  *(replace(l, signature=f"{block}:{l.signature.rpartition(':')[2]}",
                            profile_signature=block) for l in halves[1:-1]),
                  replace(halves[-1], signature=head))
    return layers, halves


# --- per-family readers ---------------------------------------------------------------------

def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _act_extra(name: str) -> int:
    # transformers' "gelu_new" is written as Python ops (x, x**3, tanh...) and autograd keeps
    # three more tensors than a fused activation; the others are single fused kernels
    # ReLU's saved output is the very tensor the next matmul keeps, so it adds one less
    return {"gelu_new": 3, "relu": -1}.get(name, 0)


def _sliding_window(c) -> int | None:
    """Mistral's window, or Qwen2's where ``use_sliding_window`` turns it on."""
    on = c.model_type == "mistral" or bool(getattr(c, "use_sliding_window", False))
    window = getattr(c, "sliding_window", None) if on else None
    return int(window) if window else None


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
                  act_extra=_act_extra(c.activation_function), max_positions=c.n_positions,
                  attn_inputs=1, mlp_inputs=1, position_ids="per_batch",
                  embed_dropout=c.embd_pdrop > 0,
                  block_whole=2 * ln + 2 * h, attn_whole=ln + h)  # norms, c_proj biases


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
                  resid_dropout=False, act_extra=_act_extra(c.hidden_act), max_positions=None,
                  attn_inputs=3, mlp_inputs=2, rms_norm=True,
                  sliding_window=_sliding_window(c),
                  # the norms' weights, o_proj's and down_proj's biases
                  block_whole=2 * h + h * o_bias + h * mlp_bias, attn_whole=h + h * o_bias)


def _opt_shape(c) -> _Shape:
    h, f, v, proj = c.hidden_size, c.ffn_dim, c.vocab_size, c.word_embed_proj_dim
    bias = bool(getattr(c, "enable_bias", True))
    ln = 2 * h if getattr(c, "layer_norm_elementwise_affine", True) else 0
    block = 4 * _linear(h, h, bias) + _linear(h, f, bias) + _linear(f, h, bias) + 2 * ln
    proj_mm = proj * h if proj != h else 0  # project_in / project_out, no bias
    has_final_ln = c.do_layer_norm_before and not getattr(c, "_remove_final_layer_norm", False)
    final_ln = ln if has_final_ln else 0
    tied = _tied(c)
    # learned positions carry OPT's offset of 2 extra rows
    embed = v * proj + (c.max_position_embeddings + 2) * h + proj_mm
    return _Shape("opt", h, f, c.num_attention_heads, c.num_attention_heads,
                  h // c.num_attention_heads, v, c.num_hidden_layers, tied,
                  embed_params=embed, embed_matmul=proj_mm,
                  block_params=block, block_matmul=4 * h * h + 2 * h * f,
                  # the attention half: its norm (before or after the residual) and q, k, v, out
                  attn_params=ln + 4 * _linear(h, h, bias), attn_matmul=4 * h * h,
                  head_params=final_ln + proj_mm + (0 if tied else v * proj),
                  head_matmul=proj_mm + v * proj,
                  gated_mlp=False, attn_dropout=c.attention_dropout > 0,
                  resid_dropout=c.dropout > 0, act_extra=_act_extra(c.activation_function),
                  max_positions=c.max_position_embeddings, attn_inputs=3, mlp_inputs=1,
                  position_ids="per_sample",
                  final_norm=bool(has_final_ln),
                  block_whole=2 * ln + 2 * h * bias, attn_whole=ln + h * bias)


_READERS = {"gpt2": _gpt2_shape, "llama": _llama_shape, "mistral": _llama_shape,
            "qwen2": _llama_shape, "opt": _opt_shape}


# --- per-sample figures ---------------------------------------------------------------------

def _half_keep_bytes(s: int, x: _Shape, c: int, eager: bool) -> tuple[float, float]:
    """Bytes per sample a block keeps for its backward, as (attention half, MLP half), at ``c``
    bytes per compute element; each half has one norm and one residual-dropout mask."""
    h, aw, kvw, i = x.hidden, x.heads * x.head_dim, x.kv_heads * x.head_dim, x.intermediate
    mixed = c != MASTER_BYTES
    # fp32 linears share their input; under autocast each keeps its own 16-bit cast of it
    attn = (x.attn_inputs if mixed else 1) * c * s * h
    attn += c * s * (aw + 2 * kvw + aw)  # Q, K, V, out-projection input
    if eager:  # fp32 softmax output, its 16-bit copy, or the dropout's mask (1 B) and output
        # (dropout keeps only its mask, so the copy it reads is not kept)
        per_score = MASTER_BYTES + ((1 + c) if x.attn_dropout else (c if mixed else 0))
        attn += x.heads * s * s * per_score
        attn += 2 * c * s * (aw - kvw)  # grouped K/V are copied to every head before matmul
    else:  # fused kernels keep the fp32 log-sum-exp per row and head
        attn += 4 * x.heads * s
        if x.sliding_window is not None and x.sliding_window < s:
            attn += 4 * s * s  # the window's explicit mask, as the kernel's float mask
            # with a mask, transformers' sdpa path copies grouped K/V to every head (as eager)
            attn += 2 * c * s * (aw - kvw)
    # MLP: input(s), then gate/up/act/product (SwiGLU) or fc1 output + activation (GeLU)
    mlp = (x.mlp_inputs if mixed else 1) * c * s * h
    mlp += ((4 if x.gated_mlp else 2) + x.act_extra) * c * s * i
    # norms run in fp32 on the fp32 residual stream: LayerNorm keeps its input, RMSNorm its
    # input and the normalised copy
    norm = (2 if x.rms_norm else 1) * MASTER_BYTES * s * h
    mask = s * h if x.resid_dropout else 0  # attention-output / MLP-output dropout mask
    return float(attn + norm + mask), float(mlp + norm + mask)


def _weight_copies(matmul_weights: int, c: int) -> float:
    """Autocast's 16-bit copies of a layer's matmul weights, kept per micro-batch in flight."""
    return float(c * matmul_weights) if c != MASTER_BYTES else 0.0


def _attention_flops(s: int, x: _Shape, eager: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs of the score and context matmuls of one block."""
    square = 4.0 * s * s * x.heads * x.head_dim
    if eager:
        return square, 2 * square
    # causal fused kernels skip the masked half and recompute the scores in the backward
    return square / 2, 1.25 * square


def _embedding(x: _Shape, s: int, c: int, signature: str) -> LayerSpec:
    fwd = 2.0 * s * x.embed_matmul
    proj = x.embed_matmul // x.hidden  # OPT's project_in width (0: none)
    # a lookup's backward needs only the indices: token ids, and position ids where learned;
    # OPT's project_in also keeps its input
    ids = _INDEX_BYTES * s * (2 if x.position_ids == "per_sample" else 1)
    ids += s * x.hidden if x.embed_dropout else 0  # the dropout's 1-byte mask
    shared = _INDEX_BYTES * s if x.position_ids == "per_batch" else 0
    return LayerSpec(0, "embedding", signature, x.embed_params,
                     fwd, 2 * fwd, float(c * s * x.hidden), act_keep_bytes=float(ids + c * s * proj),
                     act_in_bytes=float(_INDEX_BYTES * s),
                     act_keep_fixed_bytes=_weight_copies(x.embed_matmul, c) + shared)


def _head(x: _Shape, s: int, c: int, signature: str) -> LayerSpec:
    fwd = 2.0 * s * x.head_matmul
    proj = x.embed_matmul // x.hidden
    norm = (2 if x.rms_norm else 1) * MASTER_BYTES * s * x.hidden if x.final_norm else 0
    # LM head input (after OPT's project_out, which keeps its own input), the loss's fp32
    # log-softmax over the vocabulary, and the int64 labels
    inputs = c * s * (x.hidden + proj if proj else x.hidden)
    keep = norm + inputs + MASTER_BYTES * s * x.vocab + _INDEX_BYTES * s
    return LayerSpec(1 + x.num_blocks, "head", signature,
                     x.head_params, fwd, 2 * fwd, 0.0, float(keep),
                     float(MASTER_BYTES * s * x.hidden),
                     act_keep_fixed_bytes=_weight_copies(x.head_matmul, c))


def _signatures(x: _Shape, s: int, dtype: str, eager: bool) -> tuple[str, str, str]:
    """(embedding, block, head) signatures: the shape, seq_len and dtype a profile entry is for."""
    tag = f"h{x.hidden}:s{s}:{dtype}"
    attn_sig = f"a{x.heads}:kv{x.kv_heads}" + ("" if x.head_dim * x.heads == x.hidden
                                                 else f":d{x.head_dim}")
    # eager blocks keep more and run longer: a profile measured for one is not the other's
    block_sig = f"{x.family}:h{x.hidden}:i{x.intermediate}:{attn_sig}:s{s}:{dtype}" + \
        (":eager" if eager else "")
    return (f"{x.family}-embedding:v{x.vocab}:{tag}", block_sig,
            f"{x.family}-head:v{x.vocab}:{tag}")


def _layers(x: _Shape, s: int, dtype: str, eager: bool) -> tuple[LayerSpec, ...]:
    c = DTYPE_BYTES[dtype]
    embed_sig, block_sig, head_sig = _signatures(x, s, dtype, eager)
    att_f, att_b = _attention_flops(s, x, eager)
    block_fwd = 2.0 * s * x.block_matmul + att_f
    block_bwd = 4.0 * s * x.block_matmul + att_b
    keep = sum(_half_keep_bytes(s, x, c, eager))
    blocks = [LayerSpec(1 + k, "block", block_sig, x.block_params, block_fwd, block_bwd,
                        float(c * s * x.hidden), keep, float(MASTER_BYTES * s * x.hidden),
                        act_keep_fixed_bytes=_weight_copies(x.block_matmul, c),
                        tp_whole_params=x.block_whole)
              for k in range(x.num_blocks)]
    return (_embedding(x, s, c, embed_sig), *blocks, _head(x, s, c, head_sig))


def _half_layers(layers: tuple[LayerSpec, ...], x: _Shape, s: int, dtype: str,
                 eager: bool) -> tuple[LayerSpec, ...]:
    """``[embedding, b0.attn, b0.mlp, ..., head]`` from the whole-block sequence."""
    c = DTYPE_BYTES[dtype]
    keep = _half_keep_bytes(s, x, c, eager)
    att_f, att_b = _attention_flops(s, x, eager)
    attn_fwd = 2.0 * s * x.attn_matmul + att_f
    attn_bwd = 4.0 * s * x.attn_matmul + att_b
    out = [layers[0]]
    for block in layers[1:-1]:
        halves = (("attn", x.attn_params, attn_fwd, attn_bwd, keep[0], x.attn_matmul,
                   x.attn_whole),
                  ("mlp", block.params - x.attn_params, block.fwd_flops - attn_fwd,
                   block.bwd_flops - attn_bwd, keep[1], x.block_matmul - x.attn_matmul,
                   x.block_whole - x.attn_whole))
        for tag, params, fwd, bwd, kept, matmul, whole in halves:
            out.append(LayerSpec(len(out), "block", f"{block.signature}:{tag}", params, fwd,
                                 bwd, block.act_out_bytes, kept, block.act_in_bytes,
                                 profile_signature=block.signature,
                                 profile_share=fwd / block.fwd_flops,
                                 act_keep_fixed_bytes=_weight_copies(matmul, c),
                                 tp_whole_params=whole))
    out.append(replace(layers[-1], index=len(out)))
    return tuple(out)


def _check_attn(attn_implementation: str) -> str:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ModelSpecError(f"attn_implementation {attn_implementation!r} is not known; use "
                             f"one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    return attn_implementation


def _check_dtype(dtype: str) -> str:
    d = canonical_dtype(dtype)
    if d is None:
        raise ModelSpecError(f"dtype {dtype!r} is not known; use one of {', '.join(DTYPES)}")
    return d


def _check_seq_len(seq_len, x: _Shape | None) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ModelSpecError(f"seq_len must be a positive integer, got {seq_len!r}")
    if x is not None and x.max_positions is not None and seq_len > x.max_positions:
        raise ModelSpecError(
            f"seq_len {seq_len} exceeds the {x.family} model's learned position table "
            f"({x.max_positions} positions); lower seq_len or raise max_position_embeddings")
