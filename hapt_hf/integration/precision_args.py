"""``TrainingArguments``' precision settings against the plan's.

The plan's precision is the job's one setting (the runtime autocasts to it and scales the loss
when it says so). ``TrainingArguments(bf16=True)`` / ``fp16=True`` are Trainer's way of asking
for mixed precision, and ``accelerate launch --mixed_precision`` reaches them through the
environment (``TrainingArguments.mixed_precision``): they may repeat the plan's choice, or be
left off ("follow the plan", their default), but one that asks for another precision cannot be
honoured and is refused, naming both. ``bf16_full_eval`` / ``fp16_full_eval`` (evaluate a model cast to 16 bits) are
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
    if asked:
        setting, wanted = f"TrainingArguments({asked[0]}=True)", asked[0]
    else:  # accelerate's own setting, which TrainingArguments reads from the environment
        wanted = str(getattr(args, "mixed_precision", "no") or "no")
        setting = (f"accelerate's mixed_precision={wanted} (ACCELERATE_MIXED_PRECISION, set "
                   "by accelerate launch --mixed_precision or its config file)")
    if wanted in ("no", plan.dtype):
        return None
    fix = ("leave bf16 and fp16 False and mixed_precision 'no' (the plan trains in fp32)"
           if plan.dtype == "fp32" else
           f"set {plan.dtype}=True instead, or leave both False to follow the plan")
    return (f"{setting} but the plan computes in {plan.precision.describe()} (plan.json "
            f"precision); {fix}, or re-plan with precision {wanted} (hapt config "
            f"'precision: {wanted}')")
