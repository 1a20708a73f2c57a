"""Which ``Accelerator`` arguments a hapt plan honours, and the check that refuses the rest.

Compared with ``Accelerator.__init__``'s own defaults (read from its signature, so the check
follows the installed accelerate release): an argument given away from its default that is not
in :data:`HONOURED_ACCELERATOR_ARGS` is refused with its name, never ignored.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

from accelerate import Accelerator

from hapt_hf.integration.accelerate_objects import AccelerateSettingError

__all__ = ["HONOURED_ACCELERATOR_ARGS", "MIXED_PRECISION_TO_PLAN", "check_accelerator_arguments",
           "check_project_config"]

# Accelerator arguments the pipeline acts on; any other one given away from its default is
# refused with its name (see _check_arguments).
HONOURED_ACCELERATOR_ARGS: dict[str, str] = {
    "mixed_precision": "the plan's precision (bf16 / fp16 / no = fp32)",
    "gradient_accumulation_steps": "global batch = DataLoader batch_size x this",
    "cpu": "every rank on the CPU (Gloo)",
    "log_with": "trackers on the main process", "project_dir": "trackers' logging directory",
    "device_placement": "True only: the runtime places each stage's inputs itself",
    "step_scheduler_with_optimizer": "True only: one scheduler step per optimizer step",
}
MIXED_PRECISION_TO_PLAN = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_MUST_STAY = {"device_placement": True, "step_scheduler_with_optimizer": True}


def check_accelerator_arguments(args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse, by name, every Accelerator argument given away from its default that the
    pipeline does not honour (:data:`HONOURED_ACCELERATOR_ARGS`)."""
    if args:
        raise AccelerateSettingError("pass HaptAccelerator's arguments by name")
    params = inspect.signature(Accelerator.__init__).parameters
    for name, value in kwargs.items():
        if name not in params:
            raise AccelerateSettingError(f"HaptAccelerator got an unknown argument {name!r}")
        if name in _MUST_STAY and value != _MUST_STAY[name]:
            raise AccelerateSettingError(f"Accelerator({name}={value!r}) cannot be honoured "
                                         f"with a hapt plan: {HONOURED_ACCELERATOR_ARGS[name]}")
        if name == "project_config" and value is not None:
            check_project_config(value)
            continue
        if name not in HONOURED_ACCELERATOR_ARGS and value is not params[name].default:
            raise AccelerateSettingError(f"Accelerator({name}=...) cannot be honoured with a "
                                         "hapt plan: the pipeline runtime does not implement "
                                         "it; leave it out")
    steps = kwargs.get("gradient_accumulation_steps", 1)
    if not (isinstance(steps, int) and steps >= 1) or math.isnan(steps):
        raise AccelerateSettingError(f"gradient_accumulation_steps={steps!r}: give an int >= 1")


def check_project_config(config: Any) -> None:
    """Only the directories of a ProjectConfiguration are honoured."""
    from accelerate.utils import ProjectConfiguration

    default = ProjectConfiguration()
    for name in ("automatic_checkpoint_naming", "total_limit", "iteration", "save_on_each_node"):
        if getattr(config, name) != getattr(default, name):
            raise AccelerateSettingError(f"ProjectConfiguration({name}=...) cannot be honoured "
                                         "with a hapt plan; pass save_state an output_dir")
