"""Per-layer figures read off a causal LM itself (built on the meta device, no weights, no compute).

The figures of a ModelSpec for every accepted model type, the five with a hand formula in
:mod:`hapt_hf.planner.model_spec` included (the formulas are this reader's test oracles and the
torch-free path): each layer counted over the modules the runtime's stage holds (the family's
own adapter for gpt2, LLaMA-shaped and opt models, the generic one otherwise); exact parameters
per layer of ``[embedding, blocks.., head]`` and forward / backward FLOPs per sample counted by
``FlopCounterMode`` over one meta forward at ``seq_len``. The score and context matmuls
(``aten.bmm``, counted as the whole s x s square) follow the planner's convention: eager
attention as counted, backward 2x; sdpa's causal kernels half of it forward and 5/4 of it
backward (they recompute the scores). Everything else: backward = 2x forward.

:func:`read_layer_specs` adds what autograd keeps for the backward, measured: one layer of each
distinct kind is built as the runtime builds it (:func:`~hapt_hf.profiling.profiler.build_layer`)
and run forward under saved-tensor hooks (every storage once, parameters excluded), all on fake
CPU tensors: the same shapes, dtypes and autocast casts as on the CPU, no data and no memory, so
a 405B-class model reads in seconds (``benchmarks/model_reader.py``) and the figures equal a real
CPU run's byte for byte, dropout aside: it is kept as the GPU kernels the runtime trains with
keep it (a 1-byte mask; none inside sdpa's fused kernel), not as the CPU's wider masks.
The run is at the asked ``seq_len`` (fake tensors cost nothing at any length, so sliding
windows, chunked attention and eager's s x s scores are measured, not extrapolated). Two
micro-batch sizes split the per-sample bytes from the per-micro-batch ones (autocast's weight
copies, RoPE's cos / sin shared by the micro-batch).

:func:`read_model` adds the half-block sequence where the stage builder cuts blocks in two
(GPT-2's, OPT's and the LLaMA block, after the attention residual): each half's parameters and
FLOPs are its own modules' (the MLP half the block's rest), its kept bytes measured on a
one-half stage; where the blocks cannot be halved it gives the builder's reason instead.
:class:`~hapt_hf.profiling.model_figures.MeasuringReader` passes it to
:meth:`hapt_hf.planner.model_spec.ModelSpec.from_config` (:func:`hapt_hf.model_spec`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from hapt_hf.compat.torch_api import fake_tensors
from hapt_hf.core.precision import DTYPE_BYTES, MASTER_BYTES
from hapt_hf.pipeline.families import FamilyAdapter, adapter_for
from hapt_hf.pipeline.generic import generic_adapter
from hapt_hf.core.layers import BLOCK, HALF
from hapt_hf.planner.model_spec import LayerSpec, ReadModel

from .memory import saved_tensor_bytes
from .profiler import build_layer, layer_run
from .routing import balanced_routing
from .store import ProfilerOptions

__all__ = ["LayerCount", "read_layer_counts", "read_layer_specs", "read_model"]

_INDEX_BYTES = 8  # token ids are int64

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
    return _MetaCounts(config, seq_len, attn_implementation).layers()


class _MetaCounts:
    """One meta forward of the whole model under the FLOP counter; parameters and FLOPs of any
    group of its modules (a layer of the sequence, or a block's half)."""

    def __init__(self, config: PretrainedConfig, seq_len: int, attn_implementation: str) -> None:
        with torch.device("meta"):
            # experts as batched matmuls over each token's chosen experts: on meta the router's
            # top-k still picks top_k experts a token, so only the experts that run are counted
            # (the grouped kernel has no fp32 meta form, the eager loop reads routing values)
            self.full = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         experts_implementation="batched_mm")
        # no gradients in a count: a module called with a view of a parameter (DBRX's experts)
        # would otherwise get a leaf view requiring grad, which the counter's module tracker
        # cannot hook
        self.full.requires_grad_(False)
        self.adapter = runtime_adapter(self.full)
        self.attn_implementation = attn_implementation
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad(), balanced_routing():
            width = self.full.get_input_embeddings().embedding_dim  # OPT's project_in: not h
            # inputs_embeds: the id-based checks read token values. A real padding mask (all
            # ones, as a batch's mask may be; s integers): the mask builders read its values
            # (recurrent masks) or, without one, the position ids' (packed sequences); the
            # routing mode takes it in as meta where it meets the model's tensors
            self.full(inputs_embeds=torch.zeros(1, seq_len, width, device="meta"),
                      attention_mask=torch.ones(1, seq_len, dtype=torch.long))
        self.counts = {k.partition(".")[2]: v for k, v in counter.get_flop_counts().items()}
        self.blocks = [f"{self.adapter.blocks_path}.{i}"
                       for i in range(len(self.full.get_submodule(self.adapter.blocks_path)))]

    def layers(self) -> list[LayerCount]:
        a = self.adapter
        groups = [list(a.embedding_paths), *([b] for b in self.blocks), list(a.head_paths)]
        seen: set[int] = set()  # a tied head's matrix is the embedding's: counted once
        return [self.count(paths, seen) for paths in groups]

    def halves(self, block: int) -> tuple[LayerCount, LayerCount]:
        """(attention half, MLP half) of one block: the half's own modules, the MLP half the
        block's rest (the residual adds count no FLOPs)."""
        path = self.blocks[block]
        whole = self.count([path], set())
        attn = self.count([f"{path}.{n}" for n in self.adapter.attention_half], set())
        return attn, LayerCount(whole.params - attn.params, whole.fwd_flops - attn.fwd_flops,
                                whole.bwd_flops - attn.bwd_flops)

    def count(self, paths: list[str], seen: set[int]) -> LayerCount:
        paths = [p for p in paths if _present(self.full, p)]  # OPT's optional projections
        params = 0
        for path in paths:
            for p in self.full.get_submodule(path).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params += p.numel()
        attn = [self.counts.get(a, {}) for p in paths for a in self._attention(p)]
        return _count(params, [self.counts.get(p, {}) for p in paths], attn,
                      self.attn_implementation)


    def _attention(self, path: str) -> list[str]:
        """The attention modules at or just under ``path`` (a half names its attention)."""
        if _is_attention(path.rpartition(".")[2]):
            return [path]
        return [f"{path}.{name}" for name, _ in self.full.get_submodule(path).named_children()
                if _is_attention(name)]


def runtime_adapter(full: torch.nn.Module) -> FamilyAdapter:
    """The adapter the stage builder cuts ``full`` with: its family's hand-written one (gpt2,
    LLaMA-shaped, opt), else the generic one read off the model; so the layers and halves
    counted here are the modules a stage of each holds."""
    return adapter_for(full.config.model_type) or generic_adapter(full)


def _present(full: torch.nn.Module, path: str) -> bool:
    """Whether the module at ``path`` exists (OPT leaves project_in / project_out None)."""
    parent, _, name = path.rpartition(".")
    return getattr(full.get_submodule(parent) if parent else full, name, None) is not None


def _is_attention(child_name: str) -> bool:
    """A block's attention module (self_attn, attention, attn...): its batched matmuls are the
    score and context products; other batched matmuls (MoE experts) are dense work."""
    return "attn" in child_name or "attention" in child_name


def _count(params: int, per_module: list[dict], attention: list[dict],
           attn_implementation: str) -> LayerCount:
    attn = sum(v for ops in attention for op, v in ops.items() if str(op) in _ATTN_OPS)
    dense = sum(v for ops in per_module for v in ops.values()) - attn
    if attn_implementation == "eager":
        return LayerCount(params, float(dense + attn), float(2 * (dense + attn)))
    return LayerCount(params, dense + attn / 2, 2 * dense + attn * 5 / 4)


def _own_rng():
    """The reader draws (weights of the layers it builds, dropout) from the CPU generator, whose
    state it puts back: planning leaves the user's RNG as it was (a run seeded 1 shuffles as
    seeded 1); it seeds no CUDA generator either (fake CPU tensors only)."""
    return torch.random.fork_rng(devices=[])


def read_layer_specs(config: PretrainedConfig, seq_len: int, dtype: str,
                     attn_implementation: str = "sdpa") -> tuple[LayerSpec, ...]:
    """``[embedding, block_0 .. block_{N-1}, head]`` as the planner's LayerSpecs: parameters and
    FLOPs read off the meta model, kept bytes measured on one layer of each distinct kind."""
    with _own_rng():
        return _Reader(config, seq_len, dtype, attn_implementation).layers()


def read_model(config: PretrainedConfig, seq_len: int, dtype: str,
               attn_implementation: str = "sdpa") -> ReadModel:
    """The whole-block sequence and, where the stage builder cuts a block in two (GPT-2's,
    OPT's, the pre-norm attention residual then MLP residual of the LLaMA block), the half-block
    sequence; otherwise the builder's reason (attention and MLP in parallel, another forward)."""
    with _own_rng():
        reader = _Reader(config, seq_len, dtype, attn_implementation)
        layers = reader.layers()
        if reader.meta.adapter.attention_half is None:
            return ReadModel(layers, half_refusal=reader.meta.adapter.half_refusal)
        return ReadModel(layers, half_layers=reader.half_layers(layers))


class _Reader:
    """Counts of the meta model, kept bytes measured once per distinct layer (or half) kind."""

    def __init__(self, config: PretrainedConfig, seq_len: int, dtype: str,
                 attn_implementation: str) -> None:
        self.config, self.s, self.dtype = config, int(seq_len), dtype
        self.meta = _MetaCounts(config, seq_len, attn_implementation)
        self.options = ProfilerOptions(attn_implementation=attn_implementation)
        self.kept: dict[str, tuple[float, float]] = {}

    def layers(self) -> tuple[LayerSpec, ...]:
        config, s, dtype = self.config, self.s, self.dtype
        counts = self.meta.layers()
        c, h = DTYPE_BYTES[dtype], int(config.hidden_size)
        kinds = _block_kinds(config, len(counts) - 2)
        eager = self.options.attn_implementation == "eager"
        tag = f"{config.model_type}:h{h}:s{s}:{dtype}" + (":eager" if eager else "")
        layers = []
        for i, count in enumerate(counts):
            kind = "embedding" if i == 0 else "head" if i == len(counts) - 1 else "block"
            signature = f"{tag}:{kinds[i - 1] if kind == 'block' else kind}"
            # a stage sends the residual stream at the compute dtype; recompute keeps the fp32
            # input
            out_bytes = 0.0 if kind == "head" else float(c * s * h)
            in_bytes = float(_INDEX_BYTES * s if kind == "embedding" else MASTER_BYTES * s * h)
            layers.append(self._measured(LayerSpec(i, kind, signature, count.params,
                                                   count.fwd_flops, count.bwd_flops, out_bytes,
                                                   0.0, in_bytes), BLOCK))
        return tuple(layers)

    def half_layers(self, layers: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
        """``[embedding, b0.attn, b0.mlp, ..., head]``: each half's own counts and kept bytes;
        a profile of the whole block is shared by FLOPs, as for the hand-formula families."""
        out = [layers[0]]
        for block in layers[1:-1]:
            for part, count in zip(("attn", "mlp"), self.meta.halves(block.index - 1)):
                half = LayerSpec(len(out), "block", f"{block.signature}:{part}", count.params,
                                 count.fwd_flops, count.bwd_flops, block.act_out_bytes, 0.0,
                                 block.act_in_bytes, profile_signature=block.signature,
                                 profile_share=count.fwd_flops / block.fwd_flops)
                out.append(self._measured(half, HALF))
        out.append(replace(layers[-1], index=len(out)))
        return tuple(out)

    def _measured(self, layer: LayerSpec, unit: str) -> LayerSpec:
        if layer.signature not in self.kept:
            self.kept[layer.signature] = _kept_bytes(self.config, layer, self.s, self.dtype,
                                                     self.options, unit)
        keep, fixed = self.kept[layer.signature]
        return replace(layer, act_keep_bytes=keep, act_keep_fixed_bytes=fixed)


def _block_kinds(config: PretrainedConfig, n: int) -> list[str]:
    """Each block's kind: the config's per-layer attention kind where it has one."""
    kinds = getattr(config, "layer_types", None)
    return [str(k) for k in kinds[:n]] if isinstance(kinds, (list, tuple)) and len(kinds) >= n \
        else ["block"] * n


def _saved(config, stage, kind: str, micro_batch: int, seq_len: int, dtype: str) -> float:
    run = layer_run(stage, config, kind, micro_batch, seq_len, dtype, "cpu")
    return saved_tensor_bytes(run.stage, run.forward)[0]


def _kept_bytes(config, layer: LayerSpec, seq_len: int, dtype: str,
                options: ProfilerOptions, unit: str = BLOCK) -> tuple[float, float]:
    """(bytes per sample, bytes per micro-batch) ``layer`` keeps for its backward at ``seq_len``."""
    with fake_tensors():  # a real layer of a large model would take gigabytes and minutes
        return _measure_kept(config, layer, seq_len, dtype, options, unit)


def _measure_kept(config, layer: LayerSpec, seq_len: int, dtype: str,
                  options: ProfilerOptions, unit: str) -> tuple[float, float]:
    torch.default_generator.manual_seed(0)  # the CPU's alone (inside _own_rng): same draws each time
    stage = build_layer(config, layer, "cpu", options, unit)
    with _GpuDropout(), balanced_routing(fake=True):
        one, two = (_saved(config, stage, layer.kind, mb, seq_len, dtype) for mb in (1, 2))
    return two - one, 2 * one - two  # (per sample, per micro-batch)


class _GpuDropout(TorchFunctionMode):
    """Dropout kept as the GPU kernels the runtime trains with keep it, not as the CPU's.

    CPU dropout keeps a mask as wide as its input, and sdpa with dropout falls back on the CPU
    to the math kernel that keeps the s x s probabilities and their mask; on a GPU dropout keeps
    a 1-byte mask and sdpa's fused kernels draw their dropout inside (no mask kept)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            kwargs = {**kwargs, "dropout_p": 0.0}
        elif func is F.dropout:
            x, p, training = _dropout_args(*args, **kwargs)
            if training and p > 0:
                return _MaskedDropout.apply(x, p)
        return func(*args, **kwargs)


def _dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training


class _MaskedDropout(torch.autograd.Function):
    """Dropout keeping a 1-byte mask for its backward, as CUDA's ``native_dropout`` does."""

    @staticmethod
    def forward(ctx, x, p):
        keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
        ctx.save_for_backward(keep)
        ctx.scale = 1 / (1 - p)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return grad * keep * ctx.scale, None
