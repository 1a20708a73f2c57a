"""HaptTrainer: ``transformers.Trainer`` driving a pipeline-parallel model.

Why ``train()`` is overridden: Trainer's inner loop (``_inner_training_loop`` / ``_run_epoch``)
assumes one whole model per rank: it wraps the model for DDP through Accelerate, shards the data
with a DistributedSampler, runs forward/backward per micro-batch itself and all-reduces the
logged loss over ranks. In a pipeline every rank holds one stage, every rank must take part in
each step's schedule with the SAME global batch, and one call of the runtime runs all
micro-batches of an optimizer step. So the loop is replaced, and what users rely on is kept:
``TrainingArguments``, ``TrainerState``/``TrainerControl``, every callback event (progress bar,
TensorBoard and other ``report_to`` integrations, early stopping), ``self.log``, logging / eval
/ save strategies, ``create_optimizer``/``create_scheduler``, ``save_total_limit`` and the
best-model bookkeeping (``metric_for_best_model``, ``load_best_model_at_end``). ``evaluate``,
``predict`` and ``prediction_step`` run the pipeline forward only, in eval mode.

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
from transformers.trainer_utils import (PREFIX_CHECKPOINT_DIR, PredictionOutput, SaveStrategy,
                                        TrainOutput, get_last_checkpoint, rotate_checkpoints,
                                        sort_checkpoints, speed_metrics)

from hapt_hf.compat import trainer_api
from hapt_hf.compat.trainer_api import TrainerHooks
from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.data import epoch_order
from hapt_hf.integration.trainer_checks import (BatchMappingError, as_rows, check_batch_mapping,
                                                check_best_metric, check_enough,
                                                check_training_args_honoured, wants_recompute)
from hapt_hf.integration.precision_args import training_args_precision_mismatch
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime
from hapt_hf.planner.plan import Plan

__all__ = ["HaptTrainer", "TrainingArgsError", "BatchMappingError", "check_batch_mapping"]

TRAINER_STATE = ckpt_io.TRAINER_STATE


class _StageModel(nn.Module):
    """What Trainer sees as ``model``: this rank's stage. The pipeline runtime runs it."""

    def __init__(self, runtime: PipelineRuntime) -> None:
        super().__init__()
        self.stage = runtime.stage
        self.config = runtime.stage.config

    def forward(self, input_ids=None, labels=None, attention_mask=None):
        raise RuntimeError("a pipeline stage is run by PipelineRuntime, not called directly; "
                           "use HaptTrainer.train/evaluate/predict or runtime.predict")


class HaptTrainer(TrainerHooks, Trainer):
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
        check_training_args_honoured(args)
        check_batch_mapping(args, plan)
        check_best_metric(args)
        if (mismatch := training_args_precision_mismatch(args, plan)) is not None:
            raise TrainingArgsError(mismatch)
        if args.use_cpu and runtime.device.type != "cpu":
            raise TrainingArgsError(f"TrainingArguments(use_cpu=True) but the runtime runs on "
                                    f"{runtime.device}; build it with RuntimeConfig(device='cpu')"
                                    " or leave use_cpu False")
        if wants_recompute(args):
            # activation checkpointing is the stages' own recompute (numerics unchanged)
            runtime.stage.recompute = True
        self.runtime = runtime
        self.plan = plan
        # the data is checked against the plan before Trainer creates the output directory
        self.train_rows = self._checked_rows(train_dataset, "train_dataset")
        self.eval_rows = self._checked_rows(eval_dataset, "eval_dataset")
        # Trainer checks the datasets against the strategies (eval_strategy needs eval data).
        super().__init__(model=_StageModel(runtime), args=args, train_dataset=self.train_rows,
                         eval_dataset=self.eval_rows, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers)

    # -- batches ------------------------------------------------------------------------------
    def _checked_rows(self, data: Any, field: str) -> torch.Tensor | None:
        if data is None:
            return None
        rows = as_rows(data, field, self.plan)
        check_enough(rows, field, self.plan)
        return rows

    def _batch(self, rows: torch.Tensor) -> Batch:
        return Batch(input_ids=rows, labels=rows.clone())

    def _steps_per_epoch(self) -> int:
        return len(self.train_rows) // self.plan.global_batch_size  # >= 1: checked at init

    def _train_batch(self, epoch: int, step: int) -> torch.Tensor:
        g = self.plan.global_batch_size
        order = epoch_order(len(self.train_rows), self.args.seed, epoch)
        return self.train_rows[order[step * g:(step + 1) * g]]

    # -- training -----------------------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer (``TrainingArguments.optim``, or the one given in
        ``optimizers``) over this rank's stage, holding its state as the plan says: split among
        the stage's replicas where the stage's ``optimizer`` is ``sharded`` (an optimizer that
        cannot be is refused, naming the fix). The LR scheduler is built on it as usual."""
        super().create_optimizer(model)
        self.optimizer = self.runtime.prepare_optimizer(self.optimizer)
        return self.optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval=None, **kwargs) -> TrainOutput:
        if self.train_rows is None:
            raise DataError("HaptTrainer.train needs a train_dataset")
        args = self.args
        self.is_in_train = True
        self.model.train()  # as Trainer's training_step; evaluation leaves the mode as it was
        steps_per_epoch = self._steps_per_epoch()
        # As Trainer: max_steps wins; otherwise a (possibly fractional) number of epochs.
        max_steps = args.max_steps if args.max_steps > 0 \
            else max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        num_epochs = math.ceil(max_steps / steps_per_epoch)
        trainer_api.set_train_batch_size(self, self.plan.global_batch_size)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        self.state = TrainerState(stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control]
            if isinstance(cb, ExportableState)])
        self.state.train_batch_size = self.plan.global_batch_size
        self.state.compute_steps(args, max_steps)
        resume = self._resolve_resume(resume_from_checkpoint)
        if resume is not None:
            self._load_checkpoint(resume)
        trainer_api.prepare_state(self, max_steps, num_epochs, trial)
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
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self.load_best_model()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _log_save_evaluate(self, grad_norm, trial, ignore_keys_for_eval, start: float) -> None:
        if self.control.should_log and self.state.global_step > self._last_logged:
            # The runtime's loss is the whole global batch's mean: what one process would log.
            logs = {"loss": self._loss_since_log / (self.state.global_step - self._last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["learning_rate"] = trainer_api.learning_rate(self)
            self._loss_since_log, self._last_logged = 0.0, self.state.global_step
            self.log(logs, start)
        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
            # Trainer's own best-metric bookkeeping (state.best_metric, best_global_step)
            is_new_best = trainer_api.determine_best_metric(self, metrics, trial)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_new_best
        if self.control.should_save:
            self.save_checkpoint(trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Mean loss over the eval data's whole global batches (a ragged tail is left out).

        Every stage runs in eval mode under no_grad (as ``model.eval()`` on one process) and
        the training RNG streams are left as they were, so evaluating changes no later step.
        """
        rows = self._checked_rows(eval_dataset, "eval_dataset") if eval_dataset is not None \
            else self.eval_rows
        if rows is None:
            raise DataError("HaptTrainer.evaluate needs an eval_dataset")
        g = self.plan.global_batch_size
        batches = len(rows) // g
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

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys=None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor | None]:
        """(loss, logits, labels) of ONE global batch ``inputs['input_ids']`` [G, seq], in eval
        mode. Collective: every rank calls it with the same inputs; the logits (when
        ``prediction_loss_only`` is False) come back on rank 0 only, None elsewhere."""
        batch = Batch(input_ids=inputs["input_ids"], labels=inputs.get("labels"),
                      attention_mask=inputs.get("attention_mask"))
        if prediction_loss_only:
            return torch.tensor(self.runtime.evaluate(batch)), None, None
        pred = self.runtime.predict(batch)
        return torch.tensor(pred.loss), pred.logits, inputs.get("labels")

    def predict(self, test_dataset, ignore_keys=None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Logits of every sample (rank 0; None elsewhere) and the mean loss, in eval mode.

        Collective: every rank calls it. A last batch short of the global batch is filled with
        copies of its first row whose labels are all ignored, and their logits are dropped.
        """
        rows = as_rows(test_dataset, "test_dataset", self.plan)
        if len(rows) == 0:
            raise DataError("test_dataset is empty; give at least one row to predict")
        g, start = self.plan.global_batch_size, time.time()
        parts, loss_sum, tokens = [], 0.0, 0
        for lo in range(0, len(rows), g):
            chunk = rows[lo:lo + g]
            labels = torch.cat([chunk, torch.full_like(chunk[:1], -100).expand(g - len(chunk), -1)])
            ids = torch.cat([chunk, chunk[:1].expand(g - len(chunk), -1)])
            pred = self.runtime.predict(Batch(input_ids=ids, labels=labels))
            n = int((labels[:, 1:] != -100).sum())
            loss_sum, tokens = loss_sum + pred.loss * n, tokens + n
            if pred.logits is not None:
                parts.append(pred.logits[:len(chunk)])
        metrics = {f"{metric_key_prefix}_loss": loss_sum / max(tokens, 1)}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=len(rows),
                                     num_steps=math.ceil(len(rows) / g)))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control,
                                                        metrics)
        logits = torch.cat(parts) if parts else None
        return PredictionOutput(predictions=logits, label_ids=rows, metrics=metrics)

    # -- saving -------------------------------------------------------------------------------
    def _write_model(self, out_dir: Path) -> None:
        """Gather every stage's weights (collective) and write them on rank 0."""
        if ckpt_io.write_gathered_model(self.runtime, out_dir):
            if self.processing_class is not None:
                self.processing_class.save_pretrained(str(out_dir))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A standard HF checkpoint (config.json + model.safetensors) gathered from all stages.

        Files are written into a temporary directory and moved into place one by one with
        ``os.replace``, so a crash never leaves a truncated model.safetensors.
        """
        out = Path(output_dir or self.args.output_dir)
        rank = self.runtime.rank
        tmp = ckpt_io.begin_model_save(out) if rank == 0 else out / f"{ckpt_io.TMP_PREFIX}save"
        self._write_model(tmp)
        if rank == 0:
            ckpt_io.finish_model_save(tmp, out)
        ckpt_io.barrier()

    def save_checkpoint(self, trial=None) -> None:
        """Commit ``checkpoint-<step>`` atomically (collective): the gathered model, every
        rank's optimizer and scheduler state, the plan, the arguments and the trainer state."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = Path(trainer_api.run_output_dir(self, trial))
        rank = self.runtime.rank
        tmp = ckpt_io.begin_checkpoint(run_dir, name, rank)
        self._write_model(tmp)
        ckpt_io.save_rank_state(tmp, rank, self.optimizer, self.lr_scheduler,
                                self.runtime.loss_scaler)
        self._track_best_checkpoint(run_dir)
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

    def _track_best_checkpoint(self, run_dir: Path) -> None:
        """As Trainer: the best evaluation's checkpoint, once it is saved (this one, or one
        already committed), becomes ``state.best_model_checkpoint``, on every rank."""
        step = self.state.best_global_step
        if not step:
            return
        best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if step == self.state.global_step or best.is_dir():
            self.state.best_model_checkpoint = str(best)

    def load_best_model(self) -> None:
        """Every rank reads its own stage's tensors of the best checkpoint; with
        ``save_total_limit=1`` the last checkpoint, if not the best, is then removed (as
        Trainer does)."""
        best = Path(self.state.best_model_checkpoint)
        ckpt_io.load_stage_weights(self.runtime.stage, best)
        ckpt_io.barrier()  # every rank has read it before any checkpoint is removed
        if self.runtime.rank == 0 and self.args.save_total_limit == 1:
            for ckpt in sort_checkpoints(str(best.parent)):
                if not os.path.samefile(ckpt, best):
                    shutil.rmtree(ckpt, ignore_errors=True)
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
        trainer_api.load_callback_state(self)
