"""The one place hapt_hf touches torch.distributed.pipelining.

Its scheduling API is partly private and changes between releases, so everything that depends on
it sits behind this module. hapt_hf uses it for the baselines the runtime is measured against
(torch's own ``Schedule1F1B`` and ``ScheduleGPipe`` over the same stage modules, and, on an
interleaved plan of one rank per stage, ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` over each rank's chunks), and for a capability check: what
torch's schedules accept and what a HAPT plan needs that they do not (see docs/runtime.md).

Read against torch 2.13's ``torch/distributed/pipelining``: ``PipelineStage(submodule,
stage_index, num_stages, device, group=None)`` wraps a module that takes the previous stage's
output as positional input; ``Schedule1F1B(stage, n_microbatches, loss_fn, scale_grads)``
splits ``step(x, target=y)`` along dim 0 into micro-batches, runs ``loss_fn(output, target)``
on the last stage and, with ``scale_grads=False``, leaves the gradients as the loss defines them.
Its 1F1B gives stage ``i`` of ``n`` exactly ``n - i`` warm-up forwards and requires at least as
many micro-batches as stages. The interleaved schedules take a list of stages per rank (stage
``s`` on rank ``s mod p``, as :meth:`Plan.interleave` places them), run ``max(1, M // p)``
rounds and require ``M`` to be a multiple of the rounds; ``ScheduleInterleaved1F1B``'s warm-ups
are hapt_hf's ``interleaved`` defaults; ``ScheduleInterleavedZeroBubble`` splits each backward
into input and weight gradients in its own order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from hapt_hf.compat.transformers_api import causal_lm_loss_sum
from hapt_hf.core.schedules import ScheduleKind, default_warmups
from hapt_hf.errors import HaptError
from hapt_hf.planner.plan import Plan

__all__ = ["TorchPipeline", "TorchPipelineUnsupported", "torch_supports", "build_torch_pipeline",
           "TORCH_SCHEDULES", "torch_schedule_of"]

TORCH_SCHEDULES = {"Schedule1F1B": Schedule1F1B, "ScheduleGPipe": ScheduleGPipe,
                   "ScheduleInterleaved1F1B": ScheduleInterleaved1F1B,
                   "ScheduleInterleavedZeroBubble": ScheduleInterleavedZeroBubble}
"""torch's schedules this module runs, by class name."""

_KIND_OF = {"Schedule1F1B": ScheduleKind.ONE_F_ONE_B, "ScheduleGPipe": ScheduleKind.GPIPE,
            "ScheduleInterleaved1F1B": ScheduleKind.INTERLEAVED,
            "ScheduleInterleavedZeroBubble": ScheduleKind.INTERLEAVED}
"""The plan schedule whose partition and placement each torch schedule runs."""


def torch_schedule_of(plan: Plan) -> str:
    """The torch schedule that runs ``plan``'s own kind (interleaved: ScheduleInterleaved1F1B)."""
    return {ScheduleKind.ONE_F_ONE_B: "Schedule1F1B", ScheduleKind.GPIPE: "ScheduleGPipe",
            ScheduleKind.INTERLEAVED: "ScheduleInterleaved1F1B"}.get(plan.schedule, "")


class TorchPipelineUnsupported(HaptError):
    """A plan that torch.distributed.pipelining's single-stage schedules cannot run."""


def torch_supports(plan: Plan, schedule: str | None = None) -> str | None:
    """None if torch's ``schedule`` (a :data:`TORCH_SCHEDULES` name; default
    :func:`torch_schedule_of` the plan) can run ``plan`` as it is; otherwise the reason it
    cannot."""
    schedule = schedule or torch_schedule_of(plan)
    if schedule not in TORCH_SCHEDULES:
        if schedule:
            return f"torch schedule {schedule!r} is not one of {sorted(TORCH_SCHEDULES)}"
        return (f"schedule {plan.schedule!r}: torch's schedules fix the warm-up depth (1F1B: "
                "stages - index; GPipe: all; interleaved: their own), per-stage depths are not "
                "an option")
    if plan.schedule != _KIND_OF[schedule]:
        return (f"{schedule} runs plans of schedule {_KIND_OF[schedule].value!r}, the plan's is "
                f"{plan.schedule!r}; convert it (Plan.with_schedule / Plan.interleave)")
    n, p = plan.num_stages, plan.num_pipeline_ranks
    if schedule in ("Schedule1F1B", "ScheduleInterleaved1F1B") and plan.warmups() != \
            default_warmups(plan.schedule, n, plan.num_microbatches, p):
        return "per-stage warm-up depths other than torch's own are not expressible"
    if any(s.width != 1 for s in plan.stages):
        return ("stages of several ranks: torch's stages exchange whole micro-batches with one "
                "peer each, so neighbouring stages of different widths (8 -> 4) cannot be wired")
    if any(s.tp != 1 for s in plan.stages):
        return ("tensor-parallel stages: the torch-schedule path builds each stage whole on one "
                "rank; run plans with tensor-parallel replicas on hapt_hf's own runtime")
    if schedule == "Schedule1F1B" and plan.num_microbatches < n:
        return f"Schedule1F1B needs at least {n} micro-batches, the plan has {plan.num_microbatches}"
    if plan.schedule == ScheduleKind.INTERLEAVED:
        if any(s.ranks != plan.stages[s.index % p].ranks for s in plan.stages):
            return "torch's interleaved schedules place stage s on rank s mod p; this plan does not"
        rounds = max(1, plan.num_microbatches // p)
        if plan.num_microbatches % rounds:
            return (f"{schedule} needs the micro-batches ({plan.num_microbatches}) to be a "
                    f"multiple of its rounds ({rounds})")
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
    """One rank's stage (or, interleaved, its chunks) under one of torch's schedules."""

    def __init__(self, plan: Plan, rank: int, stage_modules: nn.Module | dict[int, nn.Module],
                 vocab_size: int, device: torch.device | str = "cpu",
                 schedule: str | None = None) -> None:
        schedule = schedule or torch_schedule_of(plan)
        why = torch_supports(plan, schedule)
        if why is not None:
            raise TorchPipelineUnsupported(f"torch.distributed.pipelining cannot run this plan: "
                                           f"{why}")
        held = plan.stages_of_rank(rank)
        modules = stage_modules if isinstance(stage_modules, dict) else {held[0].index:
                                                                          stage_modules}
        if sorted(modules) != [s.index for s in held]:
            raise TorchPipelineUnsupported(f"rank {rank} holds stages {[s.index for s in held]} "
                                           f"but modules were given for {sorted(modules)}; build "
                                           "one module per stage the rank holds")
        last = plan.num_stages - 1
        self.is_first = held[0].index == 0
        self.is_last = held[-1].index == last
        self.torch_stages = [TorchStage(_LogitsStage(modules[s.index]) if s.index == last
                                        else modules[s.index], s.index, plan.num_stages,
                                        torch.device(device)) for s in held]
        """torch.distributed.pipelining's stage objects around this rank's stage modules."""
        self.torch_stage = self.torch_stages[0]
        self.loss_fn = _TokenMeanLoss(vocab_size)
        self.schedule_name = schedule
        cls = TORCH_SCHEDULES[schedule]
        self.schedule = cls(self.torch_stages if len(held) > 1 or "Interleaved" in schedule
                            else self.torch_stage, plan.num_microbatches, loss_fn=self.loss_fn,
                            scale_grads=False)

    def forward_backward(self, input_ids: Tensor, labels: Tensor) -> float | None:
        """One iteration; the global-batch mean loss on the rank holding the last stage, None
        elsewhere."""
        self.loss_fn.tokens = max(1, int((labels[:, 1:] != -100).sum()))
        losses: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        self.schedule.step(*args, target=labels if self.is_last else None,
                           losses=losses if self.is_last else None, return_outputs=False)
        return float(sum(l.detach().double() for l in losses)) if self.is_last else None


def build_torch_pipeline(plan: Plan, rank: int, stage_modules: nn.Module | dict[int, nn.Module],
                         vocab_size: int, device: torch.device | str = "cpu",
                         schedule: str | None = None) -> TorchPipeline:
    """Wrap already built hapt_hf stage modules (one, or by stage index for every stage the
    rank holds) in torch's ``schedule`` (default: the one of the plan's kind) for ``plan``."""
    return TorchPipeline(plan, rank, stage_modules, vocab_size, device, schedule)
