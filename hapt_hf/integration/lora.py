"""LoRA on a pipeline stage through peft: adapters on this stage's attention projections.

peft's ``inject_adapter_in_model`` works on any module, so each rank adds adapters to its own
stage only. Every other weight is frozen; the optimizer (Trainer.create_optimizer) keeps only
trainable parameters. Before the final save the adapters are merged back into the base weights
and the peft wrappers removed, so the saved model is a plain Hugging Face checkpoint.
Intermediate checkpoints keep the adapters unmerged (peft's tensor names), which is what a
resume with the same ``--lora_r`` reads back.

Limitation: a stage must hold at least one adapted block unless it is the last stage, since
a stage whose every weight is frozen produces outputs that carry no gradient to send back.
"""
from __future__ import annotations

from torch import nn

from hapt_hf.errors import ConfigError

__all__ = ["LoraSetupError", "apply_lora", "merge_lora", "LORA_TARGETS"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraSetupError(ConfigError):
    """LoRA cannot be applied as asked; the message says why."""


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
    if not present.intersection(targets):
        if getattr(stage, "is_last", False):
            _freeze_all_but_lora(stage)
            return 0
        raise LoraSetupError(f"stage {getattr(stage, 'layer_range', '?')} has no {targets} "
                             "module to adapt; give every non-last stage at least one block")
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=0.0,
                        target_modules=[t for t in targets if t in present])
    inject_adapter_in_model(config, stage)
    return _freeze_all_but_lora(stage)


def _freeze_all_but_lora(stage: nn.Module) -> int:
    trainable = 0
    for name, p in stage.named_parameters():
        p.requires_grad = "lora_" in name
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def merge_lora(stage: nn.Module) -> None:
    """Fold every adapter into its base weight and put the base module back in its place."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(stage.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(parent) if parent else stage, leaf,
                    module.get_base_layer())
