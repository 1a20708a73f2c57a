"""Text data for causal-LM fine-tuning: load with `datasets`, tokenise, pack to fixed length.

Every rank loads the same data: :func:`load_text_dataset` gives packed token rows
``[samples, seq_len]``, and :func:`rows_dataset` turns them into the ``datasets.Dataset`` of
``input_ids`` / ``attention_mask`` / ``labels`` rows of equal length that run_clm.py's
``group_texts`` makes and ``HaptTrainer`` takes. A file ``datasets`` cannot read is refused with
the file and, where it can be found, the line. :func:`epoch_order` is a permutation seeded by
``(seed, epoch)``, for loops that draw global batches themselves (a resumed run replays it).
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from hapt_hf.errors import DataError

__all__ = ["DataError", "TextDataConfig", "load_text_dataset", "pack_tokens", "rows_dataset",
           "epoch_order", "collate_causal_lm"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class TextDataConfig:
    """Where the text comes from and how it is cut."""

    train_file: Path
    """Local .json/.jsonl (one object per line) or .txt (one sample per line) file."""
    text_column: str = "text"
    """Column holding the text (``.txt`` files always have ``text``)."""
    seq_len: int = 64
    """Tokens per packed sample."""
    validation_file: Path | None = None
    """Optional held-out file; without it a slice of the training samples is held out."""
    validation_fraction: float = 0.1


def _builder(path: Path, field: str) -> str:
    if not path.is_file():
        raise DataError(f"{field} {str(path)!r} does not exist; give a local .json, .jsonl or "
                        ".txt file")
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{field} {str(path)!r} has suffix {path.suffix!r}; use one of "
                        f"{sorted(_BUILDERS)}")
    return builder


@contextmanager
def _datasets_quiet() -> Iterator[None]:
    """datasets logs a parse failure at ERROR level on every rank before raising; the raise
    becomes one DataError, so the log line would only repeat it (once per rank)."""
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _why_unreadable(path: Path, builder: str, error: Exception) -> str:
    """Where a file datasets could not read goes wrong: the first line that is not UTF-8 text
    or (for JSON lines) not JSON; else datasets' own innermost reason."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        return f"line {line} is not UTF-8 text (byte {e.start}); is it a text file?"
    if builder == "json":
        try:
            json.loads(text)  # one JSON document: the lines are not the problem
        except ValueError:
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as e:
                    shown = line if len(line) <= 60 else line[:57] + "..."
                    return f"line {n} is not JSON ({e.msg}): {shown!r}"
    cause: BaseException = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    return " ".join(f"{type(cause).__name__}: {cause}".split())


def _load_texts(path: Path, column: str, field: str) -> list[str]:
    import datasets
    from datasets.exceptions import DatasetGenerationError

    builder = _builder(path, field)
    try:
        with _datasets_quiet():
            ds = datasets.load_dataset(builder, data_files={"train": str(path)}, split="train")
    except DatasetGenerationError as e:
        kind = ".json/.jsonl (one object per line)" if builder == "json" else ".txt"
        raise DataError(f"{field} {str(path)!r} cannot be read as {kind}: "
                        f"{_why_unreadable(path, builder, e)}; fix the file or give another "
                        "one") from None
    if column not in ds.column_names:
        raise DataError(f"{field} {str(path)!r} has no column {column!r}; its columns are "
                        f"{ds.column_names}; pass --text_column with one of them")
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


def pack_tokens(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise, join with EOS, cut into ``seq_len`` rows; the ragged tail is dropped."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    rows = len(ids) // seq_len
    if rows == 0:
        raise DataError(f"the data has only {len(ids)} tokens, fewer than one sample of "
                        f"seq_len {seq_len}; give more text or a smaller --seq_len")
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def load_text_dataset(cfg: TextDataConfig, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) packed token tensors of shape [samples, seq_len]."""
    train = pack_tokens(_load_texts(cfg.train_file, cfg.text_column, "--train_file"),
                        tokenizer, cfg.seq_len)
    if cfg.validation_file is not None:
        texts = _load_texts(cfg.validation_file, cfg.text_column, "--validation_file")
        return train, pack_tokens(texts, tokenizer, cfg.seq_len)
    held = int(len(train) * cfg.validation_fraction)
    if held == 0:
        return train, train[:0]
    return train[:-held], train[-held:]


def rows_dataset(rows: torch.Tensor):
    """Packed rows as a ``datasets.Dataset`` with ``input_ids``, ``attention_mask`` (all ones:
    packed rows hold no padding) and ``labels`` (the inputs: the model shifts them), as
    run_clm.py's ``group_texts`` makes it."""
    import datasets

    ids = rows.tolist()
    return datasets.Dataset.from_dict({"input_ids": ids,
                                       "attention_mask": [[1] * rows.shape[1]] * len(ids),
                                       "labels": ids})


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: the same on every rank and on every resume."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=gen)


def collate_causal_lm(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed rows carry no padding: labels are the inputs (the model shifts them)."""
    return {"input_ids": rows, "labels": rows.clone()}
