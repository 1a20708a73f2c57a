"""Dynamic loss scaling for fp16 training, decided once for the whole job.

fp16 gradients underflow: the last stage multiplies the loss by ``scale`` before its backward,
so that the gradients flow (and cross stages, in fp16) scaled, and every rank divides its
weight gradients by ``scale`` once the iteration's backward and all-reduces are done. When any
gradient of any rank is inf or NaN, every rank skips the same optimizer step and halves the
scale; after ``growth_interval`` clean steps in a row the scale doubles. These are
``torch.amp.GradScaler``'s rules and defaults (init 2**16, growth 2, backoff 0.5, interval
2000); what GradScaler cannot give is the decision: it sees one process's gradients, while a
pipeline's overflow may happen on any stage, so the runtime all-reduces one flag over every
rank (:meth:`~hapt_hf.pipeline.runtime.PipelineRuntime.train_step`) and feeds the agreed flag
to :meth:`DynamicLossScaler.update` on every rank. The scale stays a power of two, so scaling
and unscaling are exact in fp32.
"""
from __future__ import annotations

from typing import Any

from hapt_hf.errors import ConfigError

__all__ = ["DynamicLossScaler", "DEFAULT_INIT_SCALE", "DEFAULT_GROWTH_INTERVAL"]

DEFAULT_INIT_SCALE = 2.0 ** 16
DEFAULT_GROWTH_INTERVAL = 2000


class DynamicLossScaler:
    """The loss scale of one job (mutable; every rank holds an identical copy).

    Args:
        init_scale: The first scale (a power of two keeps scaling exact).
        growth_interval: Clean steps in a row after which the scale grows.
        growth_factor / backoff_factor: What the scale is multiplied by when it grows / when an
            overflow is found.
    """

    def __init__(self, init_scale: float = DEFAULT_INIT_SCALE,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5) -> None:
        if not init_scale > 0:
            raise ConfigError(f"loss scale init_scale must be > 0, got {init_scale}; "
                              f"the default is {DEFAULT_INIT_SCALE:g}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ConfigError(f"loss scale growth_interval must be an integer >= 1, got "
                              f"{growth_interval!r}; the default is {DEFAULT_GROWTH_INTERVAL}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ConfigError(f"loss scale growth_factor must be > 1 and backoff_factor in "
                              f"(0, 1), got {growth_factor} and {backoff_factor}")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        """Clean steps since the scale last changed."""
        self.skipped_steps = 0
        """Optimizer steps skipped for an overflow since the job began."""

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow (the step was skipped), else count a clean
        step and grow after ``growth_interval`` of them."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps, "growth_interval": self.growth_interval,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved scale and the count of clean steps towards the next growth; the
        growth and backoff settings stay this run's (the user's current configuration).
        Malformed state raises KeyError, TypeError or ValueError (the checkpoint reader names
        the file)."""
        scale, tracker = float(state["scale"]), int(state["growth_tracker"])
        if not scale > 0 or tracker < 0:
            raise ValueError(f"saved loss scale {scale} / growth tracker {tracker}: the scale "
                             "must be > 0 and the tracker >= 0")
        self.scale, self.growth_tracker = scale, tracker
        self.skipped_steps = int(state.get("skipped_steps", 0))
