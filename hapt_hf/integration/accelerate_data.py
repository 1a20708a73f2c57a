"""The DataLoader :meth:`HaptAccelerator.prepare` hands back (:class:`PipelineDataLoader`):
each process's own batches as Accelerate's prepared loader yields them, and every process's rows
of any micro-step of the epoch for the pipeline, which runs them together.

Every rank draws the epoch's order as one process iterating the script's DataLoader would
(rank 0's RNG state is broadcast as each epoch starts) and shards it as Accelerate's
``BatchSamplerShard`` does, so every rank holds every process's shard. Also here, at the bottom
of the Accelerate integration: :class:`AccelerateSettingError`, which all of it raises, and
:data:`BATCH_KEYS`, what a pipeline model's batch may hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch import Tensor

from hapt_hf.errors import ConfigError, DataError

__all__ = ["AccelerateSettingError", "BATCH_KEYS", "Cursor", "Fed", "Rows", "PipelineDataLoader"]

BATCH_KEYS = ("input_ids", "labels", "attention_mask")
"""What a pipeline model's batch may hold (the keyword arguments ``model(**batch)`` takes)."""


class AccelerateSettingError(ConfigError):
    """An Accelerate setting or call that a pipeline run cannot honour; names it and the fix."""


@dataclass
class Cursor:
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
class Fed:
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
                 split_batches: bool = False, device: Any = None, cursor: Cursor | None = None,
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
        self.cursor = cursor or Cursor()
        self._start = start
        self.current: Fed | None = None
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
                self.current, c.position = Fed(t, c.serial, batch), t + 1
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
                            f"mappings with {list(BATCH_KEYS)} (a tokenizer's collator gives "
                            "them)")
    unknown = sorted(set(batches[0]) - set(BATCH_KEYS))
    if unknown:
        raise DataError(f"the DataLoader's batches carry {unknown}; a pipeline model takes only "
                        f"{list(BATCH_KEYS)}: drop the other columns")
    return {k: torch.cat([torch.as_tensor(b[k]).cpu() for b in batches]) for k in batches[0]}
