"""The state directory of :meth:`HaptAccelerator.save_state` / ``load_state``: how it is written
(atomically, as the Trainer's checkpoints), what each rank's files hold, the checks a directory
must pass before it is loaded, and Accelerate's automatic ``checkpoint_<n>`` naming.

A directory holds the gathered model (``model.safetensors`` with ``config.json``), the plan
(``plan.json``) and, per rank, the optimizer, scheduler, RNG and loss-scaler state
(``trainer_checkpoint``'s rank file) and the loop's own state (:data:`STATE_FILE`: the loaders'
positions, the registered objects, ``accelerator.step``).
"""
from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from hapt_hf.errors import CheckpointError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.accelerate_data import AccelerateSettingError
from hapt_hf.pipeline import checkpoint_io
from hapt_hf.pipeline.runtime import PipelineRuntime
from hapt_hf.planner.plan import Plan

__all__ = ["STATE_FILE", "SavedState", "writing_state", "write_rank_state", "read_rank_state",
           "check_state_dir", "next_numbered_dir", "latest_numbered_dir"]

STATE_FILE = "hapt_accelerate_rank{rank}.pt"
"""Each rank's loop state: ``{"loaders": [...], "custom": [...], "step": int}``."""
_AUTO_NAME = re.compile(r"checkpoint_(\d+)$")


class SavedState:
    """A scheduler state taken earlier, saved as the scheduler's own."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


# -- writing --------------------------------------------------------------------------------

@contextlib.contextmanager
def writing_state(out: Path, runtime: PipelineRuntime, plan: Plan) -> Iterator[Path]:
    """A temporary directory beside ``out`` holding the gathered model and ``plan.json``, for
    the block to write this rank's files into; committed as ``out`` when the block ends without
    an exception (collective: every rank enters it)."""
    rank = runtime.rank
    if rank == 0:
        shutil.rmtree(out.parent / f"{ckpt_io.TMP_PREFIX}{out.name}", ignore_errors=True)
    tmp = ckpt_io.begin_checkpoint(out.parent, out.name, rank)
    if ckpt_io.write_gathered_model(runtime, tmp):
        plan.save(tmp / "plan.json")
    yield tmp
    ckpt_io.commit_checkpoint(tmp, out, rank)


def write_rank_state(tmp: Path, runtime: PipelineRuntime, optimizer: Any, scheduler: Any,
                     rng: tuple[torch.Tensor, Any] | None, loop: dict[str, Any]) -> None:
    """This rank's files: the optimizer, scheduler, RNG (``rng``, CPU and CUDA, where given;
    else the current states) and loss-scaler state, and the loop's state ``loop``."""
    with _torch_rng(rng):
        ckpt_io.save_rank_state(tmp, runtime.rank, optimizer, scheduler, runtime.loss_scaler)
    torch.save(loop, tmp / STATE_FILE.format(rank=runtime.rank))


@contextlib.contextmanager
def _torch_rng(states: tuple[torch.Tensor, Any] | None) -> Iterator[None]:
    """Within: the torch RNG states given (CPU, CUDA; None: as they are), the current ones back
    afterwards."""
    if states is None:
        yield
        return
    now = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    _set_torch_rng(states)
    try:
        yield
    finally:
        _set_torch_rng(now)


def _set_torch_rng(states: tuple[torch.Tensor, Any]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


# -- reading --------------------------------------------------------------------------------

def check_state_dir(ckpt: Path, plan: Plan) -> None:
    """Refuse a state directory that is incomplete or was saved under another plan."""
    needed = ["plan.json", "model.safetensors"] + [
        n.format(rank=r) for r in range(plan.world_size)
        for n in (ckpt_io.RANK_STATE, STATE_FILE)]
    missing = [n for n in needed if not (ckpt / n).is_file()]
    if missing:
        raise CheckpointError(f"load_state: {str(ckpt)!r} lacks {missing}; give a directory "
                              f"written by save_state of a {plan.world_size}-rank hapt run")
    saved = Plan.load(ckpt / "plan.json")
    if ckpt_io.placements(saved) != ckpt_io.placements(plan):
        raise CheckpointError(f"load_state: {str(ckpt)!r} was saved under another plan (stages "
                              f"{ckpt_io.describe_placements(saved)}, this run's "
                              f"{ckpt_io.describe_placements(plan)}); load it with the same plan "
                              "(its plan.json as 'plan' in the hapt config)")
    ckpt_io.check_optimizer_states(saved, plan, f"load_state: {str(ckpt)!r}")


def read_rank_state(ckpt: Path, runtime: PipelineRuntime, optimizer: Any,
                    scheduler: Any) -> dict[str, Any]:
    """Load this rank's optimizer, scheduler, RNG and loss-scaler state; return the loop's
    state (:data:`STATE_FILE`)."""
    ckpt_io.load_rank_state(ckpt, runtime.rank, optimizer, scheduler, runtime.loss_scaler)
    path = ckpt / STATE_FILE.format(rank=runtime.rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - one message naming the file
        raise checkpoint_io.damaged_file(path, e) from None


# -- automatic checkpoint naming ------------------------------------------------------------

def _numbered(root: Path) -> list[Path]:
    """``checkpoint_<n>`` directories under ``root``, oldest first (Accelerate's naming)."""
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
             if (m := _AUTO_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def next_numbered_dir(root: Path, iteration: int, total_limit: int | None,
                      main_process: bool) -> Path:
    """``root/checkpoint_<iteration>``, refused if it exists; the main process makes ``root``
    and removes the oldest ``checkpoint_<n>`` past ``total_limit`` (with the new one)."""
    out = root / f"checkpoint_{iteration}"
    if out.exists():
        raise AccelerateSettingError(f"checkpoint directory {out} ({iteration}) "
                                     "already exists; set ProjectConfiguration(iteration=...) "
                                     "to the iteration to start from")
    if main_process:
        root.mkdir(parents=True, exist_ok=True)
        saved = _numbered(root)
        if total_limit is not None and len(saved) + 1 > total_limit:
            for old in saved[:len(saved) + 1 - total_limit]:
                shutil.rmtree(old)
    return out


def latest_numbered_dir(root: Path) -> Path:
    """The newest ``checkpoint_<n>`` under ``root``; refused if there is none."""
    saved = _numbered(root)
    if not saved:
        raise CheckpointError(f"load_state: no checkpoint_<n> under {root}")
    return saved[-1]
