"""Per-stage safetensors I/O: read only a stage's tensors, write a loadable full checkpoint.

A rank never reads the whole model: `safe_open` reads the file header, then `get_tensor` reads
only the keys asked for. Checkpoints are the Hugging Face layout: `model.safetensors`, or shards
listed by `model.safetensors.index.json`. The checkpoint directories of a training run (optimizer
state, trainer state, atomic commit) are :mod:`hapt_hf.integration.trainer_checkpoint`'s.
Every refusal is a :class:`hapt_hf.errors.CheckpointError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.tensor import distribute_tensor

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline.tensor_parallel import is_sharded

__all__ = [
    "CheckpointError",
    "checkpoint_key_files",
    "damaged_file",
    "copy_into",
    "gather_state_dicts",
    "load_stage_tensors",
    "read_tensors",
    "save_full_checkpoint",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def damaged_file(path: str | Path, error: BaseException) -> CheckpointError:
    """The one message for a checkpoint file that exists but cannot be read."""
    reason = (str(error).splitlines() or [""])[0][:200]
    return CheckpointError(
        f"checkpoint file {str(path)!r} is damaged or incomplete ({type(error).__name__}: "
        f"{reason}); use another checkpoint (to resume, pass the path of an earlier checkpoint-N "
        "directory as resume_from_checkpoint), or write this one again")


def _open(path: Path):
    """``safe_open`` of one safetensors file, a damaged file named in a CheckpointError."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise damaged_file(path, e) from None


def checkpoint_key_files(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Map every tensor key of a checkpoint directory to the safetensors file holding it.

    Reads only the index (sharded) or the file header (single file), never tensor data.
    """
    root = Path(checkpoint_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {key: root / name for key, name in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise damaged_file(index, e) from None
    single = root / SINGLE_FILE
    if single.is_file():
        with _open(single) as handle:
            return {key: single for key in handle.keys()}
    raise CheckpointError(
        f"checkpoint_dir {str(root)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
        "point it at a directory written by save_pretrained(safe_serialization=True)"
    )


def read_tensors(
    checkpoint_dir: str | Path, keys: Iterable[str], aliases: Mapping[str, str] | None = None
) -> dict[str, Tensor]:
    """Read exactly `keys` from the checkpoint (on CPU), opening each shard once.

    `aliases` maps a key the checkpoint may lack to the key that holds the same tensor (a tied
    LM head saved only as the input embedding).
    """
    key_files = checkpoint_key_files(checkpoint_dir)
    source = {key: _source_key(key, key_files, aliases or {}, checkpoint_dir) for key in keys}
    by_file: dict[Path, list[str]] = {}
    for key, stored in source.items():
        by_file.setdefault(key_files[stored], []).append(key)
    tensors: dict[str, Tensor] = {}
    for path, wanted in by_file.items():
        with _open(path) as handle:
            for key in wanted:
                try:
                    tensors[key] = handle.get_tensor(source[key])
                except SafetensorError as e:
                    raise damaged_file(path, e) from None
    return tensors


def _source_key(key: str, key_files: Mapping[str, Path], aliases: Mapping[str, str],
                checkpoint_dir: str | Path) -> str:
    if key in key_files:
        return key
    alias = aliases.get(key)
    if alias is not None and alias in key_files:
        return alias
    raise CheckpointError(
        f"checkpoint_dir {str(checkpoint_dir)!r} has no tensor {key!r}; it must be a checkpoint of "
        "the same model architecture and config as the one the stage is built from"
    )


def gather_state_dicts(stage_dicts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Merge every stage's `hf_state_dict()` into the full model's state dict.

    Stages own disjoint layers, so a key seen twice means overlapping layer ranges.
    """
    full: dict[str, Tensor] = {}
    for index, part in enumerate(stage_dicts):
        for key, value in part.items():
            if key in full:
                raise CheckpointError(
                    f"key {key!r} appears in two stages (second: stage {index}); stages must own "
                    "disjoint layer ranges"
                )
            full[key] = value
    return full


def save_full_checkpoint(
    state_dict: Mapping[str, Tensor], config, out_dir: str | Path, tied_keys: Iterable[str] = ()
) -> Path:
    """Write `state_dict` and `config` as a directory `from_pretrained` loads.

    `tied_keys` are dropped from the file (as save_pretrained does for a tied LM head): safetensors
    refuses tensors that share memory, and loading ties them again.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(tied_keys)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in skip}
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    return out


def copy_into(target: Tensor, value: Tensor, key: str) -> None:
    """Copy a checkpoint tensor into a stage tensor, naming the key on a shape mismatch.

    A tensor-parallel shard (a DTensor; its ``shape`` is the whole tensor's) takes its own
    part of the whole ``value``, cut as its placements say, with no collective."""
    if tuple(target.shape) != tuple(value.shape):
        raise CheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(value.shape)} but the stage expects "
            f"{tuple(target.shape)}; the checkpoint's config does not match the one given"
        )
    with torch.no_grad():
        if is_sharded(target):
            part = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                     src_data_rank=None)
            target.to_local().copy_(part.to_local())
        else:
            target.copy_(value)


def load_stage_tensors(stage: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Read only `stage`'s own tensors from a checkpoint directory and copy them in.

    A tied LM head is saved once, as the input embedding (as save_pretrained does); an untied one
    must be in the file. Raises CheckpointError naming the key on a missing or misshapen tensor.
    """
    adapter = stage.adapter
    tied = getattr(stage.config, "tie_word_embeddings", False)
    aliases = {adapter.output_embedding_key: adapter.input_embedding_key} if tied else {}
    targets = stage.state_dict(keep_vars=True)
    tensors = read_tensors(checkpoint_dir, targets.keys(), aliases)
    for key, target in targets.items():
        copy_into(target, tensors[key], key)
