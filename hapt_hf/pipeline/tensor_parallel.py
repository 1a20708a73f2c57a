"""Tensor parallelism inside a replica: one stage's blocks sharded over the replica's ranks.

A replica of ``t`` ranks (its ``ranks`` in the plan) shards the transformer blocks'
projections that the model's own tensor-parallel plan names (transformers'
``config.base_model_tp_plan``: ``"layers.*.self_attn.q_proj": "colwise"``, ...), with
``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D ``DeviceMesh`` of the
replica's process group: ``colwise`` is ``ColwiseParallel`` (the weight split by output rows,
the input replicated, the output left sharded on the heads or the MLP width) and ``rowwise`` is
``RowwiseParallel`` (split by input columns, the partial outputs all-reduced). A block's
parameters are then DTensors; everything else (the embedding, the norms, the final norm, the
LM head) stays a whole, plain parameter on every rank of the replica, computed redundantly.
``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``) stays whole too,
but each rank sees only its heads, so its gradient is summed over the replica's ranks
(:attr:`TensorParallelShards.partial`), as is that of every whole module beside a sharded
projection, which the model's plan may not mark (Apertus' learnable MLP activation). Any
other style inside the blocks is refused by name; entries outside them (an
``embedding_rowwise`` embedding) are left out, the embedding staying whole.
``benchmarks/tp_check.py`` compares every accepted type with a plan against one process.

Two options on top (:mod:`hapt_hf.core.tp` holds their rules, which the planner asks too):

* **Sequence parallelism** (plan.json's ``"sp"``; :func:`~hapt_hf.core.tp.sp_refusal`), as
  torchtitan's llama plan: the blocks' residual stream is split on the sequence over the
  replica's ranks. ``PrepareModuleInput`` all-gathers the attention's and the MLP's input
  (``hidden_states``, a keyword of HF's attention) and ``RowwiseParallel(output_layouts=
  Shard(1))`` reduce-scatters ``o_proj``'s and ``down_proj``'s outputs onto the sequence. The
  block norms run on each rank's tokens only; they stay whole, plain modules (torch's
  ``SequenceParallel`` would make their weights replicated DTensors) and their gradients join
  :attr:`TensorParallelShards.partial`, summed over the replica. The stage's transfers stay
  whole activations: a hook before the stage's first block keeps each rank's slice of the
  sequence (backward: the gradient all-gathered) and one after its last block all-gathers
  the sequence (backward: the gradient sliced), both as DTensor redistributions. The
  gathered input the projections save for their weight gradients is kept as the rank's
  slice and gathered again in the backward (:class:`_GatheredInput`, as Megatron-LM does), so
  a rank keeps ``34/t`` of a block's activations (:func:`~hapt_hf.core.tp.block_activation_parts`).
* **A vocabulary-split LM head** (:func:`~hapt_hf.core.tp.head_sharded`: the model class's
  own plan names ``lm_head``, untied): ``ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)``, the weight split by vocabulary rows and the logits left split,
  so each rank takes the loss on its columns (:mod:`~hapt_hf.pipeline.vocab_parallel`, as
  torch's ``loss_parallel`` and Megatron-LM's vocabulary-parallel cross-entropy do) and no
  rank holds the whole logits; where the logits themselves are asked for (prediction) the
  stage gathers them. The weight is a DTensor like a block projection's: checkpoints, the
  gathered state dict and ZeRO-1 treat it as they treat those.

Every rank of the replica builds the same seeded (or loaded) weights, so each keeps its own
slice locally (no scatter from one rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)
from transformers import PretrainedConfig

from hapt_hf.compat.torch_api import saved_tensors_hooks_in_force
from hapt_hf.compat.transformers_api import causal_lm_tp_plan
from hapt_hf.core.tp import HEAD_MODULE, TP_STYLES, block_entries, head_sharded, sp_refusal, tp_plan_problem
from hapt_hf.pipeline.config_checks import tp_size_refusal

__all__ = ["TensorParallelShards", "tp_plan_refusal", "sequence_parallel_refusal", "head_is_sharded",
           "stage_tp_plan", "shard_stage", "local_tensor", "is_sharded", "full_state_dict"]

COLWISE, ROWWISE, REPLICATED_GRAD_SUM = TP_STYLES  # the styles a replica runs (core/tp)


def tp_plan_refusal(config: PretrainedConfig, t: int) -> str | None:
    """Why a replica of ``t`` ranks cannot hold a stage of this model, or None if it can (or
    ``t`` is 1): the model has no tensor-parallel plan, the plan names a style not supported
    here, or ``t`` does not divide the heads, key/value heads or MLP width."""
    if t == 1:
        return None
    problem = tp_plan_problem(str(getattr(config, "model_type", "?")),
                              getattr(config, "base_model_tp_plan", None))
    if problem is not None:
        return (f"{problem}; the plan gives a replica {t} ranks: re-plan with one rank per "
                "replica (no tensor parallelism)")
    return tp_size_refusal(config, t)


def sequence_parallel_refusal(config: PretrainedConfig, t: int, layer_unit: str) -> str | None:
    """Why a stage of this model on replicas of ``t`` ranks cannot run sequence parallel
    (:func:`hapt_hf.core.tp.sp_refusal` of its config), or None if it can."""
    return sp_refusal(str(getattr(config, "model_type", "?")),
                      getattr(config, "base_model_tp_plan", None), t, layer_unit)


def head_is_sharded(config: PretrainedConfig, t: int) -> bool:
    """Whether a last stage of this model on replicas of ``t`` ranks splits its LM head by
    vocabulary rows (:func:`hapt_hf.core.tp.head_sharded` of its class's plan)."""
    return head_sharded(t, causal_lm_tp_plan(config),
                        bool(getattr(config, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class TensorParallelShards:
    """What sharding did to one stage replica."""

    mesh: DeviceMesh
    """The replica's 1-D device mesh (its tensor-parallel process group)."""
    group: Any
    """The replica's tensor-parallel process group."""
    rank: int
    """This rank's position in the replica (its TP rank)."""
    size: int
    """Ranks holding the replica together (``t``)."""
    modules: tuple[str, ...]
    """The stage's modules parallelized, by path."""
    partial: tuple[nn.Parameter, ...]
    """Whole parameters whose gradient each rank computes from its heads (or, sequence
    parallel, its tokens) only: summed over :attr:`group` after the backward."""
    sequence_parallel: bool = False
    """The blocks run sequence parallel (their residual stream split on the sequence)."""
    head: bool = False
    """The LM head is split by vocabulary rows (its logits left split for the loss)."""


def stage_tp_plan(stage: nn.Module, config: PretrainedConfig) -> dict[str, str]:
    """The model's tensor-parallel plan for the blocks this stage holds: each pattern of
    ``config.base_model_tp_plan`` (relative to the base model, ``layers.*.mlp.up_proj``) turned
    into the paths of the stage's modules (``model.layers.3.mlp.up_proj``), style by path.
    A half block keeps only its half's modules. Entries outside the blocks (an
    ``embedding_rowwise`` embedding) are left out: the embedding stays whole on every rank."""
    blocks = stage.adapter.blocks_path  # e.g. "model.layers"
    stack = blocks.rpartition(".")[2]
    out: dict[str, str] = {}
    for pattern, style in block_entries(config.base_model_tp_plan).items():
        head, _, rest = pattern.partition(".")
        if head != stack:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} names blocks other than "
                             f"the model's ({blocks})")
        for i in stage.block_indices:
            path = f"{blocks}.{i}.{rest[2:]}"
            if _holds(stage, path):
                out[path] = style
    return out


def shard_stage(stage: nn.Module, config: PretrainedConfig, group: Any,
                device: torch.device, sequence_parallel: bool = False) -> TensorParallelShards:
    """Shard ``stage``'s blocks over ``group`` (the replica's ranks, every rank of it calls
    this) as the model's tensor-parallel plan says, sequence parallel where asked, and the LM
    head of a last stage where :func:`head_is_sharded`; the stage is changed in place."""
    import torch.distributed as dist
    t = dist.get_world_size(group)
    problem = tp_plan_refusal(config, t)
    if problem is None and sequence_parallel:
        unit = next(iter(getattr(stage, "chunks", {0: stage}).values())).layer_unit
        problem = sequence_parallel_refusal(config, t, unit)
    if problem is not None:
        raise ValueError(problem)
    mesh = DeviceMesh.from_group(group, device.type)
    plan = stage_tp_plan(stage, config)
    styles = {path: _style(style) for path, style in plan.items() if style != REPLICATED_GRAD_SUM}
    partial = _partial_parameters(stage, plan)
    if sequence_parallel:
        styles.update(_sequence_parallel_styles(stage))
        partial += _block_norm_parameters(stage)
    head = bool(getattr(stage, "is_last", False)) and head_is_sharded(config, t) \
        and _holds(stage, HEAD_MODULE)
    if head:
        # the logits stay split on the vocabulary: the loss is taken on each rank's columns
        style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        style.src_data_rank = None  # every rank holds the same weights
        styles[HEAD_MODULE] = style
    if styles:
        parallelize_module(stage, mesh, styles)
    if sequence_parallel:
        for chunk in getattr(stage, "chunks", {0: stage}).values():
            _split_sequence_around_blocks(chunk, mesh)
            for i in chunk.block_indices:
                for name in ("self_attn", "mlp"):
                    _keep_gathered_input_split(
                        chunk, chunk.get_submodule(f"{chunk.adapter.blocks_path}.{i}.{name}"), mesh,
                        i, "attn" if name == "self_attn" else "mlp")
    return TensorParallelShards(mesh, group, dist.get_rank(group), t, tuple(styles), partial,
                                sequence_parallel, head)


def _sequence_parallel_styles(stage: nn.Module) -> dict[str, ParallelStyle]:
    """What sequence parallelism adds to each block of the stage (torchtitan's llama plan
    without ``SequenceParallel`` on the norms, which stay plain): the attention's and the
    MLP's inputs gathered from the sequence slices, ``o_proj``'s and ``down_proj``'s outputs
    reduce-scattered onto them."""
    out: dict[str, ParallelStyle] = {}
    for i in stage.block_indices:
        b = f"{stage.adapter.blocks_path}.{i}"
        out[f"{b}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()})
        out[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                             desired_input_layouts=(Replicate(),))
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            style = RowwiseParallel(output_layouts=Shard(1))
            style.src_data_rank = None
            out[f"{b}.{proj}"] = style
    return out


class _GatheredInput:
    """One attention or MLP call's all-gathered input, kept for the backward as this rank's
    sequence slice (what the call's own pre-hook saw before ``PrepareModuleInput``) and
    gathered again when the backward unpacks it, as Megatron-LM does: the projections save the
    gathered input for their weight gradients, which would hold ``s`` tokens on every rank."""

    def __init__(self, mesh: DeviceMesh, shard: Tensor) -> None:
        self.mesh, self.shard = mesh, shard
        self.storage: int | None = None
        self.whole: Tensor | None = None
        self.pending = 0
        self.outer: tuple[Any, Any] | None = None
        """The saved-tensor hooks in force around the call, given the tensors left alone."""

    def pack(self, t: Tensor) -> Any:
        with torch.no_grad():
            local = local_tensor(t)
        if self.storage is None or local.untyped_storage().data_ptr() != self.storage:
            return t if self.outer is None else _Outer(self.outer[0](t), self.outer[1])
        self.pending += 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _Packed(self, spec, local.size(), local.stride(), local.storage_offset())

    def gathered(self) -> Tensor:
        """The whole input again (an all-gather over the replica; every rank's backward
        unpacks the same tensors in the same order), kept while other saved views of it wait."""
        whole = self.whole
        if whole is None:
            whole = DTensor.from_local(self.shard, self.mesh, [Shard(1)], run_check=False) \
                .redistribute(self.mesh, [Replicate()]).to_local()
        self.pending = max(0, self.pending - 1)
        self.whole = whole if self.pending else None
        return whole


@dataclass(frozen=True)
class _Packed:
    source: _GatheredInput
    spec: Any
    size: Any
    stride: Any
    offset: int


@dataclass(frozen=True)
class _Outer:
    packed: Any
    unpack: Any


def _unpack(saved: Any) -> Tensor:
    if isinstance(saved, _Outer):
        return saved.unpack(saved.packed)
    if not isinstance(saved, _Packed):
        return saved
    local = saved.source.gathered().as_strided(saved.size, saved.stride, saved.offset)
    if saved.spec is None:
        return local
    mesh, placements, shape, stride = saved.spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _keep_gathered_input_split(stage: nn.Module, module: nn.Module, mesh: DeviceMesh, block: int,
                               half: str) -> None:
    """Around each call of ``module`` (an attention or MLP whose input ``PrepareModuleInput``
    all-gathers; the ``half`` of block ``block``), while it builds its backward: tensors saved
    that are views of the gathered input are kept as the rank's slice (:class:`_GatheredInput`).
    Not where that half recomputes its activations (which keeps no such tensor) nor without
    gradients."""
    state: dict[str, Any] = {}

    def first(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_grad_enabled() and not stage.recomputes(block, half) and isinstance(hidden, Tensor):
            state["source"] = _GatheredInput(mesh, local_tensor(hidden).detach())

    def gathered(module: nn.Module, args: tuple, kwargs: dict) -> None:
        source = state.get("source")
        if source is None:
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        source.storage = local_tensor(hidden).untyped_storage().data_ptr()
        # what the hooks in force (the step's shared weight casts) did with the other tensors
        source.outer = saved_tensors_hooks_in_force()
        hooks = torch.autograd.graph.saved_tensors_hooks(source.pack, _unpack)
        hooks.__enter__()
        state["hooks"] = hooks

    def done(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hooks = state.pop("hooks", None)
        state.pop("source", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(first, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(gathered, with_kwargs=True)
    module.register_forward_hook(done, with_kwargs=True, always_call=True)


def _block_norm_parameters(stage: nn.Module) -> tuple[nn.Parameter, ...]:
    """The block norms' parameters: under sequence parallelism each rank's gradient comes from
    its tokens only."""
    out: dict[int, nn.Parameter] = {}
    for i in stage.block_indices:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = stage.get_submodule(f"{stage.adapter.blocks_path}.{i}.{name}")
            out.update((id(p), p) for p in norm.parameters() if p.requires_grad)
    return tuple(out.values())


def _split_sequence_around_blocks(stage: nn.Module, mesh: DeviceMesh) -> None:
    """Hooks that keep this rank's slice of the sequence on entering the stage's first block
    and gather the whole sequence on leaving its last (each the other's backward)."""
    if not stage.block_indices:
        return
    t = mesh.size()

    def split(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] % t:
            raise ValueError(f"a sequence-parallel stage splits the sequence over its {t} "
                             f"tensor-parallel ranks, and a batch's sequence length is "
                             f"{hidden.shape[1]}; pad sequences to a multiple of {t}")
        local = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False) \
            .redistribute(mesh, [Shard(1)]).to_local()
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": local}

    def gather(module: nn.Module, args: tuple, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        whole = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False) \
            .redistribute(mesh, [Replicate()]).to_local()
        return (whole, *output[1:]) if isinstance(output, tuple) else whole

    first, last = (stage.get_submodule(f"{stage.adapter.blocks_path}.{i}")
                   for i in (stage.block_indices[0], stage.block_indices[-1]))
    first.register_forward_pre_hook(split, with_kwargs=True)
    last.register_forward_hook(gather)


def _partial_parameters(stage: nn.Module, plan: dict[str, str]) -> tuple[nn.Parameter, ...]:
    """The whole parameters that see only this rank's part of a sharded activation, so whose
    gradient is summed over the replica: those of modules the plan marks
    ``replicated_with_grad_allreduce``, and of every module that sits beside a sharded
    projection (a child of the same module: a per-head ``q_norm`` beside ``q_proj``, Apertus'
    learnable MLP activation, unmarked in its plan, beside ``up_proj``). Modules beside the
    attention and MLP themselves (the block's norms) see the whole residual stream."""
    sharded = {p for p, style in plan.items() if style != REPLICATED_GRAD_SUM}
    modules = {p for p, style in plan.items() if style == REPLICATED_GRAD_SUM}
    for path in sharded:
        parent = path.rpartition(".")[0]
        modules |= {f"{parent}.{name}" for name, _ in stage.get_submodule(parent).named_children()
                    if f"{parent}.{name}" not in sharded}
    out: dict[int, nn.Parameter] = {}
    for path in sorted(modules):
        out.update((id(p), p) for p in stage.get_submodule(path).parameters() if p.requires_grad)
    return tuple(out.values())


def _style(name: str) -> ParallelStyle:
    style: ParallelStyle = ColwiseParallel() if name == COLWISE else RowwiseParallel()
    # every rank holds the same weights: each keeps its own slice, nothing is scattered
    style.src_data_rank = None
    return style


def _holds(stage: nn.Module, path: str) -> bool:
    try:
        stage.get_submodule(path)
    except AttributeError:
        return False
    return True


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` (a parameter or a gradient) is split among the replica's ranks: a DTensor
    placed as shards (a row-wise projection's bias is a DTensor too, but whole on every rank)."""
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view that writes through),
    ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with every shard gathered into its whole tensor (a collective over the
    replica's ranks for each sharded tensor: every rank of the replica calls it), detached."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in state.items()}
