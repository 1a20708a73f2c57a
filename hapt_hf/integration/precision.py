"""``TrainingArguments``' precision settings against the plan's.

The plan's precision is the job's one setting (the runtime autocasts to it and scales the loss
when it says so). ``TrainingArguments(bf16=True)`` / ``fp16=True`` are Trainer's way of asking
for mixed precision: they may repeat the plan's choice, or be left False ("follow the plan",
their default), but one that asks for another precision cannot be honoured and is refused,
naming both. ``bf16_full_eval`` / ``fp16_full_eval`` (evaluate a model cast to 16 bits) are
refused too: the runtime evaluates as it trains, fp32 weights under autocast.
"""
from __future__ import annotations

from typing import Any

from hapt_hf.planner.plan import Plan

__all__ = ["training_args_precision_mismatch"]

_FLAGS = ("bf16", "fp16")


def training_args_precision_mismatch(args: Any, plan: Plan) -> str | None:
    """Why ``args`` (a ``TrainingArguments``) and ``plan`` disagree on precision; None when
    they agree or ``args`` leaves it to the plan."""
    full_eval = [f"{f}_full_eval" for f in _FLAGS if getattr(args, f"{f}_full_eval", False)]
    if full_eval:
        return (f"TrainingArguments({full_eval[0]}=True) cannot be honoured: HaptTrainer "
                f"evaluates as it trains, fp32 weights computing in the plan's "
                f"{plan.precision.describe()}; leave {full_eval[0]} False")
    asked = [f for f in _FLAGS if getattr(args, f, False)]
    if not asked or asked == [plan.dtype]:
        return None
    fix = ("leave bf16 and fp16 False (the plan trains in fp32)" if plan.dtype == "fp32"
           else f"set {plan.dtype}=True instead, or leave both False to follow the plan")
    return (f"TrainingArguments({asked[0]}=True) but the plan computes in "
            f"{plan.precision.describe()} (plan.json precision); {fix}, or re-plan with "
            f"precision {asked[0]} (hapt config 'precision: {asked[0]}')")
