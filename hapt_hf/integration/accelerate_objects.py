"""What :meth:`HaptAccelerator.prepare` hands back: objects whose calls mean what they mean
under Accelerate, on a pipeline that runs every process's rows of an optimizer step together.

The loop keeps Accelerate's shape: the prepared DataLoader yields each process its own batches,
as many as Accelerate's prepared loader yields (:class:`PipelineDataLoader`), ``accumulate``
decides the sync points, the optimizer steps and zeroes only on them, the scheduler is
Accelerate's own ``AcceleratedScheduler``. What changes is where the work happens: at the first
micro-step of an accumulation window, ``model(**batch)`` (:class:`PipelineEngine`) runs the
pipeline over the window's rows of EVERY process (read from the loader, which every rank draws
alike), so the window's gradients are in place before ``optimizer.step()``; the window's later
micro-steps only hand back its loss. ``accelerator.clip_grad_norm_`` then clips by the global
norm exactly where a one-process loop clips.

Length: over 400 lines because the objects ``prepare`` returns work as one protocol: the engine
finds its batch among the loaders' current ones, reads every process's rows of a window from
the loader that yielded it and the window's bounds from its position, and the optimizer acts on
the sync steps that window ends on; apart, each would expose its internals to the others.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hapt_hf.errors import ConfigError, DataError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime
from hapt_hf.pipeline.zero import check_optimizer

__all__ = ["AccelerateSettingError", "PipelineEngine", "PipelineOptimizer", "PipelineDataLoader",
           "PipelineModelView", "WindowStart", "save_gathered_model"]

_BATCH_KEYS = ("input_ids", "labels", "attention_mask")


class AccelerateSettingError(ConfigError):
    """An Accelerate setting or call that a pipeline run cannot honour; names it and the fix."""


# -- the prepared DataLoader ------------------------------------------------------------------

@dataclass
class _Cursor:
    """Where a loader stands; shared by a loader and its ``skip_first_batches`` views, saved in
    ``save_state``. Mutable: it advances with every batch."""

    epoch: int = -1
    position: int = 0
    """Per-process batches handed out in the current epoch."""
    epoch_rng: Tensor | None = None
    """The torch RNG state the current epoch's order was drawn under (the same on every rank)."""
    resume: bool = False
    """A loaded state: the next iteration continues the saved epoch instead of starting one."""
    serial: int = 0
    """Iterations started; an accumulation window belongs to one."""


@dataclass(frozen=True)
class _Fed:
    """The batch a loader handed out last, by which the engine recognises it."""

    step: int
    serial: int
    batch: Mapping[str, Tensor]


@dataclass(frozen=True)
class Rows:
    """Every process's rows of some consecutive micro-steps, as one batch."""

    batch: dict[str, Tensor]
    real: int
    """Rows that are not the duplicates Accelerate pads the last micro-step with (they come
    last, as in ``gather_for_metrics``)."""


class _Replay:
    """One epoch's index batches replayed, for Accelerate's ``BatchSamplerShard`` to shard."""

    def __init__(self, batches: list[list[int]], batch_size: int, drop_last: bool) -> None:
        self.batches, self.batch_size, self.drop_last = batches, batch_size, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return (list(b) for b in self.batches)  # fresh lists: the shard pads its last in place

    def __len__(self) -> int:
        return len(self.batches)


class _Positions(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class PipelineDataLoader(DataLoaderStateMixin):
    """The prepared DataLoader: yields this process's batches as Accelerate's prepared loader
    does on process ``process_index`` of ``num_processes`` (the sharding, count and duplicated
    tail of Accelerate's own ``BatchSamplerShard``, ``even_batches=True``), keeps
    ``GradientState`` informed (``end_of_dataloader``, ``remainder``) as Accelerate's loaders do,
    and gives the engine every process's rows of any micro-step of the current epoch (:meth:`rows`).

    Every rank draws the epoch's order as one process iterating the DataLoader would (rank 0's
    RNG state is broadcast as each epoch starts), so all ranks hold the same shards.

    Args:
        loader: the script's DataLoader over a map-style dataset, with a ``batch_size``.
        num_processes, process_index: Accelerate's (the pipeline's ranks).
        split_batches: Accelerate's setting: ``batch_size`` is the rows of one micro-step over
            all processes, each taking ``batch_size / num_processes``.
        device: where this process's batches are put (Accelerate's device placement).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, num_processes: int, process_index: int,
                 split_batches: bool = False, device: Any = None, cursor: _Cursor | None = None,
                 start: int | None = None) -> None:
        bs = loader.batch_size
        if isinstance(loader.dataset, torch.utils.data.IterableDataset) or bs is None:
            raise AccelerateSettingError("with a hapt plan prepare takes DataLoaders over a "
                                         "map-style dataset with a batch_size (every rank draws "
                                         "the same index batches and shards them as Accelerate)")
        if split_batches and bs % num_processes:
            raise AccelerateSettingError(f"split_batches: the DataLoader's batch_size {bs} must be"
                                         f" a multiple of the number of processes {num_processes}")
        self.loader = loader
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.device = split_batches, device
        self.gradient_state = GradientState()
        self._drop_last = loader.drop_last
        self.cursor = cursor or _Cursor()
        self._start = start
        self.current: _Fed | None = None
        self._plan: list[list[list[int]]] = []  # [micro-step][process] -> dataset indices
        self._cache: dict[int, list[Any]] = {}

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """Rows of one process's batch."""
        bs = self.loader.batch_size
        return bs // self.num_processes if self.split_batches else bs

    @property
    def total_batch_size(self) -> int:
        """Rows of one micro-step over every process (Accelerate's ``total_batch_size``)."""
        return self.batch_size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def __len__(self) -> int:
        shard = BatchSamplerShard(self.loader.batch_sampler, self.num_processes, self.process_index,
                                  self.split_batches, even_batches=True)
        return max(0, len(shard) - (self._start or 0))

    def set_epoch(self, epoch: int) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def skipping(self, num_batches: int) -> "PipelineDataLoader":
        """A view that starts at this process's batch ``num_batches`` of its epoch."""
        return PipelineDataLoader(self.loader, self.num_processes, self.process_index,
                                  self.split_batches, self.device, self.cursor, num_batches)

    def state_dict(self) -> dict[str, Any]:
        c = self.cursor
        return {"epoch": c.epoch, "position": c.position, "epoch_rng": c.epoch_rng,
                "finished": c.position >= len(self) + (self._start or 0)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor.epoch, self.cursor.position = state["epoch"], state["position"]
        self.cursor.epoch_rng = state["epoch_rng"]
        self.cursor.resume = not state["finished"] and state["epoch_rng"] is not None

    def __iter__(self) -> Iterator[Mapping[str, Tensor]]:
        c = self.cursor
        if c.resume:  # draw the saved epoch's order again, then go on from the RNG as loaded
            now = torch.get_rng_state()
            torch.set_rng_state(c.epoch_rng)
            start = c.position if self._start is None else self._start
        else:
            c.epoch, c.epoch_rng = c.epoch + 1, _rank0_rng_state()
            now, start = None, self._start or 0
            torch.set_rng_state(c.epoch_rng)
        c.resume = False
        batches = _draw_batches(self.loader)
        if now is not None:
            torch.set_rng_state(now)
        replay = _Replay(batches, self.loader.batch_size, self.loader.drop_last)
        shards = [list(BatchSamplerShard(replay, self.num_processes, p, self.split_batches,
                                         even_batches=True)) for p in range(self.num_processes)]
        self._plan, self._cache = [list(step) for step in zip(*shards)], {}
        c.serial += 1
        c.position = start
        self.begin()
        try:
            for t in range(start, len(self._plan)):
                self.end_of_dataloader = t == len(self._plan) - 1
                batch = self._steps(t)[self.process_index]
                if self.device is not None:
                    batch = send_to_device(batch, self.device)
                self.current, c.position = _Fed(t, c.serial, batch), t + 1
                yield batch
        finally:  # also when the loop leaves early (the batch handed out stays current)
            self.end()

    def steps_left(self, step: int) -> int:
        """Micro-steps of the current iteration from ``step`` on, ``step`` included."""
        return len(self._plan) - step

    def rows(self, step: int, count: int = 1) -> Rows:
        """Every process's rows of micro-steps ``step .. step+count-1``, micro-step by
        micro-step, process by process within each (the order one process with a batch of
        ``total_batch_size`` rows would see them in)."""
        for old in [k for k in self._cache if k < step]:
            del self._cache[old]
        parts = [b for t in range(step, step + count) for b in self._steps(t)]
        batch = _join(parts)
        n = len(batch["input_ids"])
        dup = 0
        if step + count == len(self._plan) and self.remainder > 0:
            dup = self.total_batch_size - self.remainder
        return Rows(batch, n - dup)

    def _steps(self, t: int) -> list[Any]:
        if t not in self._cache:
            self._cache[t] = [self._fetch(idx) for idx in self._plan[t]]
        return self._cache[t]

    def _fetch(self, indices: list[int]) -> Any:
        """One batch as the DataLoader's own fetcher makes it (``__getitems__`` where the
        dataset has it, then the collate function)."""
        ds = self.loader.dataset
        getitems = getattr(ds, "__getitems__", None)
        items = getitems(indices) if getitems else [ds[i] for i in indices]
        return self.loader.collate_fn(items)


def _draw_batches(loader: torch.utils.data.DataLoader) -> list[list[int]]:
    """The epoch's index batches, drawn with the RNG use of iterating ``loader`` (its iterator's
    base seed, then the sampler's draws), so the order is the one a one-process run gets."""
    shadow = torch.utils.data.DataLoader(_Positions(len(loader.dataset)),
                                         batch_sampler=loader.batch_sampler, collate_fn=list,
                                         generator=loader.generator)
    return [list(b) for b in shadow]


def _rank0_rng_state() -> Tensor:
    """Rank 0's CPU RNG state, on every rank (so every rank draws the same data order)."""
    state = torch.get_rng_state()
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def _join(batches: list[Any]) -> dict[str, Tensor]:
    for b in batches:
        if not isinstance(b, Mapping):
            raise DataError(f"the DataLoader yields {type(b).__name__}; a pipeline run needs "
                            f"mappings with {list(_BATCH_KEYS)} (a tokenizer's collator gives "
                            "them)")
    unknown = sorted(set(batches[0]) - set(_BATCH_KEYS))
    if unknown:
        raise DataError(f"the DataLoader's batches carry {unknown}; a pipeline model takes only "
                        f"{list(_BATCH_KEYS)}: drop the other columns")
    return {k: torch.cat([torch.as_tensor(b[k]).cpu() for b in batches]) for k in batches[0]}


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
    cursor: _Cursor


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
                                         f"takes only {list(_BATCH_KEYS)}")
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
             ) -> tuple[PipelineDataLoader, _Fed]:
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

    def _train(self, loader: PipelineDataLoader, fed: _Fed, keep: set[str]) -> CausalLMOutputWithPast:
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

    def _evaluate(self, loader: PipelineDataLoader, fed: _Fed, keep: set[str]
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
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
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
    """A batch of exactly ``rows`` rows: a short one is filled with copies of its first row
    whose labels are ignored, so the loss is the mean over its own tokens."""
    ids, labels, mask = (batch.get(k) for k in _BATCH_KEYS)
    short = rows - ids.shape[0]
    if short == 0:
        return Batch(ids, labels, mask)
    fill = ids[:1].expand(short, -1)
    return Batch(torch.cat([ids, fill]),
                 None if labels is None else torch.cat([labels, torch.full_like(fill, -100)]),
                 None if mask is None else torch.cat([mask, mask[:1].expand(short, -1)]))


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
    the full Hugging Face checkpoint gathered from every stage."""

    def __init__(self, engine: PipelineEngine, accelerator_save: Callable | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        self._accelerator_save = accelerator_save

    def save_pretrained(self, save_directory: str | os.PathLike,
                        state_dict: Mapping[str, Tensor] | None = None,
                        is_main_process: bool = True, save_function: Callable | None = None,
                        safe_serialization: bool = True, **kwargs: Any) -> None:
        """With ``state_dict=None`` it gathers (collective: every rank calls it); with
        ``accelerator.get_state_dict(model)`` rank 0 writes what it holds. ``save_function``
        may be ``accelerator.save`` (it writes on the main process, as this does)."""
        if kwargs or not safe_serialization:
            given = sorted(kwargs) or ["safe_serialization=False"]
            raise AccelerateSettingError(f"save_pretrained({given[0]}...) cannot be honoured "
                                         "for a pipeline model: it writes one model.safetensors"
                                         " with config.json; leave it out")
        if save_function is not None and save_function != self._accelerator_save:
            raise AccelerateSettingError("save_pretrained(save_function=...) takes only "
                                         "accelerator.save with a hapt plan (the main process "
                                         "writes model.safetensors and config.json)")
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
