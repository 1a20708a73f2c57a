"""Text data for causal-LM fine-tuning: load with `datasets`, tokenise, pack to fixed length.

Every rank loads the same data and draws the same global batches in the same order (a
permutation seeded by ``(seed, epoch)``); the pipeline runtime then gives each stage the samples
it needs. Order depends only on the seed and the epoch, so a resumed run replays it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hapt_hf.errors import DataError

__all__ = ["DataError", "TextDataConfig", "load_text_dataset", "pack_tokens", "epoch_order",
           "collate_causal_lm"]

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


def _load_texts(path: Path, column: str, field: str) -> list[str]:
    import datasets

    builder = _builder(path, field)
    ds = datasets.load_dataset(builder, data_files={"train": str(path)}, split="train")
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


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: the same on every rank and on every resume."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=gen)


def collate_causal_lm(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed rows carry no padding: labels are the inputs (the model shifts them)."""
    return {"input_ids": rows, "labels": rows.clone()}
