"""What :meth:`HaptAccelerator.prepare` hands back: objects whose calls mean what an Accelerate
loop expects, on a pipeline.

As Accelerate's Megatron-LM engine does, ``model(**batch)`` in training runs the WHOLE step's
forwards and backwards over the global batch (every micro-batch of the plan) and returns the
global-batch loss on every rank; ``accelerator.backward(loss)`` then only checks it got that
loss. The optimizer step is deferred to ``optimizer.step()`` so that
``accelerator.clip_grad_norm_`` can clip by the global norm (every stage, every replica) in
between, exactly where a single-process loop clips.

Every rank iterates the same DataLoader in the same order (rank 0's RNG state is broadcast at
the start of each epoch, as Accelerate's ``rng_types=["torch"]`` does) and groups its batches
into global batches: token ids are small, and the runtime hands each stage the rows it needs.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hapt_hf.errors import ConfigError, DataError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime
from hapt_hf.pipeline.zero import check_optimizer

__all__ = ["AccelerateSettingError", "PipelineEngine", "PipelineOptimizer", "PipelineScheduler",
           "GlobalBatchLoader", "PipelineModelView", "save_gathered_model"]

_BATCH_KEYS = ("input_ids", "labels", "attention_mask")


class AccelerateSettingError(ConfigError):
    """An Accelerate setting or call that a pipeline run cannot honour; names it and the fix."""


class PipelineEngine(nn.Module):
    """The prepared model: ``model(**batch)`` runs the plan's whole step on every rank.

    In train mode with gradients enabled it runs every forward and backward of the global
    batch (gradients land in this rank's stage) and returns ``.loss``, the token mean of the
    global batch, on every rank. Otherwise (``model.eval()`` or ``torch.no_grad()``) it runs the
    forwards only, in eval mode, and returns the loss (None without labels) and the logits of
    every row on rank 0 (None on the other ranks).
    """

    def __init__(self, runtime: PipelineRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.stage = runtime.stage
        self.config = runtime.stage.config
        self.last_loss: Tensor | None = None
        """The loss of the last training call, the one ``accelerator.backward`` accepts."""
        self.backward_done = True

    def forward(self, input_ids: Tensor | None = None, labels: Tensor | None = None,
                attention_mask: Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        if kwargs:
            raise AccelerateSettingError(f"model(...) got {sorted(kwargs)}; a pipeline model "
                                         f"takes only {list(_BATCH_KEYS)}")
        if input_ids is None:
            raise DataError("model(...) needs input_ids (the prepared DataLoader's batches)")
        g = self.runtime.plan.global_batch_size
        rows = int(input_ids.shape[0])
        if rows > g or input_ids.shape[-1] != self.runtime.plan.seq_len:
            raise DataError(f"model(...) got input_ids of shape {tuple(input_ids.shape)} but the "
                            f"plan runs global batches of [{g}, {self.runtime.plan.seq_len}]; "
                            "pass the batches of the DataLoader prepared with the model")
        if self.training and torch.is_grad_enabled():
            return self._train(_padded(input_ids, labels, attention_mask, g))
        batch = _padded(input_ids, input_ids if labels is None else labels, attention_mask, g)
        pred = self.runtime.predict(batch)
        logits = None if pred.logits is None else pred.logits[:rows]
        loss = None if labels is None else torch.tensor(pred.loss, dtype=torch.float32)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _train(self, batch: Batch) -> CausalLMOutputWithPast:
        if batch.labels is None:
            raise DataError("model(**batch) in training needs labels (the loss is computed on "
                            "the pipeline's last stage); add labels to the batch, e.g. "
                            "DataCollatorForLanguageModeling(tokenizer, mlm=False)")
        loss = self.runtime.forward_backward(batch)
        self.last_loss = torch.tensor(loss, dtype=torch.float32)
        self.backward_done = False
        return CausalLMOutputWithPast(loss=self.last_loss)

    def check_backward(self, loss: Any) -> None:
        """``accelerator.backward(loss)``: the pipeline has run the backward already; only the
        loss this engine returned can stand for it."""
        if self.last_loss is None or loss is not self.last_loss:
            raise AccelerateSettingError(
                "accelerator.backward got a tensor that is not the .loss the pipeline model "
                "returned: under hapt_hf model(**batch) runs the backward of its own loss, so a "
                "changed loss (scaled, summed with other terms) cannot be honoured; pass "
                "outputs.loss unchanged")
        self.backward_done = True

    def parameters_ids(self) -> set[int]:
        return {id(p) for p in self.stage.parameters()}


def _padded(ids: Tensor, labels: Tensor | None, mask: Tensor | None, rows: int) -> Batch:
    """A batch of exactly ``rows`` rows: a short last batch is filled with copies of its first
    row whose labels are ignored, so the loss is the mean over its own tokens."""
    short = rows - ids.shape[0]
    if short == 0:
        return Batch(ids, labels, mask)
    fill = ids[:1].expand(short, -1)
    return Batch(torch.cat([ids, fill]),
                 None if labels is None else torch.cat([labels, torch.full_like(fill, -100)]),
                 None if mask is None else torch.cat([mask, mask[:1].expand(short, -1)]))


class PipelineOptimizer(torch.optim.Optimizer):
    """The user's optimizer over this rank's stage parameters; ``step()`` applies the step the
    engine prepared (with fp16's loss scaling: skipped on every rank if any gradient
    overflowed, the scale updated, as ``PipelineRuntime.train_step`` does)."""

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: PipelineRuntime) -> None:
        # no super().__init__: the wrapped optimizer holds the state (as AcceleratedOptimizer)
        check_optimizer(runtime.stage_plan, optimizer)  # sharded where the plan says so
        self.optimizer = optimizer
        self.runtime = runtime
        self.step_was_skipped = False
        self.grad_norm: float | None = None
        """The global norm clip_grad_norm_ measured since the last step (None: not clipped)."""

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
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if closure is not None:
            raise AccelerateSettingError("optimizer.step(closure) cannot be honoured: the "
                                         "pipeline runs the forward and backward in model()")
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


class PipelineScheduler:
    """The user's LR scheduler: one step per optimizer step, none for a skipped one (as
    Accelerate's ``AcceleratedScheduler``)."""

    def __init__(self, scheduler: Any, optimizers: list[PipelineOptimizer]) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers

    def step(self, *args: Any, **kwargs: Any) -> None:
        if any(o.step_was_skipped for o in self.optimizers):
            return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, ... as the scheduler's
        return getattr(self.__dict__["scheduler"], name)


@dataclass
class _Cursor:
    """Where a loader stands; shared by a loader and its ``skip_first_batches`` views, saved in
    ``save_state``. Mutable: it advances with every batch."""

    epoch: int = -1
    position: int = 0
    """Global batches handed out in the current epoch."""
    epoch_rng: Tensor | None = None
    """The torch RNG state the current epoch's order was drawn under (the same on every rank)."""
    resume: bool = False
    """A loaded state: the next iteration continues the saved epoch instead of starting one."""


class GlobalBatchLoader:
    """The user's DataLoader, yielding one global batch per step: ``group`` consecutive batches
    joined (a short last one is padded by the engine)."""

    def __init__(self, loader: Any, global_batch: int, cursor: _Cursor | None = None,
                 start: int | None = None) -> None:
        bs = loader.batch_size
        if bs is None or global_batch % bs:
            raise AccelerateSettingError(
                f"a DataLoader with batch_size={bs} cannot make the plan's global batches of "
                f"{global_batch} rows; give it a batch_size that divides {global_batch}")
        self.loader = loader
        self.batch_size = global_batch
        self.group = global_batch // bs
        self.cursor = cursor or _Cursor()
        self._start = start

    def __len__(self) -> int:
        return math.ceil(len(self.loader) / self.group)

    @property
    def dataset(self):
        return self.loader.dataset

    def skipping(self, num_batches: int) -> "GlobalBatchLoader":
        """A view that starts at global batch ``num_batches`` of its epoch."""
        return GlobalBatchLoader(self.loader, self.batch_size, self.cursor, num_batches)

    def state_dict(self) -> dict[str, Any]:
        c = self.cursor
        return {"epoch": c.epoch, "position": c.position, "epoch_rng": c.epoch_rng,
                "finished": c.position >= len(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor.epoch, self.cursor.position = state["epoch"], state["position"]
        self.cursor.epoch_rng = state["epoch_rng"]
        self.cursor.resume = not state["finished"] and state["epoch_rng"] is not None

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        c = self.cursor
        if c.resume:  # draw the saved epoch's order, then go on from the RNG as loaded
            now = torch.get_rng_state()
            torch.set_rng_state(c.epoch_rng)
            start = c.position if self._start is None else self._start
        else:
            c.epoch, c.epoch_rng = c.epoch + 1, _rank0_rng_state()
            now, start = None, self._start or 0
            torch.set_rng_state(c.epoch_rng)
        c.resume, c.position = False, 0
        inner = iter(self.loader)
        first = next(inner, None)  # the sampler draws its order here
        if now is not None:
            torch.set_rng_state(now)
        batches = _chain_first(first, inner)
        for k, batch in enumerate(_grouped(batches, self.group)):
            c.position = k + 1
            if k >= start:
                yield batch


def _rank0_rng_state() -> Tensor:
    """Rank 0's CPU RNG state, on every rank (so every rank draws the same data order)."""
    state = torch.get_rng_state()
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    if first is None:
        return
    yield first
    yield from rest


def _grouped(batches: Iterator[Any], group: int) -> Iterator[dict[str, Tensor]]:
    buf: list[Mapping[str, Tensor]] = []
    for b in batches:
        if not isinstance(b, Mapping):
            raise DataError(f"the DataLoader yields {type(b).__name__}; a pipeline run needs "
                            f"mappings with {list(_BATCH_KEYS)} (a tokenizer's collator gives "
                            "them)")
        buf.append(b)
        if len(buf) == group:
            yield _join(buf)
            buf = []
    if buf:
        yield _join(buf)


def _join(batches: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    unknown = sorted(set(batches[0]) - set(_BATCH_KEYS))
    if unknown:
        raise DataError(f"the DataLoader's batches carry {unknown}; a pipeline model takes only "
                        f"{list(_BATCH_KEYS)}: drop the other columns")
    return {k: torch.cat([torch.as_tensor(b[k]) for b in batches]) for k in batches[0]}


class PipelineModelView:
    """What ``unwrap_model`` returns: the model's config and a ``save_pretrained`` that writes
    the full Hugging Face checkpoint gathered from every stage."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.config = engine.config

    def save_pretrained(self, save_directory: str | os.PathLike,
                        state_dict: Mapping[str, Tensor] | None = None,
                        is_main_process: bool = True, safe_serialization: bool = True,
                        **kwargs: Any) -> None:
        """With ``state_dict=None`` it gathers (collective: every rank calls it); with
        ``accelerator.get_state_dict(model)`` rank 0 writes what it holds."""
        if kwargs or not safe_serialization:
            given = sorted(kwargs) or ["safe_serialization=False"]
            raise AccelerateSettingError(f"save_pretrained({given[0]}...) cannot be honoured "
                                         "for a pipeline model: it writes one model.safetensors"
                                         " with config.json; leave it out")
        if state_dict is None:
            state_dict = self.engine.runtime.gather_state_dict(dst=0)
        if is_main_process and state_dict:
            save_gathered_model(self.engine.runtime, Path(save_directory), dict(state_dict))


def save_gathered_model(runtime: PipelineRuntime, out: Path, full: dict[str, Tensor]) -> None:
    """Write config.json + model.safetensors of ``full`` into ``out`` (rank 0): into a
    temporary directory first, then each file moved into place, so no file is ever half
    written."""
    tmp = ckpt_io.begin_model_save(out)
    ckpt_io.save_hf_model(runtime, full, tmp)
    ckpt_io.finish_model_save(tmp, out)


@contextlib.contextmanager
def unchanged() -> Iterator[None]:
    """A context that changes nothing (accumulate / no_sync: each step is already whole)."""
    yield
