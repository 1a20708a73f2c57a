"""What :meth:`HaptAccelerator.prepare` hands back besides the DataLoaders (those are in
``accelerate_data``): the model (:class:`PipelineEngine`), the optimizer
(:class:`PipelineOptimizer`) and the model out of ``unwrap_model`` (:class:`PipelineModelView`),
objects whose calls mean what they mean under Accelerate, on a pipeline that runs every
process's rows of an optimizer step together.

The loop keeps Accelerate's shape: the prepared DataLoader yields each process its own batches,
``accumulate`` decides the sync points, the optimizer steps and zeroes only on them, the
scheduler is Accelerate's own ``AcceleratedScheduler``. What changes is where the work happens:
at the first micro-step of an accumulation window, ``model(**batch)`` runs the pipeline over the
window's rows of EVERY process (read from the loader, which every rank draws alike), so the
window's gradients are in place before ``optimizer.step()``; the window's later micro-steps only
hand back its loss. ``accelerator.clip_grad_norm_`` then clips by the global norm exactly where
a one-process loop clips.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from accelerate.state import GradientState
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hapt_hf.errors import DataError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.accelerate_data import (BATCH_KEYS, AccelerateSettingError, Cursor, Fed,
                                                 PipelineDataLoader)
from hapt_hf.integration.lora import peft_parts
from hapt_hf.integration.model_export import export_model
from hapt_hf.integration.trainer_data import fill_rows
from hapt_hf.pipeline.process_group import world_size
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime
from hapt_hf.pipeline.zero import check_optimizer

# AccelerateSettingError is accelerate_data's, named here too for the modules that raise it
__all__ = ["AccelerateSettingError", "PipelineEngine", "PipelineOptimizer", "PipelineModelView",
           "WindowStart", "save_gathered_model"]


# -- the prepared model ------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowStart:
    """The loop's state just before an accumulation window's first micro-step: what a
    ``save_state`` inside the window saves, so that resuming re-runs the whole window."""

    step: int
    """``accelerator.step`` before the window."""
    rng: tuple[Tensor, list[Tensor] | None]
    """The torch CPU (and CUDA) RNG states before the pipeline ran the window."""
    schedulers: list[dict]
    """Each prepared LR scheduler's state before the window."""


@dataclass
class _Window:
    """The accumulation window the pipeline has run: micro-steps ``first..last`` of one loader
    iteration (``key``), ``next`` the one expected now."""

    key: tuple[int, int]
    first: int
    last: int
    next: int
    loss: float
    start: WindowStart | None
    cursor: Cursor


class PipelineEngine(nn.Module):
    """The prepared model.

    In train mode with gradients enabled, ``model(**batch)`` takes a batch of a prepared
    DataLoader. At the first micro-step of an accumulation window (from there to the next
    micro-step ``accumulate`` syncs on) it runs every forward and backward of the window's rows
    of every process, the pipeline's whole step; the gradients are those of Accelerate's
    accumulated micro-steps (the window's token mean, times ``micro-steps / accumulation
    steps``, as ``accelerator.backward`` scales each loss by ``1 / gradient_accumulation_steps``).
    Every micro-step of the window returns ``.loss`` = the token mean over all the window's
    rows, on every rank.

    Otherwise (``model.eval()`` or ``torch.no_grad()``) it runs the forwards only, in eval mode,
    over every process's rows of this micro-step, and returns on every rank ``.loss`` = their
    token mean without the duplicated rows Accelerate pads the last micro-step with (one
    process's loss on that batch), and ``.logits`` of this process's own rows.

    Args:
        runtime: this rank's pipeline runtime.
        accelerator: the HaptAccelerator whose loaders, step count and sync state it reads.
    """

    def __init__(self, runtime: PipelineRuntime, accelerator: Any) -> None:
        super().__init__()
        self.runtime = runtime
        self.stage = runtime.stage
        self.config = runtime.stage.config
        self._accelerator = weakref.proxy(accelerator)
        self._window: _Window | None = None
        self.last_loss: Tensor | None = None
        """The loss of the last training call, the one ``accelerator.backward`` accepts."""

    def forward(self, input_ids: Tensor | None = None, labels: Tensor | None = None,
                attention_mask: Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        if kwargs:
            raise AccelerateSettingError(f"model(...) got {sorted(kwargs)}; a pipeline model "
                                         f"takes only {list(BATCH_KEYS)}")
        if input_ids is None:
            raise DataError("model(...) needs input_ids (the prepared DataLoader's batches)")
        loader, fed = self._fed(input_ids, labels, attention_mask)
        keep = {"input_ids", *(["labels"] if labels is not None else []),
                *(["attention_mask"] if attention_mask is not None else [])}
        if self.training and torch.is_grad_enabled():
            if labels is None:
                raise DataError("model(**batch) in training needs labels (the loss is computed "
                                "on the pipeline's last stage); add labels to the batch, e.g. "
                                "DataCollatorForLanguageModeling(tokenizer, mlm=False)")
            return self._train(loader, fed, keep)
        return self._evaluate(loader, fed, keep)

    def _fed(self, ids: Tensor, labels: Tensor | None, mask: Tensor | None
             ) -> tuple[PipelineDataLoader, Fed]:
        """The prepared loader whose current batch this is (the same tensors, or equal ones)."""
        fed = [(d, d.current) for d in self._accelerator.batch_sources() if d.current is not None]
        for same in (lambda a, b: a is b, _equal):
            for loader, cur in fed:
                if same(cur.batch["input_ids"], ids) and all(
                        given is None or (k in cur.batch and same(cur.batch[k], given))
                        for k, given in (("labels", labels), ("attention_mask", mask))):
                    return loader, cur
        raise DataError("model(...) got a batch that is not the current batch of a DataLoader "
                        "prepared by this accelerator: the pipeline runs every process's rows "
                        "of a step together and reads them from the prepared DataLoader; pass "
                        "its batches as they come (model(**batch))")

    def _train(self, loader: PipelineDataLoader, fed: Fed, keep: set[str]) -> CausalLMOutputWithPast:
        acc, t = self._accelerator, fed.step
        sync = acc.gradient_state.sync_gradients
        w, key = self._window, (id(loader.cursor), fed.serial)
        if w is not None and w.key == key and t < w.next:
            raise AccelerateSettingError("model(**batch) was called twice for one batch in "
                                         "training; call it once per batch")
        if w is not None and w.key == key and w.next == t <= w.last:
            if sync != (t == w.last):
                raise AccelerateSettingError(
                    f"the accumulation window the pipeline ran (batches {w.first}..{w.last}) "
                    f"does not end where accelerator.sync_gradients says (batch {t}: {sync}); "
                    "step the loop with accelerator.accumulate(model) around each batch")
            w.next += 1
        else:
            w = self._window = self._run_window(loader, t, sync, keep, key)
        self.last_loss = torch.tensor(w.loss, dtype=torch.float32, device=self.runtime.device)
        return CausalLMOutputWithPast(loss=self.last_loss)

    def _run_window(self, loader: PipelineDataLoader, t: int, sync: bool, keep: set[str],
                    key: tuple[int, int]) -> _Window:
        acc = self._accelerator
        steps = acc.gradient_accumulation_steps
        count = 1 if sync else min(1 + steps - acc.step % steps, loader.steps_left(t))
        start = None if count == 1 else acc.window_start()
        rows = loader.rows(t, count)
        batch = {k: v for k, v in rows.batch.items() if k in keep}
        g = self.runtime.plan.global_batch_size
        n = len(batch["input_ids"])
        if n > g:
            raise DataError(f"this DataLoader's accumulation window holds {n} rows but the plan "
                            f"runs {g} per step; train on the DataLoader prepared with the model")
        loss = self._forward_backward(_padded(batch, g), count / steps)
        return _Window(key, t, t + count - 1, t + 1, loss, start, loader.cursor)

    def _forward_backward(self, batch: Batch, scale: float) -> float:
        """The pipeline's step, its gradients times ``scale`` added to those already there."""
        if scale == 1.0:
            return self.runtime.forward_backward(batch)
        params = list(self.stage.parameters())
        old = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.runtime.forward_backward(batch)
        for p, before in zip(params, old):
            if p.grad is not None:
                p.grad.mul_(scale)
            if before is not None:
                p.grad = before if p.grad is None else p.grad.add_(before)
        return loss

    def open_window(self) -> _Window | None:
        """The window the pipeline has run whose optimizer step is still to come, if any."""
        w = self._window
        if w is None or w.start is None:
            return None
        c = w.cursor  # position: batches handed out; the window's last one is still to come
        return w if c.serial == w.key[1] and c.position <= w.last else None

    def _evaluate(self, loader: PipelineDataLoader, fed: Fed, keep: set[str]
                  ) -> CausalLMOutputWithPast:
        rows = loader.rows(fed.step)
        batch = {k: v for k, v in rows.batch.items() if k in keep}
        labels = batch.get("labels")
        if labels is not None:  # the duplicated tail rows do not count, as one process has them
            labels = labels.clone()
            labels[rows.real:] = -100
        g = self.runtime.plan.global_batch_size
        total, tokens, logits = 0.0, 0, []
        for lo in range(0, len(batch["input_ids"]), g):
            part = {k: v[lo:lo + g] for k, v in batch.items()}
            part_labels = None if labels is None else labels[lo:lo + g]
            chunk = _padded({**part, "labels": part["input_ids"] if part_labels is None
                             else part_labels}, g)
            pred = self.runtime.predict(chunk)
            if part_labels is not None:
                counted = int((part_labels[:, 1:] != -100).sum())
                total, tokens = total + pred.loss * counted, tokens + counted
            if pred.logits is not None:
                logits.append(pred.logits[:len(part["input_ids"])])
        loss = None if labels is None else torch.tensor(total / max(tokens, 1), dtype=torch.float32,
                                                        device=self.runtime.device)
        own = self._scatter_rows(logits, loader.batch_size)
        return CausalLMOutputWithPast(loss=loss, logits=own)

    def _scatter_rows(self, logits: list[Tensor], rows: int) -> Tensor:
        """Each process's own rows of the logits rank 0 holds (process p: rows p*rows ..)."""
        rt = self.runtime
        if world_size() == 1:
            return torch.cat(logits)
        parts = list(torch.cat(logits).to(rt.device).split(rows)) if rt.rank == 0 else None
        out = torch.empty((rows, rt.plan.seq_len, self.config.vocab_size), dtype=torch.float32,
                          device=rt.device)
        everyone = range(rt.plan.world_size)
        with rt.channel.collective("the logits scatter", rt.stage_plan.index, everyone):
            dist.scatter(out, [p.contiguous() for p in parts] if parts else None, src=0)
        return out

    def check_backward(self, loss: Any) -> None:
        """``accelerator.backward(loss)``: the pipeline has run the backward already; only the
        loss this engine returned last can stand for it."""
        if self.last_loss is None or loss is not self.last_loss:
            raise AccelerateSettingError(
                "accelerator.backward got a tensor that is not the .loss the pipeline model "
                "returned: under hapt_hf model(**batch) runs the backward of its own loss, so a "
                "changed loss (scaled, summed with other terms) cannot be honoured; pass "
                "outputs.loss unchanged")

    def parameters_ids(self) -> set[int]:
        return {id(p) for p in self.stage.parameters()}


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _padded(batch: Mapping[str, Tensor], rows: int) -> Batch:
    """A batch of exactly ``rows`` rows (:func:`~hapt_hf.integration.trainer_data.fill_rows`:
    a short one is filled with ignored rows, so the loss is the mean over its own tokens)."""
    return fill_rows(Batch(*(batch.get(k) for k in BATCH_KEYS)), rows)


# -- the prepared optimizer --------------------------------------------------------------------

class PipelineOptimizer(torch.optim.Optimizer):
    """The user's optimizer over this rank's stage parameters. As Accelerate's
    ``AcceleratedOptimizer``, ``step()`` and ``zero_grad()`` act only where
    ``accelerator.sync_gradients`` is set (the last micro-step of a window); ``step()`` applies
    the step (with fp16's loss scaling: skipped on every rank if any gradient overflowed, the
    scale updated, as ``PipelineRuntime.train_step`` does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: PipelineRuntime,
                 source: torch.optim.Optimizer) -> None:
        # no super().__init__: the wrapped optimizer holds the state (as AcceleratedOptimizer)
        check_optimizer(runtime.stage_plan, optimizer)  # sharded where the plan says so
        self.optimizer = optimizer
        self.source = source
        """The optimizer the script built (its LR scheduler is built on it)."""
        self.runtime = runtime
        self.gradient_state = GradientState()
        self.step_was_skipped = False
        self.grad_norm: float | None = None
        """The global norm clip_grad_norm_ measured since the last step (None: not clipped)."""

    @classmethod
    def over_stage(cls, optimizer: torch.optim.Optimizer, model: nn.Module,
                   runtime: PipelineRuntime) -> "PipelineOptimizer":
        """The user's optimizer pointed, in place, at this rank's stage parameters (by the full
        ``model``'s names), so that an LR scheduler built on it drives the stage's groups; where
        the stage's plan shards the optimizer state, the step and the state are those of a
        sharded optimizer made from it over the same group dicts (see
        ``PipelineRuntime.prepare_optimizer``)."""
        if optimizer.state:
            raise AccelerateSettingError("the optimizer has taken steps before prepare; prepare "
                                         "it before training (or load its state with load_state)")
        names: dict[int, list[str]] = {}  # a tied weight has several names
        # a PEFT model's parameters by the names of the model inside, as the stage holds them
        for n, p in peft_parts(model)[1].named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        stage = dict(runtime.stage.named_parameters(remove_duplicate=False))
        if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
            raise AccelerateSettingError("the optimizer holds a parameter that is not one of the "
                                         "model's; build it over model.parameters() of the model "
                                         "prepared with it")
        for group in optimizer.param_groups:
            mine = [stage[n] for p in group["params"] for n in names.get(id(p), [])
                    if n in stage]
            group["params"] = list({id(p): p for p in mine}.values())
        return cls(runtime.prepare_optimizer(optimizer), runtime, optimizer)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if closure is not None:
            raise AccelerateSettingError("optimizer.step(closure) cannot be honoured: the "
                                         "pipeline runs the forward and backward in model()")
        if not self.gradient_state.sync_gradients:
            return
        scaler = self.runtime.loss_scaler
        self.step_was_skipped = False
        if scaler is not None:
            norm = self.grad_norm
            if norm is None:  # the overflow decision rides on the global norm's all-reduce
                norm = self.runtime.clip_grad_norm_(math.inf)
            overflow = not math.isfinite(norm)
            scaler.update(overflow)
            if overflow:
                self.optimizer.zero_grad(set_to_none=True)
                self.step_was_skipped = True
        if not self.step_was_skipped:
            self.runtime.step_optimizer(self.optimizer)
        self.grad_norm = None


# -- the model out -----------------------------------------------------------------------------

class PipelineModelView:
    """What ``unwrap_model`` returns: the model's config and a ``save_pretrained`` that writes
    the full Hugging Face checkpoint, each stage its own file (``model_export``)."""

    def __init__(self, engine: PipelineEngine, accelerator_save: Callable | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        self._accelerator_save = accelerator_save

    def save_pretrained(self, save_directory: str | os.PathLike,
                        state_dict: Mapping[str, Tensor] | None = None,
                        is_main_process: bool = True, save_function: Callable | None = None,
                        safe_serialization: bool = True, **kwargs: Any) -> None:
        """With ``state_dict=None`` every stage writes its own weights file and rank 0 the
        index and config (collective: every rank calls it); with
        ``accelerator.get_state_dict(model)`` rank 0 writes what it holds (one file). ``save_function``
        may be ``accelerator.save`` (it writes on the main process, as this does)."""
        if kwargs or not safe_serialization:
            given = sorted(kwargs) or ["safe_serialization=False"]
            raise AccelerateSettingError(f"save_pretrained({given[0]}...) cannot be honoured "
                                         "for a pipeline model: it writes safetensors files "
                                         "with config.json; leave it out")
        if save_function is not None and save_function != self._accelerator_save:
            raise AccelerateSettingError("save_pretrained(save_function=...) takes only "
                                         "accelerator.save with a hapt plan (the stages write "
                                         "the weights, the main process config.json)")
        if state_dict is None:  # each stage writes its own file, no rank gathers the model
            export_model(self.engine.runtime, Path(save_directory))
        elif is_main_process and state_dict:
            save_gathered_model(self.engine.runtime, Path(save_directory), dict(state_dict))


def save_gathered_model(runtime: PipelineRuntime, out: Path, full: dict[str, Tensor]) -> None:
    """Write config.json + model.safetensors of ``full`` into ``out`` (rank 0): into a
    temporary directory first, then each file moved into place, so no file is ever half
    written."""
    tmp = ckpt_io.begin_model_save(out)
    ckpt_io.save_hf_model(runtime, full, tmp)
    ckpt_io.finish_model_save(tmp, out)
