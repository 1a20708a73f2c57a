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

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hapt_hf.errors import DataError
from hapt_hf.pipeline.runtime import Batch

__all__ = ["RowsDataset", "one_process_loader", "steps", "to_batch", "fill_rows", "slice_rows"]

BATCH_KEYS = ("input_ids", "labels", "attention_mask")


class RowsDataset(Dataset):
    """Packed token rows ``[samples, seq]`` given as a tensor, as a map-style dataset whose
    items are ``{'input_ids': row, 'labels': row}`` (a causal LM's own targets)."""

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


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
