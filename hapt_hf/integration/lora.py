"""LoRA on a pipeline stage through peft: adapters on this stage's attention projections.

peft's ``inject_adapter_in_model`` works on any module, so each rank adds adapters to its own
stage only. Every other weight is frozen; the optimizer (Trainer.create_optimizer) keeps only
trainable parameters. Before the final save the adapters are merged back into the base weights
and the peft wrappers removed, so the saved model is a plain Hugging Face checkpoint.
Intermediate checkpoints keep the adapters unmerged (peft's tensor names), which is what a
resume with the same ``--lora_r`` reads back.

Limitations: a stage must hold at least one adapted block unless it is the last stage, since
a stage whose every weight is frozen produces outputs that carry no gradient to send back; and
no stage may be tensor-parallel (an adapter beside a sharded projection would see the whole
input where the projection sees its shard: :func:`check_lora_plan` refuses such a plan on
every rank alike).
"""
from __future__ import annotations

from torch import nn

from hapt_hf.errors import ConfigError
from hapt_hf.planner.plan import Plan

__all__ = ["LoraSetupError", "apply_lora", "apply_lora_config", "check_lora_plan", "peft_parts",
           "adapter_state", "write_adapter", "merge_lora", "LORA_TARGETS"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraSetupError(ConfigError):
    """LoRA cannot be applied as asked; the message says why."""


def check_lora_plan(plan: Plan) -> None:
    """Refuse LoRA on a plan with a tensor-parallel stage (every rank reads the same plan, so
    every rank refuses alike)."""
    tp = [s.index for s in plan.stages if s.tp > 1]
    if tp:
        raise LoraSetupError(f"LoRA cannot train on this plan: stage(s) {tp} are tensor-parallel "
                             "(a replica held by several ranks), and LoRA adapters beside their "
                             "sharded projections are not supported; use a plan with one rank "
                             "per replica (planner option max_tp: 1), or train every weight")


def apply_lora(stage: nn.Module, r: int, alpha: int | None = None,
               targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Add LoRA adapters of rank ``r`` to the stage; returns the number of trainable params."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise LoraSetupError("--lora_r needs peft: pip install 'hapt_hf[lora]'") from None
    if r < 1:
        raise LoraSetupError(f"--lora_r is {r}; give a rank >= 1, or leave it out")
    present = {name.rsplit(".", 1)[-1] for name, _ in stage.named_modules()}
    if not _has_targets(stage, targets):
        return 0
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=0.0,
                        target_modules=[t for t in targets if t in present])
    inject_adapter_in_model(config, stage)
    return _freeze_all_but_lora(stage)


def _has_targets(stage: nn.Module, targets) -> bool:
    """Whether the stage holds a module to adapt; a last stage without one is frozen whole."""
    present = {name.rsplit(".", 1)[-1] for name, _ in stage.named_modules()}
    if present.intersection(targets):
        return True
    if getattr(stage, "is_last", False):
        _freeze_all_but_lora(stage)
        return False
    raise LoraSetupError(f"stage {getattr(stage, 'layer_range', '?')} has no {tuple(targets)} "
                         "module to adapt, so no gradient would leave it; give every non-last "
                         "stage at least one adapted block (re-plan with fewer stages)")


def peft_parts(model: nn.Module) -> tuple[object | None, nn.Module]:
    """(the active LoRA config, the transformers model inside) of a PEFT model; (None, model)
    for any other model. Only LoRA without ``modules_to_save`` is taken: another PEFT method
    is refused by name."""
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        return None, model
    name = getattr(model, "active_adapter", "default")
    config = model.peft_config[name]
    kind = type(config).__name__
    if kind != "LoraConfig" or getattr(config, "modules_to_save", None):
        raise LoraSetupError(f"a PEFT model with {kind}"
                             f"{' and modules_to_save' if kind == 'LoraConfig' else ''} cannot "
                             "be run on a plan; LoRA (LoraConfig without modules_to_save) can")
    if name != "default":
        raise LoraSetupError(f"the PEFT model's active adapter is {name!r}; a plan runs the "
                             "adapter named 'default'")
    return config, model.get_base_model()


def apply_lora_config(stage: nn.Module, config) -> None:
    """Add the adapters a user's ``LoraConfig`` describes to the stage's own modules (the
    trainable flags are set from the user's model afterwards)."""
    from peft import inject_adapter_in_model

    targets = config.target_modules
    names = {targets} if isinstance(targets, str) else set(targets or ())
    if _has_targets(stage, names):
        inject_adapter_in_model(config, stage)


def adapter_state(full: dict) -> dict:
    """The adapter's tensors of a gathered state dict, named as ``PeftModel.save_pretrained``
    names them in ``adapter_model.safetensors``."""
    return {"base_model.model." + k.replace(".default.", "."): v for k, v in full.items()
            if "lora_" in k}


def _freeze_all_but_lora(stage: nn.Module) -> int:
    trainable = 0
    for name, p in stage.named_parameters():
        p.requires_grad = "lora_" in name
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def write_adapter(runtime, config, out_dir, processing_class=None) -> None:
    """Save a PEFT model as ``Trainer`` saves one, the adapter only: adapter_config.json and
    adapter_model.safetensors, gathered from every stage (collective; rank 0 writes), so that
    ``PeftModel.from_pretrained(base, out_dir)`` loads them."""
    from safetensors.torch import save_file

    full = runtime.gather_state_dict(dst=0)
    if runtime.rank != 0:
        return
    save_file({k: v.contiguous() for k, v in adapter_state(full).items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    if processing_class is not None:
        processing_class.save_pretrained(str(out_dir))


def merge_lora(stage: nn.Module) -> None:
    """Fold every adapter into its base weight and put the base module back in its place."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(stage.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(parent) if parent else stage, leaf,
                    module.get_base_layer())
