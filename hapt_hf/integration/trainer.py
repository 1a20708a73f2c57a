"""HaptTrainer: ``transformers.Trainer`` driving a pipeline-parallel model.

Why ``train()`` is overridden: Trainer's inner loop (``_inner_training_loop`` / ``_run_epoch``)
assumes one whole model per rank: it wraps the model for DDP through Accelerate, shards the data
with a DistributedSampler, runs forward/backward per micro-batch itself and all-reduces the
logged loss over ranks. In a pipeline every rank holds one stage, every rank must take part in
each step's schedule with the SAME global batch, and one call of the runtime runs all
micro-batches of an optimizer step. So the loop is replaced, and what users rely on is kept:
``TrainingArguments``, ``TrainerState``/``TrainerControl``, every callback event (progress bar,
TensorBoard and other ``report_to`` integrations, early stopping), ``self.log``, logging / eval
/ save strategies, ``create_optimizer``/``create_scheduler`` and ``save_total_limit``.

Batch mapping: one optimizer step consumes the plan's global batch. ``per_device_train_batch_size``
must equal the plan's ``micro_batch_size`` (samples entering the pipeline per micro-batch, split
among a stage's replicas) and ``gradient_accumulation_steps`` the plan's ``num_microbatches``;
their product is ``global_batch_size``. Every rank draws the same global batch (same seeded
order); the runtime gives each stage the samples it needs.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import (PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint,
                                        rotate_checkpoints, speed_metrics)

from hapt_hf.integration import checkpoint as ckpt_io
from hapt_hf.integration.data import epoch_order
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime
from hapt_hf.planner.plan import Plan

__all__ = ["HaptTrainer", "BatchMappingError"]

TRAINER_STATE = ckpt_io.TRAINER_STATE


class BatchMappingError(ValueError):
    """TrainingArguments whose batch sizes do not match the plan; the message gives the fix."""


class _StageModel(nn.Module):
    """What Trainer sees as ``model``: this rank's stage. The pipeline runtime runs it."""

    def __init__(self, runtime: PipelineRuntime) -> None:
        super().__init__()
        self.stage = runtime.stage
        self.config = runtime.stage.config

    def forward(self, input_ids=None, labels=None, attention_mask=None):
        raise RuntimeError("a pipeline stage is run by PipelineRuntime, not called directly; "
                           "use HaptTrainer.train/evaluate or runtime.predict_logits")


def _as_rows(data: Any, field: str) -> torch.Tensor:
    """Packed token rows [samples, seq_len] from a tensor or a dataset with 'input_ids'."""
    if data is None:
        raise ValueError(f"HaptTrainer needs a {field}")
    if isinstance(data, torch.Tensor):
        rows = data
    else:
        rows = torch.as_tensor(data["input_ids"])
    if rows.ndim != 2:
        raise ValueError(f"{field} must be packed rows [samples, seq_len]; got shape "
                         f"{tuple(rows.shape)} (see hapt_hf.integration.data.pack_tokens)")
    return rows.long()


def check_batch_mapping(args: TrainingArguments, plan: Plan) -> None:
    if (args.per_device_train_batch_size, args.gradient_accumulation_steps) != (
            plan.micro_batch_size, plan.num_microbatches):
        raise BatchMappingError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} and "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} do not match the "
            f"plan: set per_device_train_batch_size={plan.micro_batch_size} (the plan's "
            f"micro_batch_size) and gradient_accumulation_steps={plan.num_microbatches} (its "
            f"num_microbatches), or re-plan for another global batch")


class HaptTrainer(Trainer):
    """A Trainer whose model is split into pipeline stages across ranks.

    Args:
        runtime: This rank's :class:`~hapt_hf.pipeline.runtime.PipelineRuntime`.
        plan: The plan the runtime runs (every rank holds the same one).
        args: The usual ``TrainingArguments`` (batch sizes must match the plan, see module doc).
        train_dataset / eval_dataset: packed token rows ``[samples, seq_len]`` (a tensor or a
            dataset with an ``input_ids`` column).
        processing_class: Tokenizer, saved next to the model.
        callbacks / optimizers: as for ``Trainer``.
    """

    def __init__(self, runtime: PipelineRuntime, plan: Plan, args: TrainingArguments,
                 train_dataset=None, eval_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None)) -> None:
        check_batch_mapping(args, plan)
        self.runtime = runtime
        self.plan = plan
        self.train_rows = _as_rows(train_dataset, "train_dataset") if train_dataset is not None \
            else None
        self.eval_rows = _as_rows(eval_dataset, "eval_dataset") if eval_dataset is not None \
            else None
        # Trainer checks the datasets against the strategies (eval_strategy needs eval data).
        super().__init__(model=_StageModel(runtime), args=args, train_dataset=self.train_rows,
                         eval_dataset=self.eval_rows, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers)

    # -- batches ------------------------------------------------------------------------------
    def _batch(self, rows: torch.Tensor) -> Batch:
        return Batch(input_ids=rows, labels=rows.clone())

    def _steps_per_epoch(self) -> int:
        steps = len(self.train_rows) // self.plan.global_batch_size
        if steps == 0:
            raise ValueError(f"the training data has {len(self.train_rows)} samples, fewer than "
                             f"one global batch ({self.plan.global_batch_size}); give more data "
                             "or a smaller global batch")
        return steps

    def _train_batch(self, epoch: int, step: int) -> torch.Tensor:
        g = self.plan.global_batch_size
        order = epoch_order(len(self.train_rows), self.args.seed, epoch)
        return self.train_rows[order[step * g:(step + 1) * g]]

    # -- training -----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval=None, **kwargs) -> TrainOutput:
        if self.train_rows is None:
            raise ValueError("HaptTrainer.train needs a train_dataset")
        args = self.args
        self.is_in_train = True
        steps_per_epoch = self._steps_per_epoch()
        # As Trainer: max_steps wins; otherwise a (possibly fractional) number of epochs.
        max_steps = args.max_steps if args.max_steps > 0 \
            else max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        self._train_batch_size = self.plan.global_batch_size
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        self.state = TrainerState(stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control]
            if isinstance(cb, ExportableState)])
        self.state.train_batch_size = self.plan.global_batch_size
        self.state.compute_steps(args, max_steps)
        resume = self._resolve_resume(resume_from_checkpoint)
        if resume is not None:
            self._load_checkpoint(resume)
        self.state.init_training_references(self, max_steps, num_epochs, trial)
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        return self._train_loop(steps_per_epoch, num_epochs, max_steps, trial,
                                ignore_keys_for_eval)

    def _train_loop(self, steps_per_epoch: int, num_epochs: int, max_steps: int, trial,
                    ignore_keys_for_eval) -> TrainOutput:
        args, start = self.args, time.time()
        first_step = self.state.global_step
        epochs_done, skip = divmod(first_step, steps_per_epoch)
        self._loss_since_log, self._last_logged = 0.0, first_step
        total_loss = 0.0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        for epoch in range(epochs_done, num_epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for step in range(skip if epoch == epochs_done else 0, steps_per_epoch):
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                rows = self._train_batch(epoch, step)
                result = self.runtime.train_step(self._batch(rows), self.optimizer,
                                                 self.lr_scheduler, args.max_grad_norm or None)
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_per_epoch
                self.state.num_input_tokens_seen += rows.numel()
                self._loss_since_log += result.loss
                total_loss += result.loss
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self._log_save_evaluate(result.grad_norm, trial, ignore_keys_for_eval, start)
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(None, trial, ignore_keys_for_eval, start)
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break
        steps_run = self.state.global_step - first_step
        metrics = speed_metrics("train", start, num_samples=steps_run * self.plan.global_batch_size,
                                num_steps=steps_run)
        metrics["train_loss"] = total_loss / max(steps_run, 1)
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _log_save_evaluate(self, grad_norm, trial, ignore_keys_for_eval, start: float) -> None:
        if self.control.should_log and self.state.global_step > self._last_logged:
            # The runtime's loss is the whole global batch's mean: what one process would log.
            logs = {"loss": self._loss_since_log / (self.state.global_step - self._last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["learning_rate"] = self._get_learning_rate()
            self._loss_since_log, self._last_logged = 0.0, self.state.global_step
            self.log(logs, start)
        if self.control.should_evaluate:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Mean loss over the eval data's whole global batches (a ragged tail is left out)."""
        rows = _as_rows(eval_dataset, "eval_dataset") if eval_dataset is not None \
            else self.eval_rows
        if rows is None:
            raise ValueError("HaptTrainer.evaluate needs an eval_dataset")
        g = self.plan.global_batch_size
        batches = len(rows) // g
        if batches == 0:
            raise ValueError(f"the eval data has {len(rows)} samples, fewer than one global "
                             f"batch ({g}); give more eval data")
        start = time.time()
        # Packed rows have no padding, so every batch has the same token count: the mean of
        # batch means is the token mean.
        losses = [self.runtime.evaluate(self._batch(rows[i * g:(i + 1) * g]))
                  for i in range(batches)]
        metrics = {f"{metric_key_prefix}_loss": sum(losses) / batches}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=batches * g,
                                     num_steps=batches))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics

    # -- saving -------------------------------------------------------------------------------
    def _tied_keys(self) -> list[str]:
        adapter = self.runtime.stage.adapter
        if getattr(self.runtime.stage.config, "tie_word_embeddings", False):
            return [adapter.output_embedding_key]
        return []

    def _write_model(self, out_dir: Path) -> None:
        """Gather every stage's weights (collective) and write them on rank 0."""
        full = self.runtime.gather_state_dict(dst=0)
        if self.runtime.rank == 0:
            ckpt_io.save_hf_model(full, self.runtime.stage.config, out_dir, self._tied_keys())
            if self.processing_class is not None:
                self.processing_class.save_pretrained(str(out_dir))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A standard HF checkpoint (config.json + model.safetensors) gathered from all stages.

        Files are written into a temporary directory and moved into place one by one with
        ``os.replace``, so a crash never leaves a truncated model.safetensors.
        """
        out = Path(output_dir or self.args.output_dir)
        rank = self.runtime.rank
        tmp = out / f"{ckpt_io.TMP_PREFIX}save"
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed save
                shutil.rmtree(tmp)
            tmp.mkdir()
        self._write_model(tmp)
        if rank == 0:
            ckpt_io.fsync_tree(tmp)
            for path in sorted(tmp.iterdir()):
                os.replace(path, out / path.name)
            tmp.rmdir()
            ckpt_io.fsync_path(out)
        ckpt_io.barrier()

    def _save_checkpoint(self, model, trial) -> None:
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = Path(self._get_output_dir(trial=trial))
        rank = self.runtime.rank
        tmp = ckpt_io.begin_checkpoint(run_dir, name, rank)
        self._write_model(tmp)
        ckpt_io.save_rank_state(tmp, rank, self.optimizer, self.lr_scheduler)
        if rank == 0:
            self.plan.save(tmp / "plan.json")
            torch.save(self.args, tmp / "training_args.bin")
            self.state.save_to_json(str(tmp / TRAINER_STATE))
        ckpt_io.commit_checkpoint(tmp, run_dir / name, rank)
        if rank == 0:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint,
                               use_mtime=False)
        ckpt_io.barrier()

    # -- resuming -----------------------------------------------------------------------------
    def _resolve_resume(self, resume: str | bool | None) -> Path | None:
        if resume is None or resume is False:
            return None
        if resume is True:
            last = get_last_checkpoint(self.args.output_dir) \
                if os.path.isdir(self.args.output_dir) else None
            if last is None:
                raise ckpt_io.CheckpointError(f"resume_from_checkpoint=True but "
                                              f"{self.args.output_dir!r} holds no checkpoint-N "
                                              "directory")
            return Path(last)
        return Path(resume)

    def _load_checkpoint(self, ckpt: Path) -> None:
        """Stage weights, this rank's optimizer/scheduler/RNG, and the trainer state."""
        self.state = ckpt_io.load_checkpoint(ckpt, self.runtime, self.optimizer,
                                             self.lr_scheduler)
        self._load_callback_state()
