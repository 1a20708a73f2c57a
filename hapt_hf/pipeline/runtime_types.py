"""What the pipeline runtime is given and gives back: its settings (:class:`RuntimeConfig`),
one global batch (:class:`Batch`), a training step's and a forward pass's results, and its two
refusals: :class:`RuntimeSetupError` (a :class:`~hapt_hf.errors.ConfigError`) and
:class:`BatchError` (a :class:`~hapt_hf.errors.DataError`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hapt_hf.core.defaults import DEFAULT_TIMEOUT_S, GRAD_BUCKET_BYTES
from hapt_hf.errors import ConfigError, DataError
from hapt_hf.pipeline.loss_scale import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE, DynamicLossScaler
from hapt_hf.planner.plan import Plan

__all__ = ["Batch", "RuntimeConfig", "StepResult", "Prediction", "RuntimeSetupError",
           "BatchError", "check_batch", "batch_tokens"]


class RuntimeSetupError(ConfigError):
    """The runtime cannot start as asked (no process group, wrong world size, bad setting)."""


class BatchError(DataError):
    """A batch that does not fit the plan; the message names the field and the fix."""


@dataclass(frozen=True)
class Batch:
    """The whole global batch; every rank gets the same one."""

    input_ids: Tensor
    """[global_batch, seq] token ids."""
    labels: Tensor | None = None
    """[global_batch, seq] un-shifted labels, -100 ignored; None: the input ids."""
    attention_mask: Tensor | None = None
    """[global_batch, seq] padding mask (1 = token, 0 = padding); None: no padding."""
    num_items: int | None = None
    """What the summed token losses are divided by; None: the tokens predicted (labels after the
    shift that are not -100), the token mean. ``Trainer`` divides by its own count
    (``num_items_in_batch``), which HaptTrainer passes so that its loss is Trainer's."""


@dataclass(frozen=True)
class RuntimeConfig:
    """How a :class:`~hapt_hf.pipeline.runtime.PipelineRuntime` runs; checked on creation."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on any wait for another rank; past it the run fails with a message naming the rank."""
    seed: int = 0
    """Weights equal the same layers of a full model built with this seed (no checkpoint)."""
    init_weights: bool = True
    """False (and no ``checkpoint_dir``): the stage's weights are allocated, not initialised, for
    a run that reads every one of them from a checkpoint next
    (:func:`~hapt_hf.pipeline.portable.load_portable`, a resume on a new plan). It skips the
    seeded initialisation, which replays the whole model's random draws on every rank: seconds a
    rank for hundreds of millions of parameters, growing with the model, not with the stage."""
    checkpoint_dir: str | None = None
    """Local Hugging Face checkpoint (safetensors) to load this stage's weights from."""
    autocast_dtype: torch.dtype | None = None
    """None: compute in the plan's precision (autocast on CUDA and CPU for bf16 / fp16). Set,
    it must equal the plan's compute dtype; another is refused, naming both."""
    device: str | None = None
    """Default: cuda:LOCAL_RANK if CUDA is available, else cpu."""
    overlap_grad_sync: bool = True
    """All-reduce a stage's gradients among its replicas in buckets launched during the
    iteration's last backward, as their gradients become final (as DDP does), so that the
    transfer hides behind that backward. False: every bucket goes after the backward ends."""
    grad_bucket_bytes: int = GRAD_BUCKET_BYTES
    """Gradient bytes per all-reduce bucket (a bucket closes once it holds at least this many).
    The planner's cost model prices the default."""
    loss_scale_init: float | None = None
    """First loss scale of a plan with dynamic loss scaling (fp16); None: 2**16, as
    ``torch.amp.GradScaler``. Refused for a plan without loss scaling."""
    loss_scale_growth_interval: int | None = None
    """Clean steps in a row before the loss scale doubles; None: 2000, as GradScaler. Refused
    for a plan without loss scaling."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise RuntimeSetupError(f"RuntimeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if not self.grad_bucket_bytes > 0:
            raise RuntimeSetupError(f"RuntimeConfig.grad_bucket_bytes must be > 0, got "
                                    f"{self.grad_bucket_bytes}; the default is "
                                    f"{GRAD_BUCKET_BYTES} (25 MiB)")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise RuntimeSetupError(f"RuntimeConfig.autocast_dtype must be torch.bfloat16, "
                                    f"torch.float16 or None, got {self.autocast_dtype}")
        if self.loss_scale_init is not None and not self.loss_scale_init > 0:
            raise RuntimeSetupError(f"RuntimeConfig.loss_scale_init must be > 0, got "
                                    f"{self.loss_scale_init}; the default is 2**16")
        g = self.loss_scale_growth_interval
        if g is not None and not (isinstance(g, int) and g >= 1):
            raise RuntimeSetupError(f"RuntimeConfig.loss_scale_growth_interval must be an "
                                    f"integer >= 1, got {g!r}; the default is 2000")

    def loss_scaler(self, plan: Plan) -> DynamicLossScaler | None:
        """The loss scaler the plan's precision asks for (None: no loss scaling); loss-scale
        settings given for a plan that has none are refused."""
        given = [f"{n}={v}" for n, v in (("loss_scale_init", self.loss_scale_init),
                                         ("loss_scale_growth_interval",
                                          self.loss_scale_growth_interval)) if v is not None]
        if plan.loss_scaling is None:
            if given:
                raise RuntimeSetupError(f"RuntimeConfig.{given[0]} but the plan computes in "
                                        f"{plan.dtype} without loss scaling (only fp16 plans "
                                        "scale the loss); leave it unset")
            return None
        return DynamicLossScaler(
            DEFAULT_INIT_SCALE if self.loss_scale_init is None else self.loss_scale_init,
            DEFAULT_GROWTH_INTERVAL if self.loss_scale_growth_interval is None
            else self.loss_scale_growth_interval)


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`~hapt_hf.pipeline.runtime.PipelineRuntime.train_step` gives back."""

    loss: float
    """Mean loss over the non-ignored tokens of the global batch (same on every rank)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when not clipped); inf or NaN on a step
    skipped for an overflow."""
    skipped: bool = False
    """The optimizer step was skipped on every rank: a gradient overflowed (loss scaling)."""
    loss_scale: float | None = None
    """The loss scale this step's backward ran with (None: no loss scaling)."""


@dataclass(frozen=True)
class Prediction:
    """What a forward-only pass over one global batch gives back."""

    loss: float
    """Mean loss over the non-ignored tokens of the global batch (same on every rank)."""
    logits: Tensor | None
    """[global_batch, seq, vocab] float32 logits on rank 0; None on every other rank."""


def check_batch(batch: Batch, global_batch_size: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """(input ids, labels, padding mask) of a batch that fits the plan; labels default to the
    input ids."""
    ids = batch.input_ids
    g = global_batch_size
    if ids.ndim != 2 or ids.shape[0] != g or ids.is_floating_point():
        raise BatchError(f"Batch.input_ids must be integer token ids of shape "
                         f"[global_batch_size={g}, seq], got {ids.dtype} "
                         f"{tuple(ids.shape)}; pass the whole global batch on every rank")
    for name in ("labels", "attention_mask"):
        t = getattr(batch, name)
        if t is not None and tuple(t.shape) != tuple(ids.shape):
            raise BatchError(f"Batch.{name} has shape {tuple(t.shape)} but input_ids has "
                             f"{tuple(ids.shape)}; give them the same shape")
    labels = batch.labels if batch.labels is not None else ids
    return ids, labels, batch.attention_mask


def batch_tokens(labels: Tensor) -> int:
    """The tokens the loss averages over: shifted labels that are not -100 (at least 1)."""
    return max(1, int((labels[:, 1:] != -100).sum()))
