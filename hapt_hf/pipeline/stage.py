"""One rank's pipeline stage of a Hugging Face causal LM.

The layer sequence is `[embedding, block_0 .. block_{N-1}, head]` (`layer_unit="block"`) or, with
every block cut in two, `[embedding, b0.attn, b0.mlp, b1.attn, ..., head]` (`layer_unit="half"`);
a stage owns the half-open range `layer_range` of it. The stage holds the full model's own modules
(GPT2Block, LlamaDecoderLayer, the rotary module, final norm, LM head) under the full model's module
paths, so its `state_dict()` keys are the full model's keys and its numerics are the full model's.
Of a block cut between two stages, each holds only its half's submodules (norm and attention, or
norm and MLP) under their full paths, and runs them in the order the block's own forward does.
Without a checkpoint its weights come from a replay of the full model's seeded initialisation
(:mod:`hapt_hf.pipeline.init_replay`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PretrainedConfig

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.compat.moe_autocast import cast_index_add_sources
from hapt_hf.compat.transformers_api import causal_lm_loss_sum
from hapt_hf.core.families import generic_refusal
from hapt_hf.core.layers import BLOCK, HALF, LAYER_UNITS, BlockPart, block_parts, num_layers
from hapt_hf.errors import HaptError, StageBuildError
from hapt_hf.pipeline import checkpoint_io, init_replay
from hapt_hf.pipeline.config_checks import refusal
from hapt_hf.pipeline.generic import GenericAdapter, bind_shells, fill_module_buffers, generic_adapter
from hapt_hf.pipeline.families import FamilyAdapter, adapter_for, num_blocks, supported_families
from hapt_hf.pipeline.vocab_parallel import is_vocab_sharded, vocab_parallel_loss_sum

__all__ = ["BlockPart", "PipelineStage", "RankStages", "StageBuildError", "StageInputError",
           "build_stage", "supported_families"]

class StageInputError(HaptError):
    """A forward call whose inputs do not fit the stage (token ids vs hidden states)."""


class PipelineStage(nn.Module):
    """The modules of one layer range, run exactly as the full model runs them.

    Attributes:
        layer_range: half-open range over the layer sequence of `layer_unit`.
        layer_unit: 'block' or 'half' (each block is two layers: attention half, MLP half).
        is_first: owns the embedding (its input is token ids).
        is_last: owns the final norm and LM head (it returns the summed loss, or logits).
        parts: the blocks, or block halves, this stage runs, in order.
        block_indices: indices of the transformer blocks this stage runs all or half of.
        recompute: every block (or half) recomputes its activations in the backward.
        recompute_layers: without `recompute`, how many of the stage's first block units (of
            `layer_unit`) do (plan.json `recompute_layers`); the rest keep their activations.
    """

    def __init__(self, config: PretrainedConfig, adapter: FamilyAdapter, layer_range: tuple[int, int],
                 modules: list[tuple[str, nn.Module]], recompute: bool = False,
                 layer_unit: str = BLOCK, recompute_layers: int = 0) -> None:
        super().__init__()
        n = num_blocks(config)
        self.config = config
        self.adapter = adapter
        self.layer_range = layer_range
        self.layer_unit = layer_unit
        self.is_first = layer_range[0] == 0
        self.is_last = layer_range[1] == num_layers(n, layer_unit)
        self.parts = block_parts(layer_range, n, layer_unit)
        self.block_indices = range(self.parts[0].index, self.parts[-1].index + 1) if self.parts \
            else range(0)
        self.recompute = recompute
        self.recompute_layers = recompute_layers
        for path, module in modules:
            _attach(self, path, module)

    def forward(self, x: Tensor, *, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """Run this stage.

        First stage: `x` is input_ids [b, s]; otherwise hidden states [b, s, h]. A non-last stage
        returns hidden states [b, s, h]. The last stage returns the SUM of the per-token
        cross-entropy over tokens whose shifted label is not -100 (0-dim), so the caller divides by
        the token count of the whole global batch; `labels` are un-shifted (HF convention). Without
        labels the last stage returns the logits [b, s, vocab]. `attention_mask` is the [b, s]
        padding mask; `position_ids` default to what the full model derives (0..s-1 for GPT-2 and
        LLaMA-shaped models, counted over the padding mask for OPT).
        """
        self._check_input(x)
        if position_ids is None:
            position_ids = self.adapter.position_ids(x, attention_mask)
        hidden = self.adapter.embed(self, x, position_ids, attention_mask) if self.is_first else x
        if self.parts:
            # a stage holding only an MLP half needs no mask nor rotary embedding
            attending = [p.index for p in self.parts if p.part != "mlp"]
            inputs = self.adapter.block_inputs(self, self.config, hidden, attention_mask, position_ids,
                                               attending) if attending else None
            for part in self.parts:
                hidden = self._run_part(part, hidden, inputs)
        if not self.is_last:
            return hidden
        logits = self.adapter.head(self, hidden)
        if labels is None:  # a head split by vocabulary rows: its logits gathered whole
            return logits.full_tensor() if is_vocab_sharded(logits) else logits
        return self.loss_sum(logits, labels)

    def loss_sum(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The last stage's loss: the SUM of the per-token cross-entropy over tokens whose shifted
        label is not -100 (0-dim), from its logits and the un-shifted `labels`; logits split on
        the vocabulary over a replica's ranks (:mod:`~hapt_hf.pipeline.vocab_parallel`) are
        never gathered."""
        return _loss_sum(logits, labels, self.config.vocab_size)

    def tied_parameters(self) -> list[nn.Parameter]:
        """Parameters tied across the first and last stage, when they sit on different stages.

        The runtime sums their gradients between those two stages; [] when the embeddings are not
        tied, or when this stage holds neither end or both ends (then they are one Parameter).
        """
        if not getattr(self.config, "tie_word_embeddings", False) or self.is_first == self.is_last:
            return []
        key = self.adapter.input_embedding_key if self.is_first else self.adapter.output_embedding_key
        return [self.get_parameter(key)]

    def hf_state_dict(self) -> dict[str, Tensor]:
        """This stage's weights under the full model's state_dict keys (tied LM head included)."""
        return dict(self.state_dict())

    def recomputes(self, block: int, half: str) -> bool:
        """Whether the ``half`` ('attn' or 'mlp') of block ``block`` recomputes its activations
        in the backward: under `recompute` every one; else those among the stage's first
        `recompute_layers` block units (a whole block is one unit under `layer_unit` 'block')."""
        if self.recompute:
            return True
        if not self.recompute_layers:
            return False
        layer = 1 + block if self.layer_unit == BLOCK else 1 + 2 * block + (half == "mlp")
        return layer - max(self.layer_range[0], 1) < self.recompute_layers

    def _run_part(self, part: BlockPart, hidden: Tensor, inputs) -> Tensor:
        if part.part == "full" and self.recomputes(part.index, "attn") != \
                self.recomputes(part.index, "mlp"):
            # partial recompute ending inside a block (half units): its two halves, each as it
            # says, as a stage cut between them runs them
            for half in ("attn", "mlp"):
                hidden = self._run_part(BlockPart(part.index, half), hidden, inputs)
            return hidden
        block = self.get_submodule(f"{self.adapter.blocks_path}.{part.index}")
        if part.part == "mlp":
            run, args = self.adapter.run_mlp_half, (block, hidden, self.config)
        else:
            kind = self.adapter.attention_kind(self.config, part.index)
            run, args = self.adapter.run_block, (block, hidden, inputs, kind)
            if part.part == "attn":
                run, args = self.adapter.run_attention_half, (*args, self.config)
        if self.recomputes(part.index, "mlp" if part.part == "mlp" else "attn") and \
                torch.is_grad_enabled():
            # Keep only the block's input; recompute its inside during backward.
            return checkpoint(run, *args, use_reentrant=False)
        return run(*args)

    def _check_input(self, x: Tensor) -> None:
        if self.is_first and (x.ndim != 2 or x.is_floating_point()):
            raise StageInputError(
                f"stage {self.layer_range} is the first stage: x must be input_ids, an integer "
                f"tensor [batch, seq]; got dtype {x.dtype} with shape {tuple(x.shape)}"
            )
        if not self.is_first and (x.ndim != 3 or not x.is_floating_point()):
            raise StageInputError(
                f"stage {self.layer_range} is not the first stage: x must be hidden states, a float "
                f"tensor [batch, seq, hidden]; got dtype {x.dtype} with shape {tuple(x.shape)}"
            )


class RankStages(nn.Module):
    """The stages one rank holds under an interleaved schedule, presented as one module: every
    chunk's modules under the full model's paths (its ``state_dict()`` keys and parameters are
    the union of the chunks', each once), so what treats a rank's stage as one module (the
    optimizer, the gradient sums, checkpoints, the gathered state dict) sees the rank's part
    of the model. The chunks themselves run the forwards (:attr:`chunks`, by stage index).

    A module two chunks both hold (LLaMA's rotary embedding: buffers computed from the config,
    the same in each) is attached once; one holding parameters cannot be held twice."""

    def __init__(self, chunks: dict[int, PipelineStage]) -> None:
        super().__init__()
        first = next(iter(chunks.values()))
        self.config, self.adapter = first.config, first.adapter
        self.__dict__["chunks"] = dict(chunks)  # not submodules: their modules are attached below
        for chunk in chunks.values():
            for path, module in chunk.named_children():
                for sub_path, sub in _leaves(path, module):
                    _attach_once(self, sub_path, sub)
        self.is_first = any(c.is_first for c in chunks.values())
        self.is_last = any(c.is_last for c in chunks.values())

    @property
    def recompute(self) -> bool:
        return all(c.recompute for c in self.chunks.values())

    @recompute.setter
    def recompute(self, value: bool) -> None:
        for c in self.chunks.values():
            c.recompute = value

    @property
    def layer_range(self) -> tuple[tuple[int, int], ...]:
        """Each chunk's layer range, in pipeline order."""
        return tuple(c.layer_range for c in self.chunks.values())

    @property
    def block_indices(self) -> tuple[int, ...]:
        """The blocks any chunk runs all or half of, in order."""
        return tuple(sorted({i for c in self.chunks.values() for i in c.block_indices}))

    def forward(self, *args, **kwargs):  # noqa: D102 - the chunks run, each on its own
        raise TypeError("a rank's interleaved stages run chunk by chunk (RankStages.chunks), "
                        "not as one module")

    def tied_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks.values() for p in c.tied_parameters()]

    def hf_state_dict(self) -> dict[str, Tensor]:
        return dict(self.state_dict())

    def loss_sum(self, logits: Tensor, labels: Tensor) -> Tensor:
        return _loss_sum(logits, labels, self.config.vocab_size)


def _loss_sum(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    if is_vocab_sharded(logits):
        return vocab_parallel_loss_sum(logits, labels)
    return causal_lm_loss_sum(logits, labels, vocab_size)


def _leaves(path: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a chunk placed at ``path`` (through its ModuleDict containers): the
    containers of ``_attach`` are walked, a model's own module is a leaf."""
    if type(module) is not nn.ModuleDict:
        return [(path, module)]
    return [leaf for name, child in module.named_children()
            for leaf in _leaves(f"{path}.{name}", child)]


def _attach_once(root: nn.Module, path: str, module: nn.Module) -> None:
    try:
        held = root.get_submodule(path)
    except AttributeError:
        _attach(root, path, module)
        return
    if held is not module and any(True for _ in module.parameters()):
        raise StageBuildError(f"two stages of one rank both hold module {path!r} with "
                              "parameters; an interleaved plan gives each layer to one stage")


def build_stage(
    config: PretrainedConfig,
    layer_range: tuple[int, int],
    *,
    seed: int | None = 0,
    init_weights: bool = True,
    checkpoint_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    recompute: bool = False,
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    layer_unit: str = BLOCK,
    unverified: bool = False,
    recompute_layers: int = 0,
) -> PipelineStage:
    """Build one rank's stage: built on meta, pruned to the stage, then materialised.

    With `checkpoint_dir`, only the stage's tensors are read from the safetensors checkpoint.
    Otherwise the stage's weights equal, bit for bit, the same layers of
    `torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)` (seed None: the current
    RNG state is used as is). `init_weights` False: the weights are allocated, not
    initialised, for a caller that reads every one of them next (a portable checkpoint's load);
    it skips the seeded initialisation, which replays the whole model's random draws on every
    rank. `attn_implementation` ("sdpa" by default, as the planner budgets)
    must match the reference the stage is compared with. `layer_unit="half"` reads `layer_range`
    over the sequence with every block cut in two, `[embedding, b0.attn, b0.mlp, b1.attn, ..., head]`.
    `recompute` recomputes every block's activations in the backward, `recompute_layers` the first
    that many block units' only.
    A type without a hand-written family must be verified (core/families.py) unless `unverified`.
    """
    adapter = _adapter(config, unverified)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise StageBuildError(f"attn_implementation {attn_implementation!r} is not supported; "
                              f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    if adapter is not None:
        _check_unit(layer_unit, adapter)
    span = _check_range(layer_range, config, layer_unit)
    config = copy.deepcopy(config)  # from_config writes attention and dtype settings into it
    try:
        if checkpoint_dir is not None or not init_weights:
            full = _meta_model(config, attn_implementation)
        else:
            rng_state = torch.get_rng_state()
            trace = init_replay.InitReplay(owned_ops=None)
            # the meta model the stage keeps its modules from; its config carries the attention
            full = init_replay.construct(config, trace, attn_implementation)
    except ValueError as err:  # transformers refuses an attention the model does not implement
        if "attention implementation" not in str(err):
            raise
        raise StageBuildError(
            f"config.model_type {config.model_type!r} does not support attn_implementation "
            f"{attn_implementation!r}; set attn_implementation to 'eager' (hapt config / plan)") from None
    if adapter is None:
        adapter = _generic(full, layer_unit)
    stage = PipelineStage(full.config, adapter, span, _stage_modules(full, adapter, span, layer_unit),
                          recompute, layer_unit, recompute_layers)
    if checkpoint_dir is not None or not init_weights:
        _materialise(stage)
        if checkpoint_dir is not None:
            _load_checkpoint(stage, checkpoint_dir)
    else:
        _seeded_init(stage, full, trace, seed, rng_state)
    _fill_computed_buffers(stage, full)
    if isinstance(adapter, GenericAdapter):
        # the emptied full model becomes the shell the stage runs the model's own forward through
        stage.adapter = bind_shells(adapter, full)
    del full  # only the stage's modules stay referenced
    _check_materialised(stage)
    to = torch.device(device)  # moved only if elsewhere: Module.to cannot swap fake tensors
    if any(t.device.type != to.type or to.index not in (None, t.device.index) or (
            t.is_floating_point() and t.dtype != dtype) for t in (*stage.parameters(), *stage.buffers())):
        stage.to(device=device, dtype=dtype)
    # Rotary frequencies stay float32, as from_config/from_pretrained(dtype=...) keep them.
    _rebuild_rotary(stage, device)
    cast_index_add_sources(stage)  # DBRX's experts: run under autocast as transformers' other MoEs
    return stage


def _fill_computed_buffers(stage: PipelineStage, full: nn.Module) -> None:
    """Non-persistent buffers left on meta (GPT-J's position table): computed as the model's own
    initialisation computes them (the rotary module is rebuilt separately)."""
    for _, module in stage.named_modules():
        fill_module_buffers(module, full)


def _check_materialised(stage: PipelineStage) -> None:
    left = [n for n, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"stage tensors left unmaterialised (a family adapter misses them): {left}")


def _adapter(config: PretrainedConfig, unverified: bool) -> FamilyAdapter | None:
    """The hand-written adapter of the config's family, or None: the generic one, read off the
    built model (:mod:`hapt_hf.pipeline.generic`), serves the verified causal LMs."""
    model_type = getattr(config, "model_type", None)
    adapter = adapter_for(model_type) if model_type else None
    problem = adapter.check_config(config) if adapter is not None else refusal(config)
    if problem is not None:
        raise StageBuildError(f"config.model_type {model_type!r} is not supported: {problem}"
                              if adapter is None else problem)
    problem = None if adapter is not None or unverified else generic_refusal(str(model_type))
    if problem is not None:
        raise StageBuildError(problem)
    return adapter


def _generic(full: nn.Module, layer_unit: str) -> GenericAdapter:
    try:
        adapter = generic_adapter(full)
    except StageBuildError as err:
        raise StageBuildError(
            f"config.model_type {full.config.model_type!r} is not supported: {err} (the accepted "
            "types are listed in docs/models.md)") from None
    _check_unit(layer_unit, adapter)
    return adapter


def _check_unit(layer_unit: str, adapter: FamilyAdapter) -> None:
    if layer_unit not in LAYER_UNITS:
        raise StageBuildError(f"layer_unit {layer_unit!r} is unknown; use one of {LAYER_UNITS}")
    if layer_unit == HALF and adapter.attention_half is None:
        raise StageBuildError(
            f"layer_unit 'half' is not supported for the {adapter.name} family (its blocks cannot "
            f"be cut in two exactly{_half_reason(adapter)}); use layer_unit 'block' (re-plan with "
            "whole blocks)")


def _half_reason(adapter: FamilyAdapter) -> str:
    return f": {adapter.half_refusal}" if adapter.half_refusal else ""


def _check_range(layer_range: tuple[int, int], config: PretrainedConfig,
                 layer_unit: str = BLOCK) -> tuple[int, int]:
    n = num_blocks(config)
    total = num_layers(n, layer_unit)
    try:
        start, end = (int(v) for v in layer_range)
    except (TypeError, ValueError):
        start, end = -1, -1
    if not 0 <= start < end <= total:
        body = f"blocks 1..{n}" if layer_unit == BLOCK else f"block halves 1..{2 * n}"
        raise StageBuildError(
            f"layer_range {layer_range!r} is invalid for a model of {n} blocks (layer_unit "
            f"{layer_unit!r}): give (start, end) with 0 <= start < end <= {total} over "
            f"[embedding=0, {body}, head={total - 1}]"
        )
    return (start, end)


def _meta_model(config: PretrainedConfig, attn_implementation: str) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _stage_modules(full: nn.Module, adapter: FamilyAdapter, span: tuple[int, int],
                   layer_unit: str = BLOCK) -> list[tuple[str, nn.Module]]:
    """The full model's modules this stage keeps, by their paths in the full model; of a block
    cut between two stages, each keeps only its half's submodules (no tensor is held twice)."""
    n = num_blocks(full.config)
    paths: list[str] = list(adapter.embedding_paths) if span[0] == 0 else []
    parts = block_parts(span, n, layer_unit)
    for part in parts:
        block = f"{adapter.blocks_path}.{part.index}"
        if part.part == "full":
            paths.append(block)
        else:
            names = adapter.attention_half if part.part == "attn" else adapter.mlp_half
            paths += [f"{block}.{name}" for name in names]
    if _attends(parts) and adapter.rotary_path is not None:
        paths.append(adapter.rotary_path)
    if span[1] == num_layers(n, layer_unit):
        paths += list(adapter.head_paths)
    # Optional modules a config leaves out (OPT's projections) are None in the full model.
    return [(p, full.get_submodule(p)) for p in paths if _present(full, p)]


def _attends(parts: tuple[BlockPart, ...]) -> bool:
    """Whether any of the parts runs attention (and so needs masks and the rotary module)."""
    return any(p.part != "mlp" for p in parts)


def _present(full: nn.Module, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return getattr(full.get_submodule(parent) if parent else full, name, None) is not None


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Place `module` at `path` under `root`, creating containers, so state_dict keys match."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = dict(node.named_children()).get(name)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


def _materialise(stage: PipelineStage) -> None:
    """Allocate the stage's tensors on CPU (uninitialised), keeping the tie and rotary buffers."""
    stage.to_empty(device="cpu")
    _retie(stage)
    _rebuild_rotary(stage)


def _retie(stage: PipelineStage) -> None:
    """to_empty gives each module its own tensor; re-share a tied LM head held on this stage."""
    if getattr(stage.config, "tie_word_embeddings", False) and stage.is_first and stage.is_last:
        head_path, _, name = stage.adapter.output_embedding_key.rpartition(".")
        setattr(stage.get_submodule(head_path), name, stage.get_parameter(stage.adapter.input_embedding_key))


def _rebuild_rotary(stage: PipelineStage, device: str | torch.device = "cpu") -> None:
    """Rotary buffers are computed, not stored: construct the module again (float32)."""
    path = stage.adapter.rotary_path
    if path is None or not _attends(stage.parts):
        return
    rotary_type = type(stage.get_submodule(path))
    _attach(stage, path, rotary_type(config=stage.config).to(device))


def _load_checkpoint(stage: PipelineStage, checkpoint_dir: str | Path) -> None:
    """Read only this stage's tensors from the checkpoint and copy them in."""
    try:
        checkpoint_io.load_stage_tensors(stage, checkpoint_dir)
    except checkpoint_io.CheckpointError as err:
        raise StageBuildError(str(err)) from None


def _seeded_init(stage: PipelineStage, traced: nn.Module, trace: init_replay.InitReplay,
                 seed: int | None, rng_state: Tensor) -> None:
    """Weights equal, bit for bit, to the same layers of a full model built under `seed`.

    `traced` is the full model built on meta under `trace`; :func:`init_replay.seeded_values`
    replays the seeded construction for the stage's tensors only (or, where it cannot, builds
    the full model on CPU once).
    """
    keys = set(stage.state_dict().keys())
    _adopt(stage, init_replay.seeded_values(stage.config, keys, traced, trace, seed, rng_state))
    _rebuild_rotary(stage)


def _adopt(stage: PipelineStage, values: dict[str, Tensor]) -> None:
    """Make `values` the stage's tensors in place of the meta ones, without a copy.

    Names that share one meta Parameter (a tie held on this stage) share one new Parameter.
    """
    made: dict[int, nn.Parameter] = {}
    for name, old in stage.state_dict(keep_vars=True).items():
        path, _, attr = name.rpartition(".")
        module = stage.get_submodule(path)
        if isinstance(old, nn.Parameter):
            if id(old) not in made:
                made[id(old)] = nn.Parameter(values[name].detach(), requires_grad=old.requires_grad)
            module.register_parameter(attr, made[id(old)])
        else:  # a persistent buffer (state_dict holds no other)
            module.register_buffer(attr, values[name].detach())
