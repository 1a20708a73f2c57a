"""Atomic, per-stage training checkpoints for :class:`~hapt_hf.integration.trainer.HaptTrainer`.

The checkpoint directories of a training run, as ``Trainer`` saves and resumes them; the
tensor files inside are read and written by :mod:`hapt_hf.pipeline.checkpoint_io`.

A checkpoint directory ``checkpoint-N`` holds:

* ``config.json`` and the weights, a standard Hugging Face checkpoint (``from_pretrained``
  loads it; a tied LM head is stored once): each stage writes its own
  ``model-0000k-of-0000n.safetensors`` and rank 0 the index (``model.safetensors`` for one
  stage), no rank holding the whole model (:mod:`hapt_hf.pipeline.export`);
* ``hapt_rank{r}.pt``: rank r's optimizer and LR-scheduler state, RNG states and, with fp16's
  dynamic loss scaling, the loss scaler's state (each stage's optimizer state stays with the
  stage that owns the parameters; on a stage whose plan shards it, each replica's file holds
  its own shard, see :class:`~hapt_hf.pipeline.zero.ShardedOptimizer`; the scale is the same
  on every rank);
* ``plan.json``, ``trainer_state.json``, ``training_args.bin``;
* ``portable/`` and ``hapt_portable.pt``: the part any plan resumes from. Every rank's model
  and optimizer tensors keyed by parameter name, written with ``torch.distributed.checkpoint``
  (:mod:`hapt_hf.pipeline.portable`), and rank 0's LR scheduler state, optimizer
  hyperparameters, RNG states and loss scale beside them. With a node-local directory
  (``checkpoint_local_dir``), each rank writes its tensors to its node's disk and a background
  copy fills ``portable/`` after the commit (:mod:`hapt_hf.pipeline.checkpoint_store`; DCP's
  ``.metadata`` and the ``.complete`` marker come last).

Atomicity: every rank writes into ``.tmp-checkpoint-N`` and fsyncs its files; after a barrier
rank 0 renames the directory to ``checkpoint-N`` and fsyncs the parent. A rename is atomic, and
only names matching ``checkpoint-N`` are ever resumed from, so a crash mid-save leaves at most a
``.tmp-`` directory, which the next save removes. On resume under the same plan each rank
reads only its own tensors from the weights files (the stage's layer range) and its own
``hapt_rank{r}.pt``; under another plan (other ranks, stages, replicas or optimizer settings;
the same global batch, sequence length, layers and precision) each reads its stage's tensors
and its optimizer's state by name from ``portable/`` (:func:`load_checkpoint`).
This assumes the output directory is one filesystem every rank sees (one machine, or a shared
mount across machines).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hapt_hf.integration.config import RETRY_KEYS
from hapt_hf.pipeline import checkpoint_io, portable
from hapt_hf.pipeline.checkpoint_io import CheckpointError, damaged_file
from hapt_hf.pipeline.checkpoint_store import COMPLETE_MARKER, CheckpointStore, Upload, copy_unfinished
from hapt_hf.pipeline.export import has_weights
from hapt_hf.pipeline.zero import SHARD_KEY, ShardedOptimizer, load_portable_state, portable_state
from hapt_hf.planner.plan import Plan, PlanError

__all__ = ["CheckpointError", "rank_state_file", "begin_model_save", "finish_model_save",
           "rng_state", "set_rng_state", "begin_checkpoint", "commit_checkpoint",
           "save_rank_state", "load_rank_state", "save_hf_model", "load_stage_weights",
           "load_trainer_state", "resolve_resume", "load_checkpoint", "check_resumable", "check_optimizer_states",
           "check_same_run", "check_portable", "PORTABLE_DIR",
           "placements", "describe_placements",
           "barrier", "fsync_path", "fsync_tree", "save_portable_state", "same_placement",
           "portable_store", "prune_local_copies"]

RANK_STATE = "hapt_rank{rank}.pt"
PORTABLE_DIR = "portable"
"""The subdirectory of the checkpoint any plan resumes from (:mod:`hapt_hf.pipeline.portable`)."""
PORTABLE_STATE = "hapt_portable.pt"
"""Beside it (rank 0's): LR scheduler, optimizer hyperparameters, RNG and loss scale."""
TRAINER_STATE = "trainer_state.json"
TMP_PREFIX = ".tmp-"




def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_state_file(ckpt: Path, rank: int) -> Path:
    return Path(ckpt) / RANK_STATE.format(rank=rank)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file (made readable as save_pretrained's would be) and the directory."""
    umask = os.umask(0)
    os.umask(umask)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)  # temp-file writers leave 0600
            fsync_path(path)
    fsync_path(root)


def begin_model_save(out: Path) -> Path:
    """An empty temporary directory inside ``out`` to write a model into (rank 0)."""
    tmp = out / f"{TMP_PREFIX}save"
    out.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a crashed save
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_model_save(tmp: Path, out: Path) -> None:
    """Move what :func:`begin_model_save`'s directory holds into ``out`` file by file with
    ``os.replace`` (rank 0), so a crash never leaves a truncated model.safetensors."""
    fsync_tree(tmp)
    for path in sorted(tmp.iterdir()):
        os.replace(path, out / path.name)
    tmp.rmdir()
    fsync_path(out)


def begin_checkpoint(run_dir: Path, name: str, rank: int) -> Path:
    """The temporary directory every rank writes into (made empty by rank 0)."""
    tmp = Path(run_dir) / f"{TMP_PREFIX}{name}"
    if rank == 0:
        for stale in Path(run_dir).glob(f"{TMP_PREFIX}checkpoint-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def commit_checkpoint(tmp: Path, final: Path, rank: int) -> None:
    """Make the checkpoint visible under its final name, all files on disk first."""
    barrier()  # every rank has written and fsynced its own files
    if rank == 0:
        fsync_tree(tmp)
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(final.parent)
    barrier()


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) random states, as a checkpoint keeps them."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (CUDA's where it was saved and CUDA is here)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rank_state(tmp: Path, rank: int, optimizer, scheduler, loss_scaler=None) -> None:
    path = rank_state_file(tmp, rank)
    torch.save({"optimizer": portable_state(optimizer),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(),
                "loss_scale": loss_scaler.state_dict() if loss_scaler is not None else None},
               path)
    fsync_path(path)


def portable_store(local_dir: Path, run_dir: Path,
                   retries: dict[str, float] | None = None) -> CheckpointStore:
    """Checkpoints' portable parts on this node's ``local_dir`` (``checkpoint-N/portable``),
    their copy in the run's output directory (the same path inside each checkpoint); the copy
    and the reads retry as ``retries`` says (the hapt config's ``checkpoint_retries``; None:
    the store's defaults)."""
    settings = {RETRY_KEYS[k]: v for k, v in (retries or {}).items()}
    return CheckpointStore(Path(local_dir), str(Path(run_dir).resolve()), **settings)


def save_portable_state(tmp: Path, runtime, optimizer, scheduler,
                        local_dir: Path | None = None,
                        retries: dict[str, float] | None = None) -> Upload | None:
    """The part of the checkpoint any plan resumes from (collective): every rank's model and
    optimizer tensors under their parameter names (``portable/``), and on rank 0 what is not a
    parameter's tensor (``hapt_portable.pt``). The step and the data position are the trainer
    state's ``global_step``. With ``local_dir``, the tensors go to this node's
    ``local_dir/checkpoint-N/portable``; the returned copy into the checkpoint's ``portable/``
    is to be started once the checkpoint is committed (``Upload.start``) and waited on before
    the next save; its ``.complete`` marker (written last) says the copy is whole."""
    upload = None
    if local_dir is None:
        portable.save_portable(Path(tmp) / PORTABLE_DIR, runtime.stage, optimizer)
    else:
        name = f"{Path(tmp).name[len(TMP_PREFIX):]}/{PORTABLE_DIR}"
        upload = portable_store(local_dir, Path(tmp).parent, retries).save(
            name, portable.portable_state_dict(runtime.stage, optimizer), start=False)
    if runtime.rank == 0:
        path = Path(tmp) / PORTABLE_STATE
        scaler = runtime.loss_scaler
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "groups": portable.group_settings(optimizer), "rng": rng_state(),
                    "loss_scale": scaler.state_dict() if scaler is not None else None}, path)
        fsync_path(path)
    return upload


def prune_local_copies(local_dir: Path, run_dir: Path) -> None:
    """Remove this node's copies of checkpoints the output directory no longer holds (rotated
    away by ``save_total_limit``)."""
    for copy in Path(local_dir).glob("checkpoint-*"):
        if not (Path(run_dir) / copy.name).is_dir():
            shutil.rmtree(copy, ignore_errors=True)


def _load_portable_rest(ckpt: Path, optimizer, scheduler, loss_scaler) -> None:
    """What :func:`save_portable_state` wrote beside the tensors, on any rank."""
    path = Path(ckpt) / PORTABLE_STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file
        parts = state["groups"], state["scheduler"], state["rng"], state["loss_scale"]
    except Exception as e:  # noqa: BLE001 - one message naming the file
        raise damaged_file(path, e) from None
    if scheduler is not None and parts[1] is not None:
        scheduler.load_state_dict(parts[1])
    portable.apply_group_settings(optimizer, parts[0])
    if loss_scaler is not None and parts[3] is not None:
        loss_scaler.load_state_dict(parts[3])
    set_rng_state(parts[2])


def load_rank_state(ckpt: Path, rank: int, optimizer, scheduler, loss_scaler=None) -> None:
    path = rank_state_file(ckpt, rank)
    try:
        # Our own file, written by save_rank_state: it holds Python RNG tuples, hence
        # weights_only=False. A damaged pickle or zip raises almost anything.
        state = torch.load(path, map_location="cpu", weights_only=False)
        parts = state["optimizer"], state["scheduler"], state["rng"]
        if loss_scaler is not None:  # a loss-scaling run's checkpoint (same plan: checked)
            loss_scaler.load_state_dict(state["loss_scale"])
    except Exception as e:  # noqa: BLE001 - one message naming the file
        raise damaged_file(path, e) from None
    if SHARD_KEY in parts[0] and not isinstance(optimizer, ShardedOptimizer):
        # a plain optimizer would take a shard silently, holding the state of a few parameters
        raise CheckpointError(f"{str(path)!r} holds one shard of a sharded optimizer state "
                              f"(optimizer: sharded) but this rank's optimizer is a "
                              f"{type(optimizer).__name__} holding the whole state; resume "
                              "with the plan the checkpoint was written under")
    try:
        load_portable_state(optimizer, parts[0])
    except ValueError as e:  # refusing another plan's state (a shard, a TP shard) names it
        raise CheckpointError(f"{str(path)!r}: {e}") from None
    if scheduler is not None and parts[1] is not None:
        scheduler.load_state_dict(parts[1])
    set_rng_state(parts[2])


def load_trainer_state(ckpt: Path):
    """The checkpoint's ``TrainerState``, a damaged ``trainer_state.json`` named."""
    from transformers import TrainerState

    path = Path(ckpt) / TRAINER_STATE
    try:
        return TrainerState.load_from_json(str(path))
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise damaged_file(path, e) from None


def resolve_resume(resume: str | bool | None, output_dir: str) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names: None, a path, or (True) the last
    ``checkpoint-N`` of ``output_dir``."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume is None or resume is False:
        return None
    if resume is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise CheckpointError(f"resume_from_checkpoint=True but {output_dir!r} holds no "
                                  "checkpoint-N directory")
        return Path(last)
    return Path(resume)


def same_placement(ckpt: Path, plan: Plan) -> bool:
    """Whether ``ckpt`` was written under ``plan``'s stages, replicas and optimizer settings
    (its own files resume it bit for bit), or holds no portable part to resume another plan
    from (then :func:`check_resumable` names what differs)."""
    ckpt = Path(ckpt)
    if not portable.is_portable(ckpt / PORTABLE_DIR) or not (ckpt / "plan.json").is_file():
        return True
    try:
        saved = Plan.load(ckpt / "plan.json")
    except PlanError as e:
        raise damaged_file(ckpt / "plan.json", e) from None
    return (placements(saved) == placements(plan)
            and [s.optimizer for s in saved.stages] == [s.optimizer for s in plan.stages])


def check_same_run(saved: Plan, plan: Plan, what_ckpt: str, batch_fix: str) -> None:
    """Refuse state saved under ``saved`` for a run on ``plan`` that would differ: another
    number of layers, global batch, sequence length or precision (a tensor of another name or
    shape is named when it is read). ``batch_fix``: how this run's global batch is set."""
    for what, old, new, fix in (
            ("layers", saved.num_layers, plan.num_layers, "resume with the model it was written for"),
            ("global batch", saved.global_batch_size, plan.global_batch_size, batch_fix),
            ("sequence length", saved.seq_len, plan.seq_len, "resume with the same sequence length"),
            ("precision", saved.precision.describe(), plan.precision.describe(),
             "resume with the checkpoint's precision")):
        if old != new:
            raise CheckpointError(f"{what_ckpt} was written with {what} {old}, this "
                                  f"run's plan has {new}; a checkpoint resumes on another plan "
                                  f"only for the same run: {fix}")


def check_portable(ckpt: Path, plan: Plan) -> None:
    """Refuse resuming ``ckpt`` under another plan where the run it continues would differ
    (:func:`check_same_run`)."""
    check_same_run(Plan.load(Path(ckpt) / "plan.json"), plan, f"checkpoint {str(ckpt)!r}",
                   "set per_device_train_batch_size x gradient_accumulation_steps x processes to it")
    missing = [n for n in (TRAINER_STATE, PORTABLE_STATE) if not (Path(ckpt) / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {missing}; it is damaged")


def load_checkpoint(ckpt: Path, runtime, optimizer, scheduler, local_dir: Path | None = None,
                    retries: dict[str, float] | None = None):
    """Resume every rank from ``ckpt``; returns the checkpoint's ``TrainerState``.

    Under the plan it was written under, each rank reads its own part (stage tensors, its
    ``hapt_rank{r}.pt``): bit for bit. Under another plan (other ranks, stages, replicas or
    optimizer settings), each rank reads its stage's tensors and its optimizer's state by
    parameter name from the portable part. The ranks agree on the checks' outcome
    (``FailureChannel.agree``), so a file that is damaged or missing on any rank ends every
    rank with the same CheckpointError naming it, before training writes anything. With
    ``local_dir`` and a portable part its background copy completed, each rank reads the files
    of that part this node's ``local_dir`` holds and fetches only the rest.
    """
    if Path(ckpt).is_dir() and not same_placement(ckpt, runtime.plan):
        def check():
            check_portable(ckpt, runtime.plan)
            reader = None
            if local_dir is not None and (Path(ckpt) / PORTABLE_DIR / COMPLETE_MARKER).is_file():
                reader = portable_store(local_dir, Path(ckpt).parent, retries).reader(
                    f"{Path(ckpt).name}/{PORTABLE_DIR}")
            reads = portable.prepare_load(Path(ckpt) / PORTABLE_DIR, runtime.stage, optimizer,
                                          reader)
            return load_trainer_state(ckpt), reads
        state, reads = runtime.channel.agree("checking the checkpoint", runtime.stage_plan.index,
                                             check, refusals=(CheckpointError,))

        def rest():
            _load_portable_rest(ckpt, optimizer, scheduler, runtime.loss_scaler)
        reads.read()  # collective: every rank has passed the checks
        runtime.channel.agree("loading the checkpoint", runtime.stage_plan.index, rest,
                              refusals=(CheckpointError,))
        return state

    def load():
        check_resumable(ckpt, runtime.plan, runtime.plan.world_size)
        state = load_trainer_state(ckpt)
        load_stage_weights(runtime.stage, ckpt)
        load_rank_state(ckpt, runtime.rank, optimizer, scheduler, runtime.loss_scaler)
        return state
    return runtime.channel.agree("loading the checkpoint", runtime.stage_plan.index, load,
                                 refusals=(CheckpointError,))


def save_hf_model(runtime, full: dict, out_dir: Path) -> None:
    """Write config.json + model.safetensors of the full state dict ``full`` into ``out_dir``
    (rank 0); a tied output embedding is written once, as ``from_pretrained`` expects."""
    config = runtime.stage.config
    tied = [runtime.stage.adapter.output_embedding_key] \
        if getattr(config, "tie_word_embeddings", False) else []
    checkpoint_io.save_full_checkpoint(full, config, out_dir, tied_keys=tied)


def load_stage_weights(stage: torch.nn.Module, ckpt: Path) -> None:
    """Copy this stage's own tensors from the checkpoint's model.safetensors into the stage."""
    checkpoint_io.load_stage_tensors(stage, ckpt)


def placements(plan: Plan) -> list[tuple[tuple[int, int], tuple[tuple[int, ...], ...]]]:
    """What a rank's saved state depends on: each stage's layers and the ranks of each of its
    replicas (a tensor-parallel replica's ranks each hold one shard, in that order)."""
    return [(s.layers, tuple(r.ranks for r in s.replicas)) for s in plan.stages]


def describe_placements(plan: Plan) -> str:
    """The stages' layers and replicas' ranks, as a message names them."""
    return ", ".join(f"layers {list(s.layers)} on {[list(r.ranks) for r in s.replicas]}"
                     for s in plan.stages)


def check_optimizer_states(saved: Plan, plan: Plan, what: str) -> None:
    """Refuse state saved with the stages' optimizer state kept otherwise (replicated or
    sharded) than this run's plan keeps it: a shard is not a whole state, nor the reverse."""
    saved_opt, opt = [s.optimizer for s in saved.stages], [s.optimizer for s in plan.stages]
    if saved_opt != opt:
        raise CheckpointError(f"{what} was written with the stages' optimizer state {saved_opt}"
                              f", this run's plan keeps it {opt}; resume with the plan it was "
                              "written under (its plan.json as 'plan' in the hapt config)")


def check_resumable(ckpt: Path, plan: Plan, world_size: int) -> None:
    """Refuse a checkpoint that is incomplete or was written under another plan."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"resume_from_checkpoint {str(ckpt)!r} is not a directory")
    needed = ["trainer_state.json", "plan.json"]
    needed += [RANK_STATE.format(rank=r) for r in range(world_size)]
    missing = [n for n in needed if not (ckpt / n).is_file()]
    if not has_weights(ckpt):
        missing.insert(2, "the model's weights (model.safetensors or its index)")
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {missing}; it was not written "
                              f"by a {world_size}-rank HaptTrainer run (or is damaged)")
    try:
        saved = Plan.load(ckpt / "plan.json")
    except PlanError as e:
        raise damaged_file(ckpt / "plan.json", e) from None
    if placements(saved) != placements(plan):
        why = ("; its portable part, which another plan reads, was still being copied from the "
               "nodes' checkpoint_local_dir when the run stopped: resume from an earlier "
               "checkpoint, or ") if copy_unfinished(ckpt / PORTABLE_DIR) else "; "
        raise CheckpointError(f"checkpoint {str(ckpt)!r} was written under another plan (stages "
                              f"{describe_placements(saved)}) than this run's "
                              f"({describe_placements(plan)}){why}resume with the same plan (pass "
                              "the checkpoint's plan.json as 'plan' in the hapt config)")
    check_optimizer_states(saved, plan, f"checkpoint {str(ckpt)!r}")
    if saved.precision.to_dict() != plan.precision.to_dict():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} was written training in "
                              f"{saved.precision.describe()}, this run trains in "
                              f"{plan.precision.describe()}; resume with the checkpoint's "
                              "precision (its plan.json as 'plan' in the hapt config)")
