"""What HaptTrainer checks before any step runs: its data and TrainingArguments, against the plan.

Every step takes one global batch of packed token rows ``[samples, plan.seq_len]``; rows of
another length, too few rows for one global batch, batch sizes that do not map onto the plan's
micro-batches, or a best-model metric HaptTrainer cannot compute are refused here, before
Trainer creates the output directory.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from transformers import TrainingArguments

from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.planner.plan import Plan

__all__ = ["TrainingArgsError", "BatchMappingError", "as_rows", "check_enough",
           "check_best_metric", "check_batch_mapping", "HONOURED_TRAINING_ARGS",
           "check_training_args_honoured", "wants_recompute"]

# Every TrainingArguments field HaptTrainer acts on, and how. Any other field set to a value
# other than its default is refused by check_training_args_honoured, so none is ignored.
HONOURED_TRAINING_ARGS: dict[str, str] = {
    "output_dir": "checkpoints and the final model",
    "per_device_train_batch_size": "must equal the plan's micro_batch_size",
    "gradient_accumulation_steps": "must equal the plan's num_microbatches",
    "num_train_epochs": "epochs over the train rows", "max_steps": "optimizer steps",
    "learning_rate": "create_optimizer", "weight_decay": "create_optimizer",
    "adam_beta1": "create_optimizer", "adam_beta2": "create_optimizer",
    "adam_epsilon": "create_optimizer", "optim": "create_optimizer",
    "optim_args": "create_optimizer", "lr_scheduler_type": "create_scheduler",
    "lr_scheduler_kwargs": "create_scheduler", "warmup_steps": "create_scheduler",
    "max_grad_norm": "global clipping over every stage",
    "bf16": "checked against the plan's precision", "fp16": "checked against the plan's precision",
    "bf16_full_eval": "refused when set (integration/precision_args.py)",
    "fp16_full_eval": "refused when set (integration/precision_args.py)",
    "activation_checkpointing": "every stage recomputes its blocks' activations",
    "gradient_checkpointing": "every stage recomputes its blocks' activations",
    "logging_strategy": "Trainer's flow callback", "logging_steps": "Trainer's flow callback",
    "logging_first_step": "Trainer's flow callback", "log_level": "Trainer.__init__",
    "log_level_replica": "Trainer.__init__", "disable_tqdm": "progress callback",
    "report_to": "reporting callbacks", "run_name": "reporting callbacks",
    "project": "reporting callbacks", "eval_strategy": "Trainer's flow callback",
    "eval_steps": "Trainer's flow callback", "eval_delay": "Trainer's flow callback",
    "save_strategy": "Trainer's flow callback", "save_steps": "Trainer's flow callback",
    "save_total_limit": "checkpoint rotation", "load_best_model_at_end": "load_best_model",
    "metric_for_best_model": "eval_loss only (checked)", "greater_is_better": "best metric",
    "restore_callback_states_from_checkpoint": "resume", "seed": "data order and weights",
    "use_cpu": "checked against the runtime's device",
    "do_train": "read by scripts, not by Trainer", "do_eval": "read by scripts, not by Trainer",
    "do_predict": "read by scripts, not by Trainer",
    "resume_from_checkpoint": "read by scripts, not by Trainer",
    "local_rank": "set by the launcher",
}

# Why some settings are refused; any other unlisted one: HaptTrainer's loop lacks it.
_REFUSED_BECAUSE: dict[str, str] = {
    "label_smoothing_factor": "the pipeline's last stage computes plain cross-entropy",
    "per_device_eval_batch_size": "evaluation takes the plan's global batch",
    "activation_checkpointing_kwargs": "stages recompute whole blocks, with no options",
    "gradient_checkpointing_kwargs": "stages recompute whole blocks, with no options",
    "average_tokens_across_devices": "the loss is always the token mean of the whole global "
                                     "batch",
    "data_seed": "the data order follows 'seed'",
    "prediction_loss_only": "predict returns the logits on rank 0",
    "torch_compile": "stages are not compiled",
}


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


def check_training_args_honoured(args: TrainingArguments) -> None:
    """Refuse any TrainingArguments field set away from its default that HaptTrainer does not
    act on (see :data:`HONOURED_TRAINING_ARGS`): one message naming it and why."""
    # the defaults given the honoured settings: __post_init__ derives fields from them
    # (use_cpu=True turns dataloader_pin_memory off), which is no setting of the user's
    init = {f.name for f in fields(args) if f.init}
    defaults = type(args)(**{n: getattr(args, n) for n in HONOURED_TRAINING_ARGS if n in init})
    for f in fields(args):
        if not f.init or f.name in HONOURED_TRAINING_ARGS:
            continue
        given, default = getattr(args, f.name), getattr(defaults, f.name)
        if given != default:
            why = _REFUSED_BECAUSE.get(f.name, "HaptTrainer runs its own pipeline loop, which "
                                               "does not implement it")
            raise TrainingArgsError(f"TrainingArguments({f.name}={given!r}) cannot be honoured: "
                                    f"{why}; leave it at its default {default!r}")


def wants_recompute(args: TrainingArguments) -> bool:
    """Whether the arguments ask for activation checkpointing (under either name)."""
    return bool(getattr(args, "activation_checkpointing", False)
                or getattr(args, "gradient_checkpointing", False))
