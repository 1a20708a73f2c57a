"""Checkpoints any plan can resume: model and optimizer state keyed by parameter name.

A stage's ``state_dict`` keys are the full model's (``model.layers.3.mlp.up_proj.weight``), so
every tensor a run holds has a name that does not depend on the plan. :func:`save_portable`
writes, with ``torch.distributed.checkpoint`` (DCP), each rank's own tensors under those names:

* ``model.<name>``: the stage's parameters and buffers (replicas of a stage offer the same
  tensors; DCP's planner keeps one writer of each; a tensor-parallel parameter is a DTensor,
  each shard written by its own rank);
* ``optim.<name>.<state>``: the optimizer state of that parameter (Adam's ``exp_avg``,
  ``exp_avg_sq``, ``step``), written by the rank that holds it: every replica of a replicated
  stage (one kept), the owner alone under a :class:`~hapt_hf.pipeline.zero.ShardedOptimizer`.

:func:`load_portable` reads, on any plan, exactly the names of this rank's stage (and, for a
sharded optimizer, the parameters this rank owns), whatever plan wrote them: DCP reshards at
load time. Each rank writes and reads only its own part; no rank gathers the model. The
optimizer's hyperparameters (``lr``, ...) and the LR scheduler's state are not tensors of a
parameter: the caller keeps them beside the checkpoint (:func:`group_settings`,
:func:`apply_group_settings`). Every refusal is a :class:`hapt_hf.errors.CheckpointError`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import StorageReader

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline.zero import ShardedOptimizer

__all__ = ["MODEL_PREFIX", "OPTIM_PREFIX", "METADATA_FILE", "PortableLoad", "is_portable",
           "portable_state_dict", "save_portable", "prepare_load", "load_portable", "group_settings",
           "apply_group_settings"]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
METADATA_FILE = ".metadata"
"""The file DCP writes last, naming every tensor of the checkpoint."""


def is_portable(path: str | Path) -> bool:
    """Whether ``path`` holds a checkpoint :func:`save_portable` wrote."""
    return (Path(path) / METADATA_FILE).is_file()


def _state_of(optimizer: torch.optim.Optimizer | None) -> Any:
    """The optimizer state this rank holds, keyed by parameter (a sharded optimizer's: its own
    parameters' only)."""
    if optimizer is None:
        return {}
    return optimizer.optim.state if isinstance(optimizer, ShardedOptimizer) else optimizer.state


def _owned(optimizer: torch.optim.Optimizer | None) -> set[int]:
    """``id`` of every parameter whose state this rank's optimizer keeps."""
    if optimizer is None:
        return set()
    inner = optimizer.optim if isinstance(optimizer, ShardedOptimizer) else optimizer
    return {id(p) for g in inner.param_groups for p in g["params"]}


def portable_state_dict(stage: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None) -> dict[str, Tensor]:
    """This rank's tensors under their portable names (sharing the stage's storage)."""
    out: dict[str, Tensor] = {}
    for name, t in stage.state_dict(keep_vars=True).items():
        out[MODEL_PREFIX + name] = t.detach()
    state = _state_of(optimizer)
    # a tied parameter's state under each of its names: another plan may hold them apart
    for name, p in stage.named_parameters(remove_duplicate=False):
        for key, value in state.get(p, {}).items():
            if not isinstance(value, Tensor):  # a float step (capturable=False on old torch)
                value = torch.tensor(float(value), dtype=torch.float32)
            out[f"{OPTIM_PREFIX}{name}.{key}"] = value.detach()
    return out


def save_portable(path: str | Path, stage: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> None:
    """Write this rank's model and optimizer tensors into ``path`` (collective: every rank of
    the default process group calls it, each writing its own files). To keep them on local
    disk with a copy on shared or remote storage, save :func:`portable_state_dict` with
    :meth:`hapt_hf.pipeline.checkpoint_store.CheckpointStore.save` instead."""
    dcp.save(portable_state_dict(stage, optimizer), checkpoint_id=str(path))


def _metadata(path: Path, reader: StorageReader | None) -> dict[str, Any]:
    try:
        return (reader or dcp.FileSystemReader(str(path))).read_metadata().state_dict_metadata
    except CheckpointError:  # the reader's own, naming the file (a remote that did not answer)
        raise
    except Exception as e:  # noqa: BLE001 - one message naming the file
        raise CheckpointError(f"{str(path / METADATA_FILE)!r} cannot be read ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0][:200]}); use another checkpoint "
                              "or write this one again") from None


@dataclass
class PortableLoad:
    """What one rank reads from a portable checkpoint (:func:`prepare_load`): its tensors under
    their names, and the optimizer state they become."""

    path: Path
    wanted: dict[str, Tensor]
    """Name to the tensor it is read into (the stage's own, or a new buffer of state)."""
    optimizer: torch.optim.Optimizer | None
    new_state: dict[Any, dict[str, Tensor]]
    """Parameter to its optimizer state, once read."""
    reader: StorageReader | None = None
    """Where the tensors come from (None: DCP's file reader of ``path``)."""

    def read(self) -> None:
        """Read every wanted tensor (collective: every rank calls it), then make the buffers
        the optimizer's state of their parameters (replacing what it held)."""
        with torch.no_grad():
            if self.reader is not None:
                dcp.load(self.wanted, storage_reader=self.reader)
            else:
                dcp.load(self.wanted, checkpoint_id=str(self.path))
        state = _state_of(self.optimizer)
        for p, entry in self.new_state.items():
            state[p] = dict(entry)


def prepare_load(path: str | Path, stage: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 reader: StorageReader | None = None) -> PortableLoad:
    """What this rank reads from ``path`` (local: no collective, so that a refusal can be
    agreed on before any rank reads): its stage's tensors and, for each parameter its optimizer
    keeps, that parameter's saved state (a tensor-parallel parameter's as a DTensor of its
    placements, so each rank reads its own slice). Refused, naming the tensor, where the
    checkpoint lacks one of the stage's tensors or holds it in another shape. ``reader``: a DCP
    storage reader to read through instead of the files under ``path`` (e.g.
    :meth:`hapt_hf.pipeline.checkpoint_store.CheckpointStore.reader`: local copy first, the rest
    fetched from the remote); ``path`` then only names the checkpoint in messages."""
    path = Path(path)
    if reader is None and not is_portable(path):
        raise CheckpointError(f"{str(path)!r} holds no {METADATA_FILE}: it is not a checkpoint "
                              "written by save_portable (or its save did not finish)")
    meta = _metadata(path, reader)
    wanted = {MODEL_PREFIX + n: t.detach() for n, t in stage.state_dict(keep_vars=True).items()}
    owned = _owned(optimizer)
    new_state: dict[Any, dict[str, Tensor]] = {}
    for name, p in stage.named_parameters():
        if id(p) not in owned:
            continue
        prefix = f"{OPTIM_PREFIX}{name}."
        for key in (k for k in meta if k.startswith(prefix) and "." not in k[len(prefix):]):
            size, dtype = tuple(meta[key].size), meta[key].properties.dtype
            # not filled: the read overwrites every element (the checkpoint holds the whole tensor)
            if size == tuple(p.shape):
                buf = torch.empty_like(p, dtype=dtype).detach()  # a DTensor like a TP parameter
            else:  # Adam's step: a scalar on the CPU
                buf = torch.empty(size, dtype=dtype, device="cpu" if not size else p.device)
            new_state.setdefault(p, {})[key[len(prefix):]] = buf
            wanted[key] = buf
    for key, t in wanted.items():
        saved = meta.get(key)
        if saved is None:
            raise CheckpointError(f"checkpoint {str(path)!r} has no tensor {key!r}; it must be a "
                                  "checkpoint of the same model architecture and config")
        if tuple(saved.size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(saved.size)} but "
                                  f"this run's is {tuple(t.shape)}; the checkpoint's config does "
                                  "not match the one given")
    return PortableLoad(path, wanted, optimizer, new_state, reader)


def load_portable(path: str | Path, stage: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  reader: StorageReader | None = None) -> None:
    """Read this stage's tensors (and its optimizer's state) from ``path``, whatever plan wrote
    it (collective: every rank calls it): :func:`prepare_load`, then :meth:`PortableLoad.read`.
    The optimizer must not have stepped: its state is replaced by the saved state of the
    parameters it keeps."""
    prepare_load(path, stage, optimizer, reader).read()


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, group by group (everything but the parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Write saved hyperparameters (:func:`group_settings`) into the optimizer's own group
    dicts (an LR scheduler built on it keeps driving them); refused where the groups differ."""
    if len(settings) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(settings)} parameter groups, "
                              f"this run's {len(optimizer.param_groups)}; resume with the same "
                              "optimizer and trainable parameters")
    for group, saved in zip(optimizer.param_groups, settings):
        group.update(saved)
