"""Which ``Accelerator`` arguments a hapt plan honours, and the check that refuses the rest.

Compared with ``Accelerator.__init__``'s own defaults (read from its signature, so the check
follows the installed accelerate release): an argument given away from its default that is not
in :data:`HONOURED_ACCELERATOR_ARGS` is refused with its name, never ignored. Of the honoured
configuration objects, a field the pipeline cannot honour is refused by name too.
"""
from __future__ import annotations

import inspect
from typing import Any

from accelerate import Accelerator

from hapt_hf.integration.accelerate_objects import AccelerateSettingError

__all__ = ["HONOURED_ACCELERATOR_ARGS", "MIXED_PRECISION_TO_PLAN", "check_accelerator_arguments",
           "check_project_config", "check_dataloader_config", "check_accumulation_plugin"]

# Accelerator arguments the pipeline acts on; any other one given away from its default is
# refused with its name (see check_accelerator_arguments).
HONOURED_ACCELERATOR_ARGS: dict[str, str] = {
    "mixed_precision": "the plan's precision (bf16 / fp16 / no = fp32)",
    "gradient_accumulation_steps": "micro-steps per optimizer step, as Accelerate counts them",
    "gradient_accumulation_plugin": "num_steps, adjust_scheduler, sync_each_batch; "
                                    "sync_with_dataloader=True only",
    "dataloader_config": "split_batches; the other fields at their defaults",
    "cpu": "every rank on the CPU (Gloo)",
    "log_with": "trackers on the main process", "project_dir": "trackers' logging directory",
    "project_config": "directories, automatic_checkpoint_naming, total_limit, iteration",
    "device_placement": "True only: batches on the device, the runtime places the rest",
    "step_scheduler_with_optimizer": "AcceleratedScheduler's step_with_optimizer",
}
MIXED_PRECISION_TO_PLAN = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_MUST_STAY = {"device_placement": True}


def check_accelerator_arguments(args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse, by name, every Accelerator argument given away from its default that the
    pipeline does not honour (:data:`HONOURED_ACCELERATOR_ARGS`)."""
    if args:
        raise AccelerateSettingError("pass HaptAccelerator's arguments by name")
    params = inspect.signature(Accelerator.__init__).parameters
    for name, value in kwargs.items():
        if name not in params:
            raise AccelerateSettingError(f"HaptAccelerator got an unknown argument {name!r}")
        if name == "split_batches" and value is not params[name].default:
            # accelerate keeps the argument for old scripts but reads only dataloader_config's
            raise AccelerateSettingError(
                "Accelerator(split_batches=...) is not read by this accelerate release; pass "
                "dataloader_config=DataLoaderConfiguration(split_batches=...) instead")
        if name in _MUST_STAY and value != _MUST_STAY[name]:
            raise AccelerateSettingError(f"Accelerator({name}={value!r}) cannot be honoured "
                                         f"with a hapt plan: {HONOURED_ACCELERATOR_ARGS[name]}")
        checks = {"project_config": check_project_config,
                  "dataloader_config": check_dataloader_config,
                  "gradient_accumulation_plugin": check_accumulation_plugin}
        if name in checks:
            if value is not None:
                checks[name](value)
            continue
        if name not in HONOURED_ACCELERATOR_ARGS and value is not params[name].default:
            raise AccelerateSettingError(f"Accelerator({name}=...) cannot be honoured with a "
                                         "hapt plan: the pipeline runtime does not implement "
                                         "it; leave it out")
    steps = kwargs.get("gradient_accumulation_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AccelerateSettingError(f"gradient_accumulation_steps={steps!r}: give an int >= 1")


def _refuse_changed(config: Any, default: Any, kept: tuple[str, ...], what: str, why: str) -> None:
    for name in vars(default):
        if name not in kept and getattr(config, name) != getattr(default, name):
            raise AccelerateSettingError(f"{what}({name}={getattr(config, name)!r}) cannot be "
                                         f"honoured with a hapt plan: {why}")


def check_project_config(config: Any) -> None:
    """The directories, automatic checkpoint naming, its total_limit and iteration are
    honoured; save_on_each_node is not (every rank writes into one directory)."""
    from accelerate.utils import ProjectConfiguration

    _refuse_changed(config, ProjectConfiguration(), ("project_dir", "logging_dir",
                                                     "automatic_checkpoint_naming", "total_limit",
                                                     "iteration"),
                    "ProjectConfiguration", "every rank writes its part of save_state into one "
                    "directory on a filesystem they share")


def check_dataloader_config(config: Any) -> None:
    """Only ``split_batches`` is honoured: the prepared loaders shard as Accelerate does with
    ``even_batches=True``, on every rank from the same order."""
    from accelerate.utils import DataLoaderConfiguration

    _refuse_changed(config, DataLoaderConfiguration(), ("split_batches",),
                    "DataLoaderConfiguration", "every rank draws the same index batches and "
                    "shards them as Accelerate does with even_batches=True; leave it out")


def check_accumulation_plugin(plugin: Any) -> None:
    """An accumulation window must end at the end of the DataLoader (the pipeline runs a
    window from one loader iteration)."""
    if not plugin.sync_with_dataloader:
        raise AccelerateSettingError("GradientAccumulationPlugin(sync_with_dataloader=False) "
                                     "cannot be honoured with a hapt plan: the pipeline runs an "
                                     "accumulation window from one pass over the DataLoader")
    steps = plugin.num_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AccelerateSettingError(f"GradientAccumulationPlugin(num_steps={steps!r}): give an "
                                     "int >= 1")
