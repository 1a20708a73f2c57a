"""What HaptTrainer checks before any step runs: its data and TrainingArguments, against the plan.

Every step takes one global batch of packed token rows ``[samples, plan.seq_len]``; rows of
another length, too few rows for one global batch, batch sizes that do not map onto the plan's
micro-batches, or a best-model metric HaptTrainer cannot compute are refused here, before
Trainer creates the output directory.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import TrainingArguments

from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.planner.plan import Plan

__all__ = ["TrainingArgsError", "BatchMappingError", "as_rows", "check_enough",
           "check_best_metric", "check_batch_mapping"]


class BatchMappingError(TrainingArgsError):
    """TrainingArguments whose batch sizes do not match the plan; the message gives the fix."""


def _group_fix(seq_len: int) -> str:
    return (f"group the texts into blocks of {seq_len} tokens (hapt_hf.integration.data."
            f"pack_tokens(texts, tokenizer, {seq_len}); --seq_len {seq_len} in the recipes)")


def as_rows(data: Any, field: str, plan: Plan) -> torch.Tensor:
    """Packed token rows [samples, plan.seq_len] from a tensor or a dataset with 'input_ids';
    rows of another or of uneven length are refused here, before any step runs."""
    if isinstance(data, torch.Tensor):
        rows = data
    else:
        try:
            ids = data["input_ids"]
        except (KeyError, TypeError, IndexError):
            raise DataError(f"{field} has no 'input_ids' column; give packed token rows "
                            f"[samples, {plan.seq_len}] (a tensor, or a dataset with an "
                            "'input_ids' column)") from None
        if not isinstance(ids, torch.Tensor):
            ids = list(ids)
            lengths = sorted({len(r) for r in ids})
            if len(lengths) > 1:
                raise DataError(f"{field} rows have uneven lengths ({lengths[0]} to "
                                f"{lengths[-1]} tokens) but every row must hold the plan's "
                                f"seq_len {plan.seq_len}; {_group_fix(plan.seq_len)}")
        rows = torch.as_tensor(ids)
    if rows.ndim != 2 or rows.is_floating_point():
        raise DataError(f"{field} must be integer token rows [samples, seq_len]; got "
                        f"{rows.dtype} {tuple(rows.shape)}; {_group_fix(plan.seq_len)}")
    if rows.shape[1] != plan.seq_len:
        raise DataError(f"{field} rows have {rows.shape[1]} tokens but the plan was made for "
                        f"seq_len {plan.seq_len}; {_group_fix(plan.seq_len)}, or re-plan for "
                        f"seq_len {rows.shape[1]}")
    return rows.long()


def check_enough(rows: torch.Tensor, field: str, plan: Plan) -> None:
    """Every step and every evaluation takes whole global batches."""
    g = plan.global_batch_size
    if len(rows) < g:
        raise DataError(f"{field} has {len(rows)} samples, fewer than one global batch of the "
                        f"plan ({g}); pass at least {g} samples, or re-plan for a smaller "
                        "global batch")


def check_best_metric(args: TrainingArguments) -> None:
    """HaptTrainer.evaluate reports the loss only: another best-model metric could not be
    found at the first evaluation, after training started."""
    metric = args.metric_for_best_model
    if metric is not None and metric.removeprefix("eval_") != "loss":
        raise TrainingArgsError(f"metric_for_best_model={metric!r} cannot be honoured: "
                                "HaptTrainer evaluates the loss only; set "
                                "metric_for_best_model='eval_loss'")


def check_batch_mapping(args: TrainingArguments, plan: Plan) -> None:
    """One optimizer step is the plan's global batch: micro-batch size times micro-batches."""
    if (args.per_device_train_batch_size, args.gradient_accumulation_steps) != (
            plan.micro_batch_size, plan.num_microbatches):
        raise BatchMappingError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} and "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} do not match the "
            f"plan: set per_device_train_batch_size={plan.micro_batch_size} (the plan's "
            f"micro_batch_size) and gradient_accumulation_steps={plan.num_microbatches} (its "
            f"num_microbatches), or re-plan for another global batch")
