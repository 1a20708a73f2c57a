"""The launch path: the one place that reads what ``accelerate launch`` / ``torchrun`` set.

``accelerate launch`` on a CPU-only machine has traps: a ``MULTI_CPU`` config without
``mpirun`` starts ONE process (it sets MASTER_ADDR/MASTER_PORT but no RANK/WORLD_SIZE), so a
script that trusted ``torch.distributed`` defaults would train alone and think it was done.
:func:`read_launch_env` refuses that case with the fix; the shipped
``recipes/configs/accelerate_cpu.yaml`` uses ``distributed_type: MULTI_GPU`` with
``use_cpu: true``, which makes accelerate start N processes through torchrun, on CPUs.

The plan every rank then runs is resolved in :mod:`~hapt_hf.integration.plan_resolution`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

from hapt_hf.core.defaults import DEFAULT_TIMEOUT_S
from hapt_hf.errors import LaunchError
from hapt_hf.integration.elastic import check_restartable, read_elastic_env
from hapt_hf.pipeline.process_group import init_distributed

__all__ = ["LaunchError", "LaunchEnv", "read_launch_env", "init_process_group"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str
    """'torchrun' (accelerate's multi-process path), 'mpirun', or 'single'."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank and world size from the variables torchrun or mpirun set; refuse half-launches."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        local = _int(env, "LOCAL_RANK") or 0
        return LaunchEnv(rank, world, local, "torchrun")
    mpi_rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    mpi_world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if mpi_rank is not None and mpi_world is not None:
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0
        return LaunchEnv(mpi_rank, mpi_world, local, "mpirun")
    if env.get("MASTER_ADDR") and env.get("ACCELERATE_MIXED_PRECISION") is not None:
        # accelerate's simple launcher sets MASTER_ADDR only when asked for >1 process, then
        # starts exactly one: the MULTI_CPU-without-mpirun path.
        raise LaunchError(
            "accelerate started a single process for a multi-process run (a MULTI_CPU config "
            "without mpirun does that): no RANK/WORLD_SIZE reached this process. Use "
            "recipes/configs/accelerate_cpu.yaml (distributed_type: MULTI_GPU, use_cpu: true), "
            "which starts every rank through torchrun, or launch with torchrun --nproc_per_node N")
    return LaunchEnv(0, 1, 0, "single")


def init_process_group(launch: LaunchEnv, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the job's process group (Gloo on CPU, NCCL on GPUs) unless already joined: the
    pipeline's one set-up (:func:`~hapt_hf.pipeline.process_group.init_distributed`), after an
    ``mpirun`` launch has been given the variables torchrun sets."""
    if dist.is_initialized():
        return
    check_restartable(read_elastic_env())
    if launch.launcher == "mpirun" and launch.world_size > 1:
        # env:// reads these names; mpirun sets its own.
        os.environ.setdefault("RANK", str(launch.rank))
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    init_distributed(timeout_s, single_process=launch.world_size == 1)
