"""The one place hapt_hf touches torch.distributed.pipelining.

Its scheduling API is partly private and changes between releases, so everything that depends on
it sits behind this module. hapt_hf uses it for the baseline the runtime is measured against
(torch's own ``Schedule1F1B`` and ``ScheduleGPipe`` over the same stage modules), and for a
capability check: what torch's schedules accept and what a HAPT plan needs that they do not
(see docs/runtime.md).

Read against torch 2.13's ``torch/distributed/pipelining``: ``PipelineStage(submodule,
stage_index, num_stages, device, group=None)`` wraps a module that takes the previous stage's
output as positional input; ``Schedule1F1B(stage, n_microbatches, loss_fn, scale_grads)``
splits ``step(x, target=y)`` along dim 0 into micro-batches, runs ``loss_fn(output, target)``
on the last stage and, with ``scale_grads=False``, leaves the gradients as the loss defines them.
Its 1F1B gives stage ``i`` of ``n`` exactly ``n - i`` warm-up forwards and requires at least as
many micro-batches as stages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from hapt_hf.compat.transformers_api import causal_lm_loss_sum
from hapt_hf.core.schedules import ScheduleKind, default_warmups
from hapt_hf.errors import HaptError
from hapt_hf.planner.plan import Plan

__all__ = ["TorchPipeline", "TorchPipelineUnsupported", "torch_supports", "build_torch_pipeline"]

_SCHEDULES = {ScheduleKind.ONE_F_ONE_B: Schedule1F1B, ScheduleKind.GPIPE: ScheduleGPipe}


class TorchPipelineUnsupported(HaptError):
    """A plan that torch.distributed.pipelining's single-stage schedules cannot run."""


def torch_supports(plan: Plan) -> str | None:
    """None if torch's schedules can run ``plan`` as it is; otherwise the reason they cannot."""
    if plan.schedule not in _SCHEDULES:
        return (f"schedule {plan.schedule!r}: torch's single-stage schedules fix the warm-up "
                "depth (1F1B: stages - index; GPipe: all), per-stage depths are not an option")
    n = plan.num_stages
    if plan.schedule == ScheduleKind.ONE_F_ONE_B and \
            plan.warmups() != default_warmups(plan.schedule, n, plan.num_microbatches):
        return "per-stage warm-up depths other than stages - index are not expressible"
    if any(s.width != 1 for s in plan.stages):
        return ("stages of several ranks: torch's stages exchange whole micro-batches with one "
                "peer each, so neighbouring stages of different widths (8 -> 4) cannot be wired")
    if any(s.tp != 1 for s in plan.stages):
        return ("tensor-parallel stages: the torch-schedule path builds each stage whole on one "
                "rank; run plans with tensor-parallel replicas on hapt_hf's own runtime")
    if plan.schedule == ScheduleKind.ONE_F_ONE_B and plan.num_microbatches < n:
        return f"Schedule1F1B needs at least {n} micro-batches, the plan has {plan.num_microbatches}"
    return None


class _LogitsStage(nn.Module):
    """Torch's schedule computes the loss itself: the last stage must hand it the logits."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)


@dataclass
class _TokenMeanLoss:
    """Sum of token cross-entropies over the global token count, as hapt_hf's loss."""

    vocab_size: int
    tokens: int = 1

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        return causal_lm_loss_sum(logits, labels, self.vocab_size) / self.tokens


class TorchPipeline:
    """One rank's stage under torch's Schedule1F1B / ScheduleGPipe."""

    def __init__(self, plan: Plan, rank: int, stage_module: nn.Module, vocab_size: int,
                 device: torch.device | str = "cpu") -> None:
        why = torch_supports(plan)
        if why is not None:
            raise TorchPipelineUnsupported(f"torch.distributed.pipelining cannot run this plan: "
                                           f"{why}")
        stage_plan = plan.stage_of_rank(rank)
        self.is_first = stage_plan.index == 0
        self.is_last = stage_plan.index == plan.num_stages - 1
        module = _LogitsStage(stage_module) if self.is_last else stage_module
        self.torch_stage = TorchStage(module, stage_plan.index, plan.num_stages, torch.device(device))
        """torch.distributed.pipelining's stage object around this rank's stage module."""
        self.loss_fn = _TokenMeanLoss(vocab_size)
        self.schedule = _SCHEDULES[plan.schedule](self.torch_stage, plan.num_microbatches,
                                                  loss_fn=self.loss_fn, scale_grads=False)

    def forward_backward(self, input_ids: Tensor, labels: Tensor) -> float | None:
        """One iteration; the global-batch mean loss on the last stage, None elsewhere."""
        self.loss_fn.tokens = max(1, int((labels[:, 1:] != -100).sum()))
        losses: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        self.schedule.step(*args, target=labels if self.is_last else None,
                           losses=losses if self.is_last else None, return_outputs=False)
        return float(sum(l.detach().double() for l in losses)) if self.is_last else None


def build_torch_pipeline(plan: Plan, rank: int, stage_module: nn.Module, vocab_size: int,
                         device: torch.device | str = "cpu") -> TorchPipeline:
    """Wrap an already built hapt_hf stage in torch's pipelining for ``plan``'s schedule."""
    return TorchPipeline(plan, rank, stage_module, vocab_size, device)
