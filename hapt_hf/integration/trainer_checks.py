"""What HaptTrainer checks before any step runs: its TrainingArguments, against the plan.

Batch sizes that do not make the plan's global batch, a setting HaptTrainer cannot honour, or a
best-model metric it cannot compute are refused here, before Trainer creates the output
directory.

Precision (:func:`training_args_precision_mismatch`): the plan's precision is the job's one
setting (the runtime autocasts to it and scales the loss when it says so).
``TrainingArguments(bf16=True)`` / ``fp16=True`` are Trainer's way of asking for mixed
precision, and ``accelerate launch --mixed_precision`` reaches them through the environment
(``TrainingArguments.mixed_precision``): they may repeat the plan's choice, or be left off
("follow the plan", their default), but one that asks for another precision cannot be honoured
and is refused, naming both. ``bf16_full_eval`` / ``fp16_full_eval`` (evaluate a model cast to
16 bits) are refused too: the runtime evaluates as it trains, fp32 weights under autocast.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers import TrainingArguments

from hapt_hf.errors import TrainingArgsError
from hapt_hf.planner.plan import Plan

__all__ = ["TrainingArgsError", "BatchMappingError", "check_best_metric", "check_batch_mapping",
           "HONOURED_TRAINING_ARGS",
           "check_training_args_honoured", "wants_recompute", "training_args_precision_mismatch"]

# Every TrainingArguments field HaptTrainer acts on, and how. Any other field set to a value
# other than its default is refused by check_training_args_honoured, so none is ignored.
HONOURED_TRAINING_ARGS: dict[str, str] = {
    "output_dir": "checkpoints and the final model",
    "per_device_train_batch_size": "x gradient_accumulation_steps x processes = global batch",
    "gradient_accumulation_steps": "x per_device_train_batch_size x processes = global batch",
    "per_device_eval_batch_size": "x processes = the rows of an eval batch",
    "data_seed": "the train sampler's seed (accelerate's seedable sampler)",
    "dataloader_drop_last": "the one-process loader's drop_last",
    "remove_unused_columns": "columns the pipeline model does not take are removed",
    "label_names": "['labels'] only (checked): the column the pipeline's loss reads",
    "num_train_epochs": "epochs over the train rows", "max_steps": "optimizer steps",
    "learning_rate": "create_optimizer", "weight_decay": "create_optimizer",
    "adam_beta1": "create_optimizer", "adam_beta2": "create_optimizer",
    "adam_epsilon": "create_optimizer", "optim": "create_optimizer",
    "optim_args": "create_optimizer", "lr_scheduler_type": "create_scheduler",
    "lr_scheduler_kwargs": "create_scheduler", "warmup_steps": "create_scheduler",
    "max_grad_norm": "global clipping over every stage",
    "bf16": "checked against the plan's precision", "fp16": "checked against the plan's precision",
    "bf16_full_eval": "refused when set (training_args_precision_mismatch)",
    "fp16_full_eval": "refused when set (training_args_precision_mismatch)",
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
    "activation_checkpointing_kwargs": "stages recompute whole blocks, with no options",
    "gradient_checkpointing_kwargs": "stages recompute whole blocks, with no options",
    "average_tokens_across_devices": "the loss is always the token mean of the whole global "
                                     "batch",
    "prediction_loss_only": "predict returns the logits on rank 0",
    "torch_compile": "stages are not compiled",
}


class BatchMappingError(TrainingArgsError):
    """TrainingArguments whose batch sizes do not match the plan; the message gives the fix."""


def _group_fix(seq_len: int) -> str:
    return (f"group the texts into blocks of {seq_len} tokens (hapt_hf.integration.data."
            f"pack_tokens(texts, tokenizer, {seq_len}); --seq_len {seq_len} in the recipes)")


def check_best_metric(args: TrainingArguments, compute_metrics: Any = None) -> None:
    """Without ``compute_metrics`` HaptTrainer.evaluate reports the loss only: another
    best-model metric could not be found at the first evaluation, after training started."""
    metric = args.metric_for_best_model
    if metric is not None and compute_metrics is None and metric.removeprefix("eval_") != "loss":
        raise TrainingArgsError(f"metric_for_best_model={metric!r} cannot be honoured: "
                                "without compute_metrics HaptTrainer evaluates the loss only; "
                                "set metric_for_best_model='eval_loss' or give compute_metrics")


def check_batch_mapping(args: TrainingArguments, plan: Plan, world_size: int) -> None:
    """One optimizer step is the plan's global batch: ``per_device_train_batch_size x
    gradient_accumulation_steps x processes`` samples, as Trainer's data parallelism has it."""
    per, acc = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if per * acc * world_size != plan.global_batch_size:
        fits = [f"per_device_train_batch_size={plan.global_batch_size // (a * world_size)} with "
                f"gradient_accumulation_steps={a}" for a in range(1, plan.global_batch_size + 1)
                if plan.global_batch_size % (a * world_size) == 0][:2]
        fix = f"set {' or '.join(fits)}" if fits else "re-plan for another global batch"
        raise BatchMappingError(
            f"per_device_train_batch_size={per} x gradient_accumulation_steps={acc} x "
            f"{world_size} processes = {per * acc * world_size} samples per step, but the plan "
            f"runs global batches of {plan.global_batch_size}; {fix}")


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
    if args.label_names not in (None, ["labels"]):
        raise TrainingArgsError(f"TrainingArguments(label_names={args.label_names!r}) cannot be "
                                "honoured: the pipeline's last stage reads the 'labels' column "
                                "(or the input ids); rename the column to 'labels'")


def wants_recompute(args: TrainingArguments) -> bool:
    """Whether the arguments ask for activation checkpointing (under either name)."""
    return bool(getattr(args, "activation_checkpointing", False)
                or getattr(args, "gradient_checkpointing", False))


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
