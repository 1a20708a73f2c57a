"""HaptTrainer: ``transformers.Trainer`` on a hapt plan, its model split into pipeline stages.

Trainer's inner loop assumes a whole model per rank (DDP, a DistributedSampler, forward and
backward per micro-batch). In a pipeline every rank takes part in each step with the SAME
global batch, and one runtime call runs the step's every micro-batch. So ``train``, ``evaluate``,
``predict`` and the saving are replaced, and what users rely on is kept: ``TrainingArguments``,
``TrainerState``/``TrainerControl``, every callback event, ``self.log``, the logging / eval /
save strategies, ``create_optimizer``/``create_scheduler``, checkpoint rotation and the
best-model bookkeeping. A step is ``per_device_train_batch_size x gradient_accumulation_steps x
processes`` samples, drawn as Trainer draws them on one process (``trainer_data``).
"""
from __future__ import annotations

import dataclasses
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
                                        TrainOutput, rotate_checkpoints, sort_checkpoints, speed_metrics)

from hapt_hf.compat import trainer_api
from hapt_hf.compat.trainer_api import TrainerHooks
from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.integration import elastic
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.config import checkpoint_retries as checkpoint_retries_of
from hapt_hf.integration.launch import read_launch_env
from hapt_hf.integration.plan_resolution import write_plan
from hapt_hf.integration.lora import peft_parts, write_adapter
from hapt_hf.integration.model_export import export_model
from hapt_hf.integration.trainer_checks import training_args_precision_mismatch
from hapt_hf.integration.trainer_checks import (BatchMappingError, check_batch_mapping,
                                                check_best_metric, check_training_args_honoured,
                                                wants_recompute)
from hapt_hf.integration.trainer_data import (as_dataset, check_first_rows, epoch_steps,
                                              step_counts, to_batch, trainer_loader)
from hapt_hf.integration.trainer_eval import EvalPass, count_tokens, eval_pass
from hapt_hf.integration.trainer_setup import hapt_config_of, pipeline_for_model, seq_len_of
from hapt_hf.pipeline.checkpoint_store import Upload
from hapt_hf.pipeline.export import write_stage_shards
from hapt_hf.pipeline.process_group import world_size
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime

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
    """``transformers.Trainer`` on a hapt plan: the same constructor, the model split into
    pipeline stages across the launched processes.

    Args:
        model / args / data_collator / train_dataset / eval_dataset / processing_class /
            model_init / compute_metrics / callbacks / optimizers / optimizer_cls_and_kwargs /
            preprocess_logits_for_metrics: as for ``Trainer``. ``model`` is the whole model
            (its weights are copied into this rank's stage), or a model on the meta device
            whose ``config.name_or_path`` is a local checkpoint (only this stage's tensors are
            read). One optimizer step is ``per_device_train_batch_size x
            gradient_accumulation_steps x processes`` samples, drawn in the order one process
            would draw them (``hapt_hf.integration.trainer_data``).
        compute_loss_func: refused: the pipeline's last stage computes the causal LM loss.
        hapt_config: A :class:`HaptConfig`, a path to ``hapt.yaml``, or None for the
            ``HAPT_CONFIG`` variable. Rank 0 plans on its cluster for the global batch above
            (its own ``global_batch_size``, if set, must agree) or loads its plan.
        runtime: A :class:`PipelineRuntime` built already (its plan decides); instead of
            ``model`` and ``hapt_config``.
        checkpoint_local_dir: A directory on each node's own disk for the checkpoints' portable
            part, copied into the output directory in the background (default: the hapt
            config's ``checkpoint_local_dir``; None: written into the output directory).
        checkpoint_retries: How that copy and a recovery's reads retry (``attempts``,
            ``backoff_s``, ``retry_s``; default: the hapt config's ``checkpoint_retries``, else
            the store's defaults); only with ``checkpoint_local_dir``.
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 model_init=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, hapt_config=None,
                 runtime: PipelineRuntime | None = None,
                 checkpoint_local_dir: str | os.PathLike | None = None,
                 checkpoint_retries: dict[str, float] | None = None) -> None:
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if compute_loss_func is not None:
            raise TrainingArgsError("HaptTrainer(compute_loss_func=...) cannot be honoured: the "
                                    "pipeline's last stage computes the causal LM loss (token "
                                    "mean of the global batch); leave it out")
        check_training_args_honoured(args)
        check_best_metric(args, compute_metrics)
        if model is not None and model_init is not None:
            raise TrainingArgsError("HaptTrainer got model= and model_init=: the stages are built"
                                    " once, from one model; give one of the two")
        if runtime is None:
            if model_init is not None:
                model = model_init()
            if model is None:
                raise TrainingArgsError("HaptTrainer needs model= (or model_init=), as Trainer")
            config = hapt_config_of(hapt_config)
            if checkpoint_local_dir is None:
                checkpoint_local_dir = config.checkpoint_local_dir
            if checkpoint_retries is None:
                checkpoint_retries = config.checkpoint_retries
            seq_len = seq_len_of(config, train_dataset, eval_dataset)
            runtime = pipeline_for_model(model, args, config, seq_len)
        elif model is not None or hapt_config is not None:
            raise TrainingArgsError("HaptTrainer takes runtime= instead of model= and "
                                    "hapt_config=, not with them")
        plan = runtime.plan
        check_batch_mapping(args, plan, world_size())
        trainer_api.see_launched_world(args)
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
        self.checkpoint_local_dir = None if checkpoint_local_dir is None else Path(checkpoint_local_dir)
        if checkpoint_retries is not None:
            if self.checkpoint_local_dir is None:
                raise TrainingArgsError(
                    "checkpoint_retries is set but checkpoint_local_dir is not: the retries are "
                    "those of the background copy from each node's checkpoint_local_dir (and of "
                    "a recovery's reads of it); set checkpoint_local_dir or leave "
                    "checkpoint_retries out")
            checkpoint_retries = checkpoint_retries_of(checkpoint_retries, "HaptTrainer")
        self.checkpoint_retries = checkpoint_retries
        self._upload: Upload | None = None  # the last checkpoint's background copy
        # packed rows given as a tensor become a dataset of {'input_ids', 'labels'} items
        train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset)
        check_first_rows(plan.seq_len, train_dataset=train_dataset, eval_dataset=eval_dataset)
        # Trainer checks the datasets against the strategies (eval_strategy needs eval data).
        super().__init__(model=_StageModel(runtime), args=args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, compute_metrics=compute_metrics,
                         callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        # Trainer divides a step's summed token losses by a count of its own: the same here
        self._lora, inner = peft_parts(model) if model is not None else (None, None)
        self._count_rule = "shifted" if inner is None else trainer_api.loss_count_rule(self, inner)

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
        if self.train_dataset is None:
            raise DataError("HaptTrainer.train needs a train_dataset")
        if kwargs:
            raise TrainingArgsError(f"HaptTrainer.train({sorted(kwargs)[0]}=...) cannot be "
                                    "honoured; leave it out")
        args = self.args
        self.is_in_train = True
        self.model.train()  # as Trainer's training_step; evaluation leaves the mode as it was
        loader = trainer_loader(self, self.train_dataset,
                                args.per_device_train_batch_size * world_size(), training=True)
        steps_per_epoch, max_steps, num_epochs = step_counts(loader, args)
        trainer_api.set_train_batch_size(self, args.per_device_train_batch_size)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        self.state = TrainerState(stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control]
            if isinstance(cb, ExportableState)])
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        resume = elastic.resume_point(  # an elastic restart: the latest checkpoint
            self.runtime.rank, world_size(), ckpt_io.resolve_resume(resume_from_checkpoint,
                                                                    args.output_dir),
            args.output_dir, elastic.plan_groups(self.plan))
        if resume is not None:
            self._load_checkpoint(resume)
        trainer_api.prepare_state(self, max_steps, num_epochs if steps_per_epoch else 1, trial)
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        out = self._train_loop(loader, steps_per_epoch, num_epochs, max_steps, trial,
                               ignore_keys_for_eval)
        self._finish_upload()
        return out

    def _finish_upload(self) -> None:
        """Wait for the last checkpoint's background copy (checkpoint_local_dir)."""
        if self._upload is not None:
            upload, self._upload = self._upload, None
            upload.wait()

    def _train_loop(self, loader, steps_per_epoch: int | None, num_epochs: int, max_steps: int,
                    trial, ignore_keys_for_eval) -> TrainOutput:
        args, start = self.args, time.time()
        first_step = self.state.global_step
        epochs_done, skip = divmod(first_step, steps_per_epoch) if steps_per_epoch \
            else (0, first_step)
        self._loss_since_log, self._last_logged, self._lr = 0.0, first_step, None
        total_loss = 0.0
        g, where = self.plan.global_batch_size, "train_dataset"
        # every check has passed (a resumed checkpoint loaded on every rank): the run's plan
        if args.should_save:
            write_plan(self.plan, args.output_dir, read_launch_env())
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        epoch = epochs_done
        while epoch < num_epochs and not self._done(max_steps):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for step, parts in enumerate(epoch_steps(
                    loader, epoch, args.gradient_accumulation_steps)):
                if epoch == epochs_done and step < skip:
                    continue  # trained before the checkpoint: drawn, not run
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                batch = self._step_batch(parts, g, where)
                self._lr = trainer_api.learning_rate(self)  # the LR this step runs with
                result = self.runtime.train_step(batch, self.optimizer, self.lr_scheduler,
                                                 args.max_grad_norm or None)
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_per_epoch if steps_per_epoch \
                    else self.state.global_step / max_steps
                self.state.num_input_tokens_seen += sum(int(p["input_ids"].numel()) for p in parts)
                self._loss_since_log += result.loss
                total_loss += result.loss
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self._log_save_evaluate(result.grad_norm, trial, ignore_keys_for_eval, start)
                if self._done(max_steps):
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(None, trial, ignore_keys_for_eval, start)
            epoch += 1
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

    def _step_batch(self, parts, rows: int, where: str) -> Batch:
        """The step's global batch, its loss divided as Trainer divides it: by the labels
        that are not -100 before the causal shift where Trainer counts them so (a model whose
        ``loss_type`` is not a causal-LM loss, e.g. GPT2LMHeadModel), else by the tokens
        predicted. (For a model taking no loss kwargs Trainer averages micro-batch means;
        that equals the token mean where its micro-batches hold equal token counts.)"""
        batch = to_batch(parts, rows, self.plan.seq_len, where)
        if self._count_rule == "unshifted":
            batch = dataclasses.replace(batch, num_items=max(1, count_tokens(batch, 0, 'unshifted')))
        return batch

    def _done(self, max_steps: int) -> bool:
        return self.control.should_training_stop or self.state.global_step >= max_steps

    def _log_save_evaluate(self, grad_norm, trial, ignore_keys_for_eval, start: float) -> None:
        if self.control.should_log and self.state.global_step > self._last_logged:
            # The runtime's loss is the whole global batch's mean: what one process would log.
            logs = {"loss": self._loss_since_log / (self.state.global_step - self._last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["learning_rate"] = self._lr if self._lr is not None \
                else trainer_api.learning_rate(self)
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
        """Trainer's evaluation over EVERY row: its loss (the mean over rows of each batch's
        token-mean loss, as Trainer computes it), ``compute_metrics`` on the logits (after
        ``preprocess_logits_for_metrics``, batch by batch) on rank 0, the metrics on every rank.

        Collective. Every stage runs in eval mode under no_grad (as ``model.eval()`` on one
        process) and the training RNG streams are left as they were, so evaluating changes no
        later step. A dict of eval datasets is evaluated one by one, as Trainer does.
        """
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if data is None:
            raise DataError("HaptTrainer.evaluate needs an eval_dataset")
        if isinstance(data, dict):
            metrics: dict[str, float] = {}
            for name, part in data.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        start = time.time()
        out = self._eval_pass(as_dataset(data), metric_key_prefix,
                              with_logits=self.compute_metrics is not None)
        metrics = out.metrics
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=out.num_samples,
                                     num_steps=out.num_batches))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics

    def _eval_pass(self, dataset, prefix: str, with_logits: bool) -> EvalPass:
        loader = trainer_loader(self, dataset,
                                self.args.per_device_eval_batch_size * world_size(), False)
        return eval_pass(self.runtime, loader, self._count_rule, prefix, with_logits,
                         self.preprocess_logits_for_metrics, self.compute_metrics)

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
        """Logits of every row (after ``preprocess_logits_for_metrics``; rank 0, None
        elsewhere), the labels, the loss and ``compute_metrics``, in eval mode. Collective."""
        start = time.time()
        out = self._eval_pass(as_dataset(test_dataset), metric_key_prefix, with_logits=True)
        metrics = out.metrics
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=out.num_samples,
                                     num_steps=out.num_batches))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control,
                                                        metrics)
        return PredictionOutput(predictions=out.predictions, label_ids=out.label_ids,
                                metrics=metrics)

    # -- saving -------------------------------------------------------------------------------
    def _write_model(self, out_dir: Path) -> None:
        """Each stage writes its own weights file, rank 0 the index, config and tokenizer
        (collective; ``pipeline/export.py``)."""
        write_stage_shards(self.runtime, out_dir)
        if self.runtime.rank == 0 and self.processing_class is not None:
            self.processing_class.save_pretrained(str(out_dir))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A standard HF checkpoint (config.json and the weights, each stage's file written by
        that stage: no rank gathers the model).

        Files are written into a temporary directory and moved into place one by one with
        ``os.replace``, so a crash never leaves a truncated weights file.
        """
        out = Path(output_dir or self.args.output_dir)
        if self._lora is None:
            export_model(self.runtime, out, None if self.processing_class is None
                         else lambda d: self.processing_class.save_pretrained(str(d)))
            return
        rank = self.runtime.rank  # saved as Trainer saves a PEFT model: the adapter
        tmp = ckpt_io.begin_model_save(out) if rank == 0 else out / f"{ckpt_io.TMP_PREFIX}save"
        write_adapter(self.runtime, self._lora, tmp, self.processing_class)
        if rank == 0:
            ckpt_io.finish_model_save(tmp, out)
        ckpt_io.barrier()

    def save_checkpoint(self, trial=None) -> None:
        """Commit ``checkpoint-<step>`` atomically (collective): the gathered model, every
        rank's optimizer and scheduler state, the plan, the arguments and the trainer state."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = Path(trainer_api.run_output_dir(self, trial))
        rank = self.runtime.rank
        self._finish_upload()  # the previous copy is whole before another save begins
        tmp = ckpt_io.begin_checkpoint(run_dir, name, rank)
        self._write_model(tmp)
        ckpt_io.save_rank_state(tmp, rank, self.optimizer, self.lr_scheduler,
                                self.runtime.loss_scaler)
        upload = ckpt_io.save_portable_state(tmp, self.runtime, self.optimizer,
                                             self.lr_scheduler, self.checkpoint_local_dir,
                                             self.checkpoint_retries)
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
        if upload is not None:  # into the committed checkpoint's portable/, while training goes on
            self._upload = upload.start()
            ckpt_io.prune_local_copies(self.checkpoint_local_dir, run_dir)

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
    def _load_checkpoint(self, ckpt: Path) -> None:
        """Stage weights, this rank's optimizer/scheduler/RNG, and the trainer state."""
        self.state = ckpt_io.load_checkpoint(ckpt, self.runtime, self.optimizer,
                                             self.lr_scheduler, self.checkpoint_local_dir,
                                             self.checkpoint_retries)
        trainer_api.load_callback_state(self)
