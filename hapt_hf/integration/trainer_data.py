"""HaptTrainer's data: the batches ``Trainer`` would draw on ONE process, grouped into steps.

``Trainer`` on N data-parallel processes draws, for each optimizer step, the next
``per_device_train_batch_size x N x gradient_accumulation_steps`` rows of its sampler's order
(accelerate shards each group of N per-device batches among the processes); one process with an
N times larger per-device batch draws the very same rows. A pipeline needs every row of a step on
every rank, so HaptTrainer builds the one-process loader (Trainer's own sampler, collator and
column removal, prepared by accelerate as for one process: the seedable sampler, ``data_seed``)
and hands the runtime ``gradient_accumulation_steps`` of its batches at a time. A short last step
of an epoch (fewer batches, or a short batch) is filled up to the plan's global batch with rows
whose labels are all ignored: the loss and gradients are those of the real rows.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hapt_hf.compat import trainer_api
from hapt_hf.errors import DataError, TrainingArgsError
from hapt_hf.pipeline.runtime import Batch

__all__ = ["RowsDataset", "as_dataset", "check_first_row", "check_first_rows", "one_process_loader",
           "trainer_loader", "steps",
           "steps_per_epoch_of", "step_counts", "epoch_steps", "to_batch", "fill_rows", "slice_rows"]

class RowsDataset(Dataset):
    """Packed token rows ``[samples, seq]`` given as a tensor, as a map-style dataset whose
    items are ``{'input_ids': row, 'labels': row}`` (a causal LM's own targets)."""

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def as_dataset(data: Any) -> Any:
    """Packed token rows given as a tensor become a :class:`RowsDataset`; anything else is
    taken as Trainer takes it."""
    if isinstance(data, torch.Tensor):
        if data.ndim != 2 or data.is_floating_point():
            raise DataError(f"a dataset given as a tensor must hold integer token rows "
                            f"[samples, seq_len]; got {data.dtype} {tuple(data.shape)}")
        return RowsDataset(data.long())
    return data


def check_first_row(dataset: Any, seq_len: int, field: str) -> None:
    """Refuse, before anything runs or is written, a map-style dataset whose first row is
    longer than the plan's ``seq_len`` (rows are read without drawing random numbers)."""
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return
    try:
        first = len(dataset[0]["input_ids"]) if len(dataset) else 0
    except (TypeError, KeyError, IndexError):
        return  # the collator makes input_ids: checked at the first step
    if first > seq_len:
        raise DataError(f"{field} rows hold {first} tokens but the plan was made for seq_len "
                        f"{seq_len}; group the texts into rows of {seq_len} tokens (run_clm's "
                        f"--block_size {seq_len}) or set seq_len: {first} in the hapt config")


def check_first_rows(seq_len: int, **datasets: Any) -> None:
    """:func:`check_first_row` on each dataset given by name (a dict of eval datasets too)."""
    for field, data in datasets.items():
        for name, part in (data.items() if isinstance(data, dict) else [(field, data)]):
            check_first_row(part, seq_len, name)


def trainer_loader(trainer: Any, dataset: Any, batch_size: int, training: bool) -> DataLoader:
    """The loader ``trainer`` (a Trainer) prepares on ONE process for ``dataset``: its train
    sampler (or sequential order for evaluation), its collator, the columns its model does not
    take removed, ``batch_size`` rows a batch. Every rank draws the same batches."""
    import datasets

    args, collator = trainer.args, trainer.data_collator
    what = "Training" if training else "Evaluation"
    if isinstance(dataset, datasets.Dataset):  # as Trainer: an iterable one keeps its columns
        dataset = trainer_api.remove_unused_columns(trainer, dataset, what)
    else:
        collator = trainer_api.collator_with_removed_columns(trainer, collator, what)
    sampler = None
    if not isinstance(dataset, IterableDataset):
        sampler = (trainer_api.train_sampler(trainer, dataset) if training
                   else torch.utils.data.SequentialSampler(dataset))
    seedable = args.accelerator_config.use_seedable_sampler and training
    return one_process_loader(dataset, batch_size, collator, sampler, args.dataloader_drop_last,
                              seedable, args.data_seed)


def one_process_loader(dataset: Any, batch_size: int, collator: Any, sampler: Any,
                       drop_last: bool, use_seedable_sampler: bool,
                       data_seed: int | None) -> DataLoader:
    """The DataLoader ``Trainer`` prepares on one process with ``batch_size`` rows a batch."""
    from accelerate.data_loader import prepare_data_loader

    kwargs: dict[str, Any] = {"batch_size": batch_size, "collate_fn": collator}
    if not isinstance(dataset, IterableDataset):
        kwargs.update(sampler=sampler, drop_last=drop_last)
    loader = DataLoader(dataset, **kwargs)
    return prepare_data_loader(loader, device=None, num_processes=1, process_index=0,
                               split_batches=False, put_on_device=False, rng_types=None,
                               dispatch_batches=False, even_batches=True,
                               use_seedable_sampler=use_seedable_sampler, data_seed=data_seed)


def steps(batches: Iterator[Any], accumulation: int) -> Iterator[list[Mapping[str, Any]]]:
    """Group the loader's batches into optimizer steps of ``accumulation`` batches (the last
    step of an epoch may hold fewer), as Trainer's loop does."""
    step: list[Mapping[str, Any]] = []
    for b in batches:
        step.append(b)
        if len(step) == accumulation:
            yield step
            step = []
    if step:
        yield step


def steps_per_epoch_of(loader: Any, accumulation: int) -> int | None:
    """Optimizer steps in one pass (Trainer's count: a short last step counts); None for a
    loader without a length (an iterable dataset)."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    return batches // accumulation + int(batches % accumulation > 0)


def step_counts(loader: Any, args: Any) -> tuple[int | None, int, int]:
    """(optimizer steps per epoch, steps to run, epochs to start) as Trainer counts them:
    ``max_steps`` wins, else a (possibly fractional) number of epochs; an iterable dataset
    (no length: None steps per epoch) needs ``max_steps``."""
    per_epoch = steps_per_epoch_of(loader, args.gradient_accumulation_steps)
    if per_epoch is None and args.max_steps <= 0:
        raise TrainingArgsError("the train_dataset has no length (an iterable dataset): set "
                                "max_steps, as Trainer requires")
    if per_epoch == 0:
        raise DataError("the train_dataset gives no batch of per_device_train_batch_size x "
                        "processes rows (dataloader_drop_last with fewer rows?); give more data")
    max_steps = args.max_steps if args.max_steps > 0 \
        else max(1, math.ceil(args.num_train_epochs * per_epoch))
    return per_epoch, max_steps, math.ceil(max_steps / per_epoch) if per_epoch else sys.maxsize


def epoch_steps(loader: Any, epoch: int, accumulation: int) -> Iterator[list[Mapping[str, Any]]]:
    """The optimizer steps of pass ``epoch``, as Trainer's loop draws them: the epoch set on
    the loader and on a batch sampler it wraps first (the seedable sampler's order)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)
    return steps(iter(loader), accumulation)


def to_batch(parts: list[Mapping[str, Any]], rows: int | None, seq_len: int, where: str) -> Batch:
    """One global batch of exactly ``rows`` rows of ``seq_len`` tokens from collated batches:
    labels default to the input ids (a causal LM's targets); a shorter collated length (a
    padding collator) is padded on the right with ignored labels, which a causal model's
    earlier positions never see; a short step is filled with ignored rows (``rows`` None:
    as many rows as the parts hold, none added)."""
    for p in parts:
        if not isinstance(p, Mapping) or "input_ids" not in p:
            raise DataError(f"{where}: the data collator gives {type(p).__name__} batches; a "
                            "pipeline step needs mappings with 'input_ids' (and 'labels', "
                            "'attention_mask')")
    ids = torch.cat([torch.as_tensor(p["input_ids"]) for p in parts]).long()
    labels = torch.cat([torch.as_tensor(p["labels"] if "labels" in p else p["input_ids"])
                        for p in parts]).long()
    mask = (torch.cat([torch.as_tensor(p["attention_mask"]) for p in parts]).long()
            if all("attention_mask" in p for p in parts) else None)
    if ids.ndim != 2 or ids.shape[0] > (rows or ids.shape[0]) or ids.shape[1] > seq_len:
        raise DataError(f"{where}: a step's batches hold token rows {tuple(ids.shape)} but the "
                        f"plan runs global batches of at most [{rows or 'any'}, {seq_len}]; group the "
                        f"texts into rows of {seq_len} tokens (run_clm's block_size) or re-plan "
                        f"for seq_len {ids.shape[-1]}")
    short = seq_len - ids.shape[1]
    if short:
        pad = torch.nn.functional.pad
        mask = pad(torch.ones_like(ids) if mask is None else mask, (0, short), value=0)
        ids, labels = pad(ids, (0, short), value=0), pad(labels, (0, short), value=-100)
    batch = Batch(ids, labels, mask)
    return batch if rows is None else fill_rows(batch, rows)


def slice_rows(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows ``lo:hi`` of ``batch``."""
    return Batch(batch.input_ids[lo:hi], None if batch.labels is None else batch.labels[lo:hi],
                 None if batch.attention_mask is None else batch.attention_mask[lo:hi])


def fill_rows(batch: Batch, rows: int) -> Batch:
    """``batch`` filled up to ``rows`` rows with copies of its first row whose labels are all
    ignored (-100), so the loss and the gradients are the real rows' own."""
    short = rows - batch.input_ids.shape[0]
    if short == 0:
        return batch
    fill = batch.input_ids[:1].expand(short, -1)
    labels = batch.labels if batch.labels is not None else batch.input_ids
    mask = batch.attention_mask
    return Batch(torch.cat([batch.input_ids, fill]),
                 torch.cat([labels, torch.full_like(fill, -100)]),
                 None if mask is None else torch.cat([mask, mask[:1].expand(short, -1)]))
