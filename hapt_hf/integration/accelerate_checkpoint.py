"""The state directory of :meth:`HaptAccelerator.save_state` / ``load_state``: how it is written
(atomically, as the Trainer's checkpoints), what each rank's files hold, the checks a directory
must pass before it is loaded, and Accelerate's automatic ``checkpoint_<n>`` naming.

A directory holds the model as ``from_pretrained`` loads it (``config.json`` with the weights,
each stage's written by that stage), the plan (``plan.json``) and two forms of the rest:

* per rank, the optimizer, scheduler, RNG and loss-scaler state (``trainer_checkpoint``'s rank
  file) and the loop's own state (:data:`STATE_FILE`: the loaders' positions, the registered
  objects, ``accelerator.step``): what a run on the same plan reads back bit for bit;
* the portable form any plan reads: every rank's model and optimizer tensors keyed by parameter
  name (``portable/``, :mod:`hapt_hf.pipeline.portable`) and, on rank 0, :data:`PORTABLE_FILE`
  (the LR scheduler, the optimizer's hyperparameters, RNG, loss scale, the loop's state and the
  shape of the run that wrote it: processes, rows per micro-step, accumulation steps).
  :func:`read_portable` reads it under another plan (other processes, stages, replicas or
  optimizer sharding; the same layers, global batch, sequence length and precision), turning
  the loaders' positions and the scheduler's step count into this run's.
"""
from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from hapt_hf.errors import CheckpointError
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.accelerate_data import AccelerateSettingError
from hapt_hf.integration.elastic import ACCELERATE_NAMING
from hapt_hf.pipeline import checkpoint_io, portable
from hapt_hf.pipeline.export import has_weights, write_stage_shards
from hapt_hf.pipeline.runtime import PipelineRuntime
from hapt_hf.planner.plan import Plan

__all__ = ["STATE_FILE", "PORTABLE_FILE", "RunShape", "SavedState", "writing_state",
           "write_rank_state", "read_rank_state", "write_portable", "read_portable",
           "check_state_dir", "moved_loop", "rescaled_scheduler", "next_numbered_dir",
           "latest_numbered_dir"]

STATE_FILE = "hapt_accelerate_rank{rank}.pt"
"""Each rank's loop state: ``{"loaders": [...], "custom": [...], "step": int}``."""
PORTABLE_FILE = "hapt_accelerate_portable.pt"
"""Rank 0's part of the portable form besides the tensors (see the module's docstring)."""


@dataclass(frozen=True)
class RunShape:
    """What a loop's saved counters are counted in: they turn into another run's units when the
    state is read under another plan."""

    num_processes: int
    scheduler_per_process: bool
    """Accelerate steps the LR scheduler ``num_processes`` times per optimizer step
    (``step_scheduler_with_optimizer`` without ``split_batches``)."""
    gradient_accumulation_steps: int
    rows: tuple[int, ...]
    """Each prepared loader's rows per micro-step, every process's together."""


class SavedState:
    """A scheduler state taken earlier, saved as the scheduler's own."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


# -- writing --------------------------------------------------------------------------------

@contextlib.contextmanager
def writing_state(out: Path, runtime: PipelineRuntime, plan: Plan) -> Iterator[Path]:
    """A temporary directory beside ``out`` holding the model (each stage's file written by
    that stage) and ``plan.json``, for
    the block to write this rank's files into; committed as ``out`` when the block ends without
    an exception (collective: every rank enters it)."""
    rank = runtime.rank
    if rank == 0:
        shutil.rmtree(out.parent / f"{ckpt_io.TMP_PREFIX}{out.name}", ignore_errors=True)
    tmp = ckpt_io.begin_checkpoint(out.parent, out.name, rank)
    write_stage_shards(runtime, tmp)
    if rank == 0:
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


def write_portable(tmp: Path, runtime: PipelineRuntime, optimizer: Any, scheduler: Any,
                   rng: tuple[torch.Tensor, Any] | None, loop: dict[str, Any],
                   shape: RunShape) -> None:
    """The portable form (collective): every rank's model and optimizer tensors by parameter
    name, and on rank 0 :data:`PORTABLE_FILE` (the LR scheduler, the optimizer's
    hyperparameters, RNG as :func:`write_rank_state` takes it, the loss scale, ``loop`` and
    ``shape``). Rank 0's loop state and RNG stand for every rank's: every rank draws the data
    order from rank 0's RNG state."""
    portable.save_portable(tmp / ckpt_io.PORTABLE_DIR, runtime.stage, optimizer)
    if runtime.rank != 0:
        return
    scaler = runtime.loss_scaler
    with _torch_rng(rng):
        state = {"scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "groups": portable.group_settings(optimizer), "rng": ckpt_io.rng_state(),
                 "loss_scale": scaler.state_dict() if scaler is not None else None,
                 "loop": loop, "shape": asdict(shape)}
    path = tmp / PORTABLE_FILE
    torch.save(state, path)
    ckpt_io.fsync_path(path)


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
    needed = ["plan.json"] + [n.format(rank=r) for r in range(plan.world_size)
                              for n in (ckpt_io.RANK_STATE, STATE_FILE)]
    missing = [n for n in needed if not (ckpt / n).is_file()]
    if not has_weights(ckpt):
        missing.insert(1, "the model's weights (model.safetensors or its index)")
    if missing:
        raise CheckpointError(f"load_state: {str(ckpt)!r} lacks {missing}; give a directory "
                              f"written by save_state of a {plan.world_size}-rank hapt run")
    saved = _saved_plan(ckpt)
    ckpt_io.check_same_run(saved, plan, f"load_state: {str(ckpt)!r}", _BATCH_FIX)
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


_BATCH_FIX = ("make the training DataLoader's batch_size x num_processes x "
              "gradient_accumulation_steps (batch_size x gradient_accumulation_steps with "
              "split_batches) equal to it")


def _saved_plan(ckpt: Path) -> Plan:
    try:
        return Plan.load(ckpt / "plan.json")
    except (ValueError, OSError) as e:  # a PlanError, or no such file
        raise checkpoint_io.damaged_file(ckpt / "plan.json", e) from None


def read_portable(ckpt: Path, runtime: PipelineRuntime, optimizer: Any, scheduler: Any,
                  shape: RunShape) -> dict[str, Any]:
    """Load the portable form of a directory written under another plan into this rank: its
    stage's tensors and its optimizer's state by parameter name, then the scheduler (its step
    count in this run's units: :func:`rescaled_scheduler`), hyperparameters, loss scale and RNG;
    return the loop's state with the loaders' positions and ``accelerator.step`` in this run's
    units. The ranks agree on every check before any of them reads (collective)."""
    channel, index = runtime.channel, runtime.stage_plan.index

    def check() -> tuple[portable.PortableLoad, dict[str, Any]]:
        ckpt_io.check_same_run(_saved_plan(ckpt), runtime.plan, f"load_state: {str(ckpt)!r}",
                               _BATCH_FIX)
        path = ckpt / PORTABLE_FILE
        if not path.is_file():
            raise CheckpointError(f"load_state: {str(ckpt)!r} lacks {PORTABLE_FILE}; it was "
                                  "not written by save_state of a hapt run (or is damaged)")
        reads = portable.prepare_load(ckpt / ckpt_io.PORTABLE_DIR, runtime.stage, optimizer)
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)  # our own file
            saved = RunShape(**{**state["shape"], "rows": tuple(state["shape"]["rows"])})
        except Exception as e:  # noqa: BLE001 - one message naming the file
            raise checkpoint_io.damaged_file(path, e) from None
        state["loop"] = moved_loop(state["loop"], saved, shape, ckpt)
        if scheduler is not None and state["scheduler"] is not None:
            state["scheduler"] = rescaled_scheduler(state["scheduler"], scheduler.state_dict(),
                                                    saved, shape)
        return reads, state

    reads, state = channel.agree("checking the state", index, check,
                                 refusals=(CheckpointError,))
    reads.read()  # every rank has passed the checks

    def apply() -> None:
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        portable.apply_group_settings(optimizer, state["groups"])
        if runtime.loss_scaler is not None and state["loss_scale"] is not None:
            runtime.loss_scaler.load_state_dict(state["loss_scale"])
        ckpt_io.set_rng_state(state["rng"])
    channel.agree("loading the state", index, apply, refusals=(CheckpointError,))
    return state["loop"]


def moved_loop(loop: dict[str, Any], saved: RunShape, now: RunShape,
               ckpt: Path) -> dict[str, Any]:
    """The loop's state counted in this run's units: a loader's position (micro-steps handed
    out) by the rows they held, ``accelerator.step`` by optimizer steps."""
    where = f"load_state: {str(ckpt)!r}"
    if len(saved.rows) != len(now.rows):
        raise CheckpointError(f"{where} holds the positions of {len(saved.rows)} prepared "
                              f"DataLoader(s), this run prepared {len(now.rows)}; prepare the "
                              "same DataLoaders as the run that saved it")
    loaders = []
    for i, (state, old, new) in enumerate(zip(loop["loaders"], saved.rows, now.rows)):
        rows = state["position"] * old
        if rows % new:
            raise CheckpointError(f"{where}: DataLoader {i} had handed out {rows} rows "
                                  f"({state['position']} micro-steps of {old}), not a whole "
                                  f"number of this run's micro-steps of {new} rows; give it "
                                  f"a batch_size that makes its micro-steps divide {rows}")
        loaders.append({**state, "position": rows // new})
    step = loop["step"]
    old_ga, new_ga = saved.gradient_accumulation_steps, now.gradient_accumulation_steps
    if old_ga != new_ga:
        if step % old_ga:
            raise CheckpointError(f"{where} was saved at micro-step {step}, inside an "
                                  f"accumulation window of {old_ga}; load it with "
                                  f"gradient_accumulation_steps={old_ga}")
        step = step // old_ga * new_ga
    return {**loop, "loaders": loaders, "step": step}


def rescaled_scheduler(saved: dict[str, Any], fresh: dict[str, Any], old: RunShape,
                       new: RunShape) -> dict[str, Any]:
    """The saved LR scheduler state for this run. Where Accelerate steps the scheduler once per
    process per optimizer step, a run of another number of processes counts
    ``num_processes`` steps per update, and its scheduler is built for that count (as
    Accelerate asks: warm-up and total steps times ``num_processes``); then the position
    (``last_epoch``, ``_step_count``) is moved into this run's count and the rest is the
    scheduler as this run built it (``fresh``). Otherwise the saved state as it is.

    A scheduler of schedulers moves its children too: a ChainedScheduler's each by its own
    count; a SequentialLR's own count, its milestones being this run's (built times
    ``num_processes`` as the children's lengths, so they must fall on the saved run's optimizer
    steps) and each child at the count this run's SequentialLR gives it there (a child not
    started yet stays as built). A CosineAnnealingWarmRestarts (alone or as a child) moves its
    place in the cycle too: ``T_cur`` and ``T_i`` at the moved count from this run's ``T_0`` and
    ``T_mult``, as stepping it there would leave them. Refused, naming what: a count that is not
    a whole number of optimizer steps, a ReduceLROnPlateau (it counts its patience in steps), a
    CosineAnnealingWarmRestarts whose ``T_cur`` does not follow from its count (stepped with an
    explicit epoch), a child that is itself a scheduler of schedulers, and children or
    milestones that differ from this run's."""
    p_old = old.num_processes if old.scheduler_per_process else 1
    p_new = new.num_processes if new.scheduler_per_process else 1
    if p_old == p_new:
        return saved

    def refused(what: str, why: str) -> CheckpointError:
        return CheckpointError(f"load_state: the LR scheduler steps {p_old} times per optimizer "
                               f"step in the saved run and {p_new} times in this one, and {what} "
                               f"cannot be moved between the two ({why}); load it on "
                               f"{old.num_processes} processes, or prepare with split_batches=True")

    def updates(state: dict[str, Any], what: str) -> int:
        whole, rest = divmod(state["last_epoch"], p_old)
        if rest:
            raise CheckpointError(f"load_state: {what} stands at step {state['last_epoch']}, "
                                  f"not a whole number of optimizer steps of {p_old} scheduler "
                                  "steps each (capped at its total_steps?); load it on "
                                  f"{old.num_processes} processes")
        return whole

    if "_schedulers" not in saved:
        if (why := _unmovable(saved)) is not None:
            raise refused("its state", why)
        return _at_count(saved, fresh, updates(saved, "the saved LR scheduler") * p_new)
    kind = _composite_kind(saved)
    if kind is None:
        raise refused("its state", "a scheduler of schedulers other than SequentialLR and "
                                   "ChainedScheduler")
    if _composite_kind(fresh) != kind:
        raise refused(f"the {kind}", f"this run's scheduler is not a {kind}")
    olds, news = saved["_schedulers"], fresh["_schedulers"]
    if len(olds) != len(news):
        raise refused(f"the {kind}", f"it held {len(olds)} schedulers in the saved run, "
                                     f"{len(news)} in this one")
    for i, (child, built) in enumerate(zip(olds, news)):
        why = _unmovable(child, composite_child=True)
        if why is None and set(child) != set(built):
            why = "this run's child there is another kind of scheduler"
        if why is not None:
            raise refused(f"child {i} of the {kind}", why)
    if kind == "ChainedScheduler":  # every child steps at every step: each by its own count
        children = [_at_count(child, built,
                              updates(child, f"child {i} of the saved ChainedScheduler") * p_new)
                    for i, (child, built) in enumerate(zip(olds, news))]
        return {**fresh, "_last_lr": saved["_last_lr"], "_schedulers": children}
    was, now = list(saved["_milestones"]), list(fresh["_milestones"])
    if len(was) != len(now) or any(a * p_new != b * p_old for a, b in zip(was, now)):
        raise refused("the SequentialLR", f"its milestones {was} of the saved run fall at "
                                          f"other optimizer steps than this run's {now}; build "
                                          "them, as the children's lengths, times num_processes")
    count = updates(saved, "the saved SequentialLR") * p_new
    children = []
    for i, (child, built) in enumerate(zip(olds, news)):
        start = now[i - 1] if i else 0
        if count < start:  # not started yet (as in the saved run): as this run built it
            children.append(built)
            continue
        last = count if i == len(now) else min(count, now[i] - 1)
        children.append(_at_count(child, built, last - start))
    return {**fresh, "last_epoch": count, "_last_lr": saved["_last_lr"], "_schedulers": children}


def _composite_kind(state: dict[str, Any]) -> str | None:
    """Which scheduler of schedulers a state is (None: another, or none)."""
    if "_schedulers" not in state:
        return None
    return ("SequentialLR" if "_milestones" in state else
            "ChainedScheduler" if "last_epoch" not in state else None)


def _unmovable(state: dict[str, Any], composite_child: bool = False) -> str | None:
    """Why a scheduler's state cannot be moved to another count by its ``last_epoch`` (and
    ``_step_count``) alone; None where it can."""
    if "_schedulers" in state and composite_child:
        return "it is itself a scheduler of schedulers"
    if "last_epoch" not in state:
        return "its state holds no step count: not an LRScheduler"
    if "T_cur" in state and state["last_epoch"] >= 0 and (state["T_cur"], state["T_i"]) != \
            _cycle(state["T_0"], state["T_mult"], state["last_epoch"]):
        return (f"its T_cur {state['T_cur']} and T_i {state['T_i']} are not those of step "
                f"{state['last_epoch']}: stepped with an explicit epoch (CosineAnnealingWarmRestarts)")
    if "num_bad_epochs" in state:
        return "it counts its patience in steps (ReduceLROnPlateau)"
    return None


def _at_count(saved: dict[str, Any], fresh: dict[str, Any], count: int) -> dict[str, Any]:
    """The scheduler as this run built it (``fresh``) at step ``count``: ``_step_count`` moved
    as far as ``last_epoch`` from the saved state, and the saved last LR."""
    state = {**fresh, "last_epoch": count, "_last_lr": saved.get("_last_lr", fresh.get("_last_lr"))}
    if "_step_count" in saved:
        state["_step_count"] = saved["_step_count"] + count - saved["last_epoch"]
    if "T_cur" in fresh:  # CosineAnnealingWarmRestarts: its place in this run's cycles
        state["T_cur"], state["T_i"] = _cycle(fresh["T_0"], fresh["T_mult"], count)
    return state


def _cycle(t_0: int, t_mult: int, count: int) -> tuple[int, int]:
    """CosineAnnealingWarmRestarts' ``(T_cur, T_i)`` after ``count`` steps (torch's formula of
    ``step(epoch)`` in integers): the cycles are ``t_0``, ``t_0 * t_mult``, ... steps long."""
    if t_mult == 1:
        return count % t_0, t_0
    t_cur, t_i = count, t_0
    while t_cur >= t_i:
        t_cur, t_i = t_cur - t_i, t_i * t_mult
    return t_cur, t_i


# -- automatic checkpoint naming ------------------------------------------------------------

def _numbered(root: Path) -> list[Path]:
    """``checkpoint_<n>`` directories under ``root``, oldest first (Accelerate's naming)."""
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
             if (m := re.fullmatch(ACCELERATE_NAMING, p.name)) and p.is_dir()]
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
