"""The generic stage adapter: any decoder-only causal LM, its parts found through the model itself.

A transformers causal LM is ``XForCausalLM(base model, lm_head)`` whose base model holds the
input embedding, one ``nn.ModuleList`` of decoder layers, the final norm and the rotary module.
Rather than re-write each family's forward, a stage runs the model's OWN code around its layers:

- **Prologue** (embedding, embedding norm or scaling, position ids, masks per layer type, rotary
  embeddings, ALiBi): the base model's forward is run with its layer list replaced by recorders.
  Recorder ``i`` keeps the arguments the forward hands layer ``i`` (its mask kind, position
  embeddings, ...) and the run stops after the last layer the stage needs. On the first stage
  the hidden state layer 0 receives is the embedding's output; other stages feed a stand-in of
  the incoming hidden state's shape and dtype (only masks and rotary tables are taken from that
  run) and base-model modules the stage does not own run as identities.
- **Layers** are then called with exactly those arguments (the KV cache dropped, ``use_cache``
  off). Parallel blocks (GPT-J, GPT-NeoX, Falcon, Phi) and MoE blocks run inside the layer.
- **Epilogue**: the modules the base model registers after the layer list (the final norm), in
  order (one holding no tensors also stays in the prologue's run, where a forward may call it
  before the layers too); then the causal-LM forward itself with its base model replaced by the normed hidden
  state, so the LM head and whatever follows it (Gemma 2's logit soft-capping, Granite's logit
  scaling, Cohere's logit scale) are the model's own code.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Cache, PretrainedConfig
from transformers.modeling_outputs import MoeModelOutputWithPast

from hapt_hf.compat.transformers_api import init_module_buffers
from hapt_hf.errors import StageBuildError
from hapt_hf.pipeline.config_checks import refusal
from hapt_hf.pipeline.families import BlockInputs, FamilyAdapter

__all__ = ["GenericAdapter", "generic_adapter"]

_HALF_BLOCK = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class _Stop(Exception):
    """Raised by the last recorder a stage needs: the rest of the base forward is not run."""


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index``: records the arguments the base forward passes it."""

    def __init__(self, index: int, log: dict, stop_at: list[int]) -> None:
        super().__init__()
        self.index, self.log, self.stop_at = index, log, stop_at

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        self.log[self.index] = (hidden, args, kwargs)
        if self.index >= self.stop_at[0]:
            raise _Stop
        # A 1-tuple serves both conventions: `outputs[0]` and passing the result to the next layer.
        return (hidden if isinstance(hidden, Tensor) else hidden[0],)


class _Identity(nn.Module):
    """A base-model module this stage does not own, run on a non-first stage's stand-in input.

    A hidden state (a float tensor of 3 or more dimensions: norms, scalings) passes through.
    Anything else is a term computed from ids, masks or positions (learned or sinusoidal position
    embeddings, BioGPT, GPT-BigCode, XGLM) that the forward adds to the stand-in, whose value a
    non-first stage never uses: a zero scalar adds to any hidden state. A [b, s] float mask is
    such a term (BioGPT makes one of ones when the batch has no mask)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, Tensor) or (x.is_floating_point() and x.dim() >= 3):
            return x
        return torch.zeros((), device=x.device)


class _BaseOutput(MoeModelOutputWithPast):
    """The base model's output as the causal-LM forward reads it: the hidden state, and None for
    every other field it copies through (router logits, cross attentions, shared KV states)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Given(nn.Module):
    """Stands in for the base model inside the causal-LM forward: returns the stage's hidden."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> MoeModelOutputWithPast:
        return _BaseOutput(last_hidden_state=self.hidden)


@dataclass(frozen=True)
class _Shells:
    """The full model's own objects a stage runs its prologue and head through (not submodules
    of the stage: their parameters are the stage's own modules, set again before each call)."""

    base: nn.Module
    lm: nn.Module
    given: _Given
    log: dict = field(default_factory=dict)
    stop_at: list = field(default_factory=lambda: [0])


@dataclass(frozen=True)
class GenericAdapter(FamilyAdapter):
    """A family adapter read off a built model (see the module docstring).

    Args (beyond FamilyAdapter's):
        base_path: attribute of the causal LM holding the base model ("model", "transformer").
        prologue_names / epilogue_names: base-model children registered before / after the
            layer list (embedding first; final norm), other than rotary modules.
        rotary_names: base-model children computing rotary tables.
    """

    base_path: str = ""
    prologue_names: tuple[str, ...] = ()
    epilogue_names: tuple[str, ...] = ()
    rotary_names: tuple[str, ...] = ()
    shells: _Shells | None = None

    def position_ids(self, x: Tensor, attention_mask: Tensor | None) -> Tensor | None:
        return None  # the base forward derives them, as in the full model

    def embed(self, root, input_ids, position_ids, attention_mask):
        return self._prologue(root, input_ids, attention_mask, position_ids, [0])[0][0]

    def attention_kind(self, config, block_index):
        return block_index  # the recorded arguments are keyed by layer index

    def block_inputs(self, root, config, hidden, attention_mask, position_ids, block_indices):
        log = self._prologue(root, hidden, attention_mask, position_ids, list(block_indices))
        return BlockInputs(position_ids=position_ids, masks=log, position_embeddings=None)

    def run_block(self, block, hidden, inputs, mask_kind):
        _, args, kwargs = inputs.masks[mask_kind]
        out = block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out  # OpenAI GPT: a list

    def run_attention_half(self, block, hidden, inputs, mask_kind, config):
        _, args, kwargs = inputs.masks[mask_kind]
        attn_output, _ = block.self_attn(hidden_states=block.input_layernorm(hidden), **kwargs)
        return hidden + attn_output

    def head(self, root, hidden):
        for name in self.epilogue_names:
            hidden = root.get_submodule(f"{self.base_path}.{name}")(hidden)
        shells = self.shells
        head_path = self.output_embedding_key.rpartition(".")[0]
        shells.lm.register_module(head_path, root.get_submodule(head_path))
        shells.given.hidden = hidden
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            return shells.lm(input_ids=ids, use_cache=False, return_dict=True).logits
        finally:
            shells.given.hidden = None

    def _prologue(self, root: nn.Module, x: Tensor, attention_mask: Tensor | None,
                  position_ids: Tensor | None, needed: list[int]) -> dict:
        """Run the base forward up to layer max(needed); the arguments each layer received."""
        shells = self.shells
        base = shells.base
        for name in (*self.prologue_names, *self.rotary_names):
            path = f"{self.base_path}.{name}"
            owned = _has(root, path)
            base.register_module(name, root.get_submodule(path) if owned else _Identity())
        _follow_stage(base, root, x.device)
        shells.log.clear()
        shells.stop_at[0] = max(needed)
        first = not x.is_floating_point()
        # a non-first stage feeds a stand-in: a prologue written in place must not touch x
        inputs = {"input_ids": x} if first else {"inputs_embeds": torch.zeros_like(x)}
        try:
            base(**inputs, attention_mask=attention_mask, position_ids=position_ids)
        except _Stop:
            pass
        return {i: _clean(shells.log[i]) for i in needed}

    def check_config(self, config):
        return refusal(config)


def _clean(entry: tuple) -> tuple:
    """The recorded call without the KV cache: stages never keep one."""
    hidden, args, kwargs = entry
    kwargs = {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    args = tuple(None if isinstance(a, Cache) else a for a in args)
    return hidden, args, kwargs


def generic_adapter(full: nn.Module) -> GenericAdapter:
    """Read the layer sequence off ``full`` (a causal LM, typically built on the meta device).

    Raises StageBuildError naming why the model is not one embedding, one stack of decoder
    layers and one LM head.
    """
    config = full.config
    if getattr(config, "is_encoder_decoder", False):
        raise StageBuildError(f"{config.model_type!r} is an encoder-decoder model; only decoder-only "
                              "causal LMs can be cut into pipeline stages")
    base_path = getattr(full, "base_model_prefix", "")
    base = getattr(full, base_path, None) if base_path else None
    if not isinstance(base, nn.Module):
        raise StageBuildError(f"{type(full).__name__} has no base model at .{base_path}; the stage "
                              "builder needs the causal LM's base model to find its layers")
    stack = _layer_stack(full, base)
    children = list(base.named_children())
    at = [n for n, _ in children].index(stack)
    embed_path = _path_of(full, full.get_input_embeddings(), "input embedding")
    head_path = _path_of(full, full.get_output_embeddings(), "output embedding (LM head)")
    rotary = tuple(n for n, m in children if _is_rotary(m))
    if len(rotary) > 1:
        raise StageBuildError(f"{type(base).__name__} holds {len(rotary)} rotary modules {rotary}; "
                              "the stage builder rebuilds one")
    prologue = tuple(n for n, _ in children[:at] if n not in rotary)
    epilogue = tuple(n for n, _ in children[at + 1:] if n not in rotary)
    _check_lm_children(full, base_path, head_path)
    block = base.get_submodule(f"{stack}.0")
    halves = ("input_layernorm", "self_attn") if _llama_block(block) else None
    return GenericAdapter(
        name=config.model_type, model_types=(config.model_type,),
        embedding_paths=tuple(f"{base_path}.{n}" for n in prologue),
        blocks_path=f"{base_path}.{stack}",
        head_paths=(*(f"{base_path}.{n}" for n in epilogue), head_path),
        rotary_path=f"{base_path}.{rotary[0]}" if rotary else None, input_embedding_key=f"{embed_path}.weight",
        output_embedding_key=f"{head_path}.weight",
        attention_half=halves, mlp_half=("post_attention_layernorm", "mlp") if halves else None,
        base_path=base_path, prologue_names=prologue, epilogue_names=epilogue, rotary_names=rotary,
        half_refusal="" if halves else _half_refusal(config, block))


def bind_shells(adapter: GenericAdapter, full: nn.Module) -> GenericAdapter:
    """The adapter with the full model's own objects, emptied, as the shells it runs through.

    Called once the stage has kept its modules: the full model's base loses its layers (and
    the causal LM its base), so nothing but the stage's modules stays alive.
    """
    base = full.get_submodule(adapter.base_path)
    shells = _Shells(base=base, lm=full, given=_Given())
    # tensors of the base model itself run in its forward (OpenAI GPT's position ids, CTRL's
    # sinusoidal table); some forwards read the model's dtype off its first parameter, which a
    # stage owning none of the base's modules would not give it: an empty one stands for them
    fill_module_buffers(base, full)
    dtype = next(full.parameters()).dtype
    base.register_parameter("_stage_dtype", nn.Parameter(torch.empty(0, dtype=dtype),
                                                         requires_grad=False))
    stack = adapter.blocks_path.rpartition(".")[2]
    n = len(base.get_submodule(stack))
    base.register_module(stack, nn.ModuleList(_Recorder(i, shells.log, shells.stop_at) for i in range(n)))
    for name in adapter.epilogue_names:
        if not _stateless(base.get_submodule(name)):
            base.register_module(name, _Identity())
    full.register_module(adapter.base_path, shells.given)
    for name, _ in list(full.named_children()):
        if name != adapter.base_path:
            full.register_module(name, _Identity())
    return replace(adapter, shells=shells)


def _stateless(module: nn.Module) -> bool:
    """Whether ``module`` holds no tensors (a norm without weights): the shell keeps it, so a
    base forward that also calls it before the layers (NanoChat norms the embedding with its
    final norm) runs it in the prologue as the full model does."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def fill_module_buffers(module: nn.Module, full: nn.Module) -> None:
    """``module``'s own buffers left on meta, on the CPU and computed as ``full``'s
    initialisation computes them (GPT-J's position table, OpenAI GPT's position ids)."""
    metas = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
    if not metas:
        return
    for name in metas:
        old = module.get_buffer(name)
        module.register_buffer(name, torch.empty(old.shape, dtype=old.dtype), persistent=False)
    init_module_buffers(full, module)


def _follow_stage(base: nn.Module, stage: nn.Module, device: torch.device) -> None:
    """Give the shell's base the stage's device and parameter dtype (a shell is not a submodule
    of the stage, so moving or casting the stage leaves its tensors as they were)."""
    for name, buf in list(base.named_buffers(recurse=False)):
        if buf.device != device:
            base.register_buffer(name, buf.to(device), persistent=False)
    dtype = next((p.dtype for p in stage.parameters() if p.is_floating_point()), None)
    if dtype is not None and base._stage_dtype.dtype != dtype:
        base._stage_dtype = nn.Parameter(base._stage_dtype.to(dtype), requires_grad=False)


def _layer_stack(full: nn.Module, base: nn.Module) -> str:
    """The base model's one ModuleList of decoder layers, by name."""
    n = getattr(full.config, "num_hidden_layers", None)
    lists = [(name, m) for name, m in base.named_children() if isinstance(m, nn.ModuleList)]
    stacks = [name for name, m in lists if len(m) == n]
    if len(stacks) != 1 or len(lists) != 1:
        raise StageBuildError(
            f"{type(base).__name__} does not hold exactly one list of {n} decoder layers "
            f"(module lists: {[(name, len(m)) for name, m in lists]}); the stage builder cuts "
            "models made of one layer stack only")
    return stacks[0]


def _path_of(full: nn.Module, module: nn.Module | None, what: str) -> str:
    for name, m in full.named_modules():
        if m is module and name:
            return name
    raise StageBuildError(f"{type(full).__name__} reports no {what} module; the stage builder needs it")


def _check_lm_children(full: nn.Module, base_path: str, head_path: str) -> None:
    """The causal LM must be the base model plus the LM head: anything else runs in its forward
    in ways the stage cannot place (a second tower, a vision encoder, a value head)."""
    extra = [n for n, _ in full.named_children() if n not in (base_path, head_path)]
    if extra:
        raise StageBuildError(
            f"{type(full).__name__} holds modules besides its base model and LM head ({extra}); "
            "the stage builder cuts one embedding, one layer stack and one head only")


def _is_rotary(module: nn.Module) -> bool:
    return "rotary" in type(module).__name__.lower()


def _llama_block(block: nn.Module) -> bool:
    """Whether the block's forward is the pre-norm attention residual then MLP residual (the
    LLaMA block, verbatim), so that it can be cut exactly after the attention residual."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    if not all(hasattr(block, n) for n in _HALF_BLOCK):
        return False
    try:
        return inspect.getsource(type(block).forward) == inspect.getsource(LlamaDecoderLayer.forward)
    except (OSError, TypeError):
        return False


def _half_refusal(config: PretrainedConfig, block: nn.Module) -> str:
    norms = [n for n, m in block.named_children() if "norm" in type(m).__name__.lower()]
    if len(norms) == 1 or getattr(config, "use_parallel_residual", False) \
            or getattr(config, "parallel_attn", False):
        return "its attention and MLP run in parallel on the block's input, so no cut point lies between them"
    return (f"{type(block).__name__}'s forward is not the pre-norm attention residual followed by the "
            "MLP residual, the only shape cut in two")


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False
