"""``save_model`` / ``save_pretrained`` of a pipeline run: the ``from_pretrained`` directory
each stage writes its own part of (:mod:`hapt_hf.pipeline.export`), committed so that a crash
never leaves a half-written file in place of an earlier export.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.pipeline.export import remove_stale_weights, write_stage_shards

__all__ = ["export_model"]


def export_model(runtime: Any, out: Path, extra: Callable[[Path], None] | None = None) -> list[str]:
    """Write the model into ``out`` (collective): every writer's file into a temporary
    directory inside it, rank 0's index and config (and ``extra(directory)``, e.g. the
    tokenizer), then rank 0 moves each file into place and removes an earlier export's weights
    files the new ones do not replace. Returns the tensor names this rank wrote."""
    tmp = ckpt_io.begin_model_save(out) if runtime.rank == 0 \
        else out / f"{ckpt_io.TMP_PREFIX}save"
    ckpt_io.barrier()  # the directory exists before any rank writes into it
    written = write_stage_shards(runtime, tmp)  # rank 0 returns once every file is written
    if runtime.rank == 0:
        if extra is not None:
            extra(tmp)
        remove_stale_weights(out, tmp)
        ckpt_io.finish_model_save(tmp, out)
    ckpt_io.barrier()
    return written
