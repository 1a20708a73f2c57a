"""The one root of every error a user can cause, and one subclass per area.

``HaptError`` subclasses ``ValueError`` so that code written against the older, separate
``ValueError`` subclasses keeps working. Top-level handlers (the CLI, the recipes, launch)
catch ``HaptError`` alone: a programming bug then surfaces as a traceback instead of being
reported as a user mistake. Every message names the field that is wrong and how to fix it.

The area classes are defined here, once; the modules that raise them import them, so
``from hapt_hf.planner.plan import PlanError`` and ``from hapt_hf.errors import PlanError``
name the same class. Torch-free and import-free: every layer of the package may import it.
"""
from __future__ import annotations

__all__ = [
    "HaptError", "ModelSpecError", "UnsupportedModel", "ClusterError", "ProfileError",
    "PlanError", "PlanningError", "PrecisionError", "ScheduleError", "CostModelError",
    "ConfigError", "StageBuildError", "CheckpointError", "DataError", "TrainingArgsError",
    "LaunchError",
]


class HaptError(ValueError):
    """Something the user gave cannot be used; the message names it and the fix."""


class ModelSpecError(HaptError):
    """A model name or config the planner cannot describe."""


class UnsupportedModel(ModelSpecError):
    """A model family (``config.model_type``) hapt_hf cannot cut into stages."""


class ClusterError(HaptError):
    """A cluster file (groups, links, job section, profiles) that is inconsistent."""


class ProfileError(HaptError):
    """Measured figures (a profile file, a profile store, profiler options) that cannot be used."""


class PlanError(HaptError):
    """A plan (or plan file) that is inconsistent."""


class PlanningError(HaptError):
    """No plan is possible for the job, or a planner option is wrong."""


class PrecisionError(PlanningError):
    """A precision that is unknown, or that a device of the job cannot compute in."""


class ScheduleError(HaptError):
    """A schedule that cannot run; the message carries the stage-by-step grid."""


class CostModelError(HaptError):
    """A plan that does not match the cluster it is priced on."""


class ConfigError(HaptError):
    """A setting of the hapt config or of the runtime that cannot be honoured."""


class TrainingArgsError(ConfigError):
    """A ``TrainingArguments`` setting the pipeline trainer cannot honour."""


class LaunchError(HaptError):
    """The processes that were started do not form the job asked for."""


class StageBuildError(HaptError):
    """A pipeline stage that cannot be built (family, layer range, layer unit, checkpoint)."""


class CheckpointError(HaptError):
    """A checkpoint that cannot be read or does not match the model or the plan."""


class DataError(HaptError):
    """A dataset or batch that cannot be used for training."""
