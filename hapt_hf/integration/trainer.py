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

Batch mapping, as Trainer's data parallelism defines it: one optimizer step consumes
``per_device_train_batch_size x gradient_accumulation_steps x processes`` samples, the plan's
global batch (the planner splits it into its own micro-batches), drawn in the order Trainer on
one process would draw them (:mod:`hapt_hf.integration.trainer_data`). Every rank draws the same
global batch; the runtime gives each stage the samples it needs.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_pt_utils import nested_concat, nested_numpify
from transformers.trainer_utils import (PREFIX_CHECKPOINT_DIR, EvalPrediction,
                                        PredictionOutput, SaveStrategy, denumpify_detensorize,
                                        TrainOutput, get_last_checkpoint, rotate_checkpoints,
                                        sort_checkpoints, speed_metrics)

from hapt_hf.compat import trainer_api
from hapt_hf.compat.trainer_api import TrainerHooks
from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.launch import read_launch_env, write_plan
from hapt_hf.integration.lora import adapter_state, peft_parts
from hapt_hf.integration.precision_args import training_args_precision_mismatch
from hapt_hf.integration.trainer_checks import (BatchMappingError, check_batch_mapping,
                                                check_best_metric, check_training_args_honoured,
                                                wants_recompute)
from hapt_hf.integration.trainer_data import (RowsDataset, fill_rows, one_process_loader,
                                              slice_rows, steps, to_batch)
from hapt_hf.integration.trainer_setup import hapt_config_of, pipeline_for_model, seq_len_of
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime

__all__ = ["HaptTrainer", "TrainingArgsError", "BatchMappingError", "check_batch_mapping"]

TRAINER_STATE = ckpt_io.TRAINER_STATE


class _EvalPass(NamedTuple):
    """What one forward pass over a dataset gives (logits after preprocessing, rank 0)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, Any]
    num_samples: int
    num_batches: int


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
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 model_init=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, hapt_config=None,
                 runtime: PipelineRuntime | None = None) -> None:
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if compute_loss_func is not None:
            raise TrainingArgsError("HaptTrainer(compute_loss_func=...) cannot be honoured: the "
                                    "pipeline's last stage computes the causal LM loss (token "
                                    "mean of the global batch); leave it out")
        check_training_args_honoured(args)
        check_best_metric(args, compute_metrics)
        if runtime is None:
            if model is None and model_init is not None:
                model = model_init()
            if model is None:
                raise TrainingArgsError("HaptTrainer needs model= (or model_init=), as Trainer "
                                        "does")
            config = hapt_config_of(hapt_config)
            seq_len = seq_len_of(config, train_dataset, eval_dataset)
            _, runtime, _ = pipeline_for_model(model, args, config, seq_len)
        elif model is not None or hapt_config is not None:
            raise TrainingArgsError("HaptTrainer takes runtime= instead of model= and "
                                    "hapt_config=, not with them")
        plan = runtime.plan
        check_batch_mapping(args, plan, runtime_world())
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
        # packed rows given as a tensor become a dataset of {'input_ids', 'labels'} items
        train_dataset, eval_dataset = _as_dataset(train_dataset), _as_dataset(eval_dataset)
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

    # -- batches ------------------------------------------------------------------------------
    def _loader(self, dataset: Any, batch_size: int, training: bool):
        """The loader Trainer prepares on ONE process for ``dataset`` (its sampler, collator
        and column removal), ``batch_size`` rows a batch; every rank draws the same."""
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = trainer_api.remove_unused_columns(self, dataset, "Training" if training
                                                        else "Evaluation")
        else:
            collator = trainer_api.collator_with_removed_columns(self, collator, "Training")
        sampler = None
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = (self._get_train_sampler(dataset) if training
                       else torch.utils.data.SequentialSampler(dataset))
        seedable = self.args.accelerator_config.use_seedable_sampler and training
        return one_process_loader(dataset, batch_size, collator, sampler,
                                  self.args.dataloader_drop_last, seedable, self.args.data_seed)

    def _train_loader(self):
        world = runtime_world()
        return self._loader(self.train_dataset, self.args.per_device_train_batch_size * world,
                            training=True)

    def _steps_per_epoch(self, loader) -> int | None:
        """Optimizer steps in one pass (Trainer's count: a short last step counts); None for
        a loader without a length (an iterable dataset)."""
        try:
            batches = len(loader)
        except TypeError:
            return None
        acc = self.args.gradient_accumulation_steps
        return batches // acc + int(batches % acc > 0)

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
        loader = self._train_loader()
        steps_per_epoch = self._steps_per_epoch(loader)
        if steps_per_epoch is None and args.max_steps <= 0:
            raise TrainingArgsError("the train_dataset has no length (an iterable dataset): set "
                                    "max_steps, as Trainer requires")
        if steps_per_epoch == 0:
            raise DataError(f"the train_dataset gives no batch of "
                            f"{args.per_device_train_batch_size * runtime_world()} rows "
                            "(dataloader_drop_last with fewer rows?); give more data")
        # As Trainer: max_steps wins; otherwise a (possibly fractional) number of epochs.
        max_steps = args.max_steps if args.max_steps > 0 \
            else max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        num_epochs = math.ceil(max_steps / steps_per_epoch) if steps_per_epoch else sys.maxsize
        trainer_api.set_train_batch_size(self, args.per_device_train_batch_size)
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        self.state = TrainerState(stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control]
            if isinstance(cb, ExportableState)])
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        resume = self._resolve_resume(resume_from_checkpoint)
        if resume is not None:
            self._load_checkpoint(resume)
        trainer_api.prepare_state(self, max_steps, num_epochs if steps_per_epoch else 1, trial)
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        return self._train_loop(loader, steps_per_epoch, num_epochs, max_steps, trial,
                                ignore_keys_for_eval)

    def _epoch_steps(self, loader, epoch: int):
        """The optimizer steps of one pass, as Trainer's loop draws them (set_epoch first)."""
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        return steps(iter(loader), self.args.gradient_accumulation_steps)

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
            for step, parts in enumerate(self._epoch_steps(loader, epoch)):
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
            batch = dataclasses.replace(batch, num_items=max(1, self._count(batch, 0)))
        return batch

    def _count(self, batch: Batch, predicted: int) -> int:
        """The tokens Trainer divides ``batch``'s summed loss by (``predicted``: the tokens
        after the causal shift that are not -100)."""
        return int((batch.labels != -100).sum()) if self._count_rule == "unshifted" else predicted

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
        out = self._eval_pass(_as_dataset(data), metric_key_prefix,
                              with_logits=self.compute_metrics is not None)
        metrics = out.metrics
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=out.num_samples,
                                     num_steps=out.num_batches))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics

    def _eval_pass(self, dataset, prefix: str, with_logits: bool) -> _EvalPass:
        """One forward pass over every row of ``dataset`` in the one-process eval batches of
        ``per_device_eval_batch_size x processes`` rows (each run as global batches of the
        plan, the last one filled with ignored rows)."""
        world, g = runtime_world(), self.plan.global_batch_size
        loader = self._loader(dataset, self.args.per_device_eval_batch_size * world,
                              training=False)
        weighted, rows_seen, batches = 0.0, 0, 0
        preds, labels = None, None
        for part in loader:
            batch = to_batch([part], None, self.plan.seq_len, "eval_dataset")
            loss_sum, tokens, logits = 0.0, 0, []
            for lo in range(0, len(batch.input_ids), g):
                chunk = fill_rows(slice_rows(batch, lo, lo + g), g)
                real = min(g, len(batch.input_ids) - lo)
                n = int((chunk.labels[:, 1:] != -100).sum())
                if with_logits:
                    pred = self.runtime.predict(chunk)
                    loss = pred.loss
                    if pred.logits is not None:
                        logits.append(pred.logits[:real])
                else:
                    loss = self.runtime.evaluate(chunk)
                loss_sum, tokens = loss_sum + loss * n, tokens + self._count(chunk, n)
            rows = len(batch.input_ids)
            if tokens:
                weighted += loss_sum / tokens * rows
                rows_seen += rows
            batches += 1
            if logits:
                lab = batch.labels
                out = torch.cat(logits)
                if self.preprocess_logits_for_metrics is not None:
                    out = self.preprocess_logits_for_metrics(out, lab)
                preds = out if preds is None else nested_concat(preds, out, padding_index=-100)
                labels = lab if labels is None else nested_concat(labels, lab, padding_index=-100)
        metrics = {f"{prefix}_loss": weighted / max(rows_seen, 1)}
        metrics.update(self._metrics(preds, labels, prefix))
        return _EvalPass(None if preds is None else nested_numpify(preds),
                         None if labels is None else nested_numpify(labels), metrics, rows_seen,
                         batches)

    def _metrics(self, preds, labels, prefix: str) -> dict[str, Any]:
        """``compute_metrics`` on rank 0 (which holds the logits), the result on every rank."""
        if self.compute_metrics is None:
            return {}
        found: dict[str, Any] = {}
        if self.runtime.rank == 0:
            found = denumpify_detensorize(self.compute_metrics(EvalPrediction(
                predictions=nested_numpify(preds), label_ids=nested_numpify(labels))))
        if runtime_world() > 1:
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in found.items()}

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
        out = self._eval_pass(_as_dataset(test_dataset), metric_key_prefix, with_logits=True)
        metrics = out.metrics
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=out.num_samples,
                                     num_steps=out.num_batches))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control,
                                                        metrics)
        return PredictionOutput(predictions=out.predictions, label_ids=out.label_ids,
                                metrics=metrics)

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
        if self._lora is not None:
            self._write_adapter(tmp)
        else:
            self._write_model(tmp)
        if rank == 0:
            ckpt_io.finish_model_save(tmp, out)
        ckpt_io.barrier()

    def _write_adapter(self, out_dir: Path) -> None:
        """A PEFT model is saved as Trainer saves it, the adapter only: adapter_config.json and
        adapter_model.safetensors (``PeftModel.from_pretrained(base, out)`` loads them)."""
        from safetensors.torch import save_file
        full = self.runtime.gather_state_dict(dst=0)
        if self.runtime.rank != 0:
            return
        save_file({k: v.contiguous() for k, v in adapter_state(full).items()},
                  str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        self._lora.save_pretrained(str(out_dir))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(out_dir))

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


def runtime_world() -> int:
    """Processes in the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _is_hf_dataset(data: Any) -> bool:
    try:
        import datasets
    except ImportError:  # datasets is a dependency; kept optional here for clarity
        return False
    return isinstance(data, (datasets.Dataset, datasets.IterableDataset))


def _as_dataset(data: Any) -> Any:
    """Packed token rows given as a tensor (or a list of rows) become a dataset of
    ``{'input_ids', 'labels'}`` items; anything else is taken as Trainer takes it."""
    if isinstance(data, torch.Tensor):
        if data.ndim != 2 or data.is_floating_point():
            raise DataError(f"a dataset given as a tensor must hold integer token rows "
                            f"[samples, seq_len]; got {data.dtype} {tuple(data.shape)}")
        return RowsDataset(data.long())
    return data
