"""The ``from_pretrained`` export written from the stages: no rank holds the whole model.

Each pipeline rank's first replica writes its own weights as one file of Hugging Face's sharded
layout, ``model-0000k-of-0000n.safetensors`` (``k`` its pipeline position, ``n`` the number of
pipeline ranks; a tensor-parallel replica gathers its shards inside the replica first, and its
first rank writes). Rank 0 then writes ``model.safetensors.index.json`` (every tensor's file,
from the names and sizes each writer sends, no tensor data) and ``config.json``.
``AutoModelForCausalLM.from_pretrained`` loads the directory as one written by
``save_pretrained``, and :func:`hapt_hf.pipeline.checkpoint_io.load_stage_tensors` reads a
stage's tensors back from it. A plan of one stage writes ``model.safetensors`` alone, as
``save_pretrained`` does for a model of one shard. A tied output embedding is left out (stored
once, as the input embedding), as ``save_pretrained`` leaves it out.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from hapt_hf.pipeline.checkpoint_io import INDEX_FILE, SINGLE_FILE
from hapt_hf.pipeline.tensor_parallel import full_state_dict

__all__ = ["shard_file", "write_stage_shards", "has_weights", "remove_stale_weights"]


def shard_file(position: int, count: int) -> str:
    """The file of pipeline position ``position`` (from 0) of ``count``."""
    return SINGLE_FILE if count == 1 else f"model-{position + 1:05d}-of-{count:05d}.safetensors"


def _is_weights_file(name: str) -> bool:
    return name in (SINGLE_FILE, INDEX_FILE) or (name.startswith("model-")
                                                 and name.endswith(".safetensors"))


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds an export's weights (one file, or the index of several)."""
    return (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file()


def remove_stale_weights(out: Path, new: Path) -> None:
    """Remove the weights files of an earlier export from ``out`` that the export in ``new``
    does not replace (an index or a shard of another count would shadow or confuse it)."""
    keep = {p.name for p in new.iterdir()}
    for path in out.iterdir() if out.is_dir() else ():
        if path.is_file() and _is_weights_file(path.name) and path.name not in keep:
            os.remove(path)


def write_stage_shards(runtime: Any, out_dir: Path) -> list[str]:
    """Write this rank's part of the export into ``out_dir`` (a directory every rank sees,
    made here if missing; collective: every rank calls it). Returns the tensor names this rank
    wrote (none on ranks that are not a pipeline rank's first replica's first rank)."""
    plan, work, stage = runtime.plan, runtime.work, runtime.stage
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    count = plan.num_pipeline_ranks
    name = shard_file(runtime.stage_plan.index % count, count)
    mine: dict[str, Tensor] = {}
    if work.replica == 0:
        state = stage.hf_state_dict()
        if work.tp > 1:
            with runtime.channel.collective("the export's tensor-parallel gather",
                                            runtime.stage_plan.index, work.tp_ranks):
                state = full_state_dict(state)
        if work.tp_rank == 0:
            tied = stage.adapter.output_embedding_key \
                if getattr(stage.config, "tie_word_embeddings", False) else None
            mine = {k: v.detach().cpu().contiguous() for k, v in state.items() if k != tied}
            save_file(mine, str(out_dir / name), metadata={"format": "pt"})
    sizes = {k: v.numel() * v.element_size() for k, v in mine.items()}
    ranks = range(plan.world_size)
    parts: list[Any] = [(name, sizes)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * len(ranks) if runtime.rank == 0 else None
        with runtime.channel.collective("the export's index", runtime.stage_plan.index, ranks):
            dist.gather_object((name, sizes) if mine else None, parts, dst=0)
    if runtime.rank == 0:
        if count > 1:
            _write_index(out_dir, [p for p in parts if p])
        stage.config.save_pretrained(str(out_dir))
    return sorted(mine)


def _write_index(out_dir: Path, parts: list[tuple[str, dict[str, int]]]) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    weight_map = {k: name for name, sizes in parts for k in sizes}
    total = sum(s for _, sizes in parts for s in sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
