"""The process groups of a hapt_hf job: set up once, from what the launcher set, and ended.

:func:`init_distributed` is the one set-up of the default process group: the runtime's users,
the recipes (through :func:`hapt_hf.integration.launch.init_process_group`, which first makes an
``mpirun`` launch look like torchrun's), the benchmarks and the multi-process test helper
(``run_ranks`` in the checkout's ``benchmarks/ranks.py``) all call it. Gloo on CPU, NCCL on
CUDA (each rank on the GPU ``LOCAL_RANK`` names); its timeout, ``DEFAULT_TIMEOUT_S`` unless
given, bounds every collective. :func:`stage_groups` makes the subgroups the runtime shards a replica over
(tensor parallelism) and sums gradients in;
:func:`transfer_groups` the ones its activations and gradients cross stage boundaries in. Setting up registers
:func:`~hapt_hf.pipeline.exit_guard.end_distributed_workers` to run at exit, so that a process
that used any of them ends cleanly however it ends.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hapt_hf.core.defaults import DEFAULT_TIMEOUT_S
from hapt_hf.pipeline import exit_guard
from hapt_hf.pipeline.placement import RankWork
from hapt_hf.pipeline.runtime_types import RuntimeSetupError
from hapt_hf.planner.plan import Plan

__all__ = ["init_distributed", "world_size", "StageGroups", "stage_groups", "transfer_groups",
           "local_device"]

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` / ``accelerate launch`` set and the ``env://`` rendezvous reads."""


def local_device() -> str:
    """This rank's device: ``cuda:LOCAL_RANK`` if CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def world_size() -> int:
    """Processes in the job: the process group's size, 1 where none was started."""
    return dist.get_world_size() if dist.is_initialized() else 1


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, *, backend: str | None = None,
                     single_process: bool = False) -> tuple[int, int]:
    """Set up the default process group from the environment torchrun/accelerate set.

    Gloo on CPU, NCCL on CUDA (``backend`` overrides: the CPU tests and benchmarks ask for
    Gloo on any machine). ``single_process``: a one-rank job started without a launcher, a
    group of one over an in-memory store. Returns (rank, world_size); a no-op if already
    initialised.
    """
    exit_guard.install()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    if single_process:
        # a one-rank plan run as `python recipe.py`: the runtime still talks through a group
        dist.init_process_group(backend or "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return 0, 1
    missing = [k for k in LAUNCH_VARIABLES if k not in os.environ]
    if missing:
        raise RuntimeSetupError(f"environment variable(s) {missing} are not set; start the "
                                "script with `torchrun` or `accelerate launch`, which set them")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True)
class StageGroups:
    """The process groups one rank sums gradients (and shards) in; None where it has none."""

    tp: Any
    """Its replica's ranks (tensor parallelism; None for a replica of one rank)."""
    dp: Any
    """The ranks at its tensor-parallel position in every replica of its stage: they hold the
    same shard and sum its gradients (None for a stage of one replica)."""
    tied: Any
    """The first and the last stage's ranks (tied embeddings on different stages), or None."""


def stage_groups(plan: Plan, rank: int, tied_ranks: Sequence[int],
                 tied_embeddings: bool) -> StageGroups:
    """This rank's tensor-parallel, data-parallel and tied-embedding groups.

    ``new_group`` is collective over the default group: every rank creates every group, in the
    same order (stage by stage: each replica's group, then each tensor-parallel position's
    group across the replicas; the tied group last), and keeps the ones it belongs to. The
    stages of an interleaved rank share their replicas, and so these groups. The tied
    group (the first and the last stage's ranks) exists when the model ties its embeddings and
    they sit on different stages.
    """
    tp = dp = None
    seen: set[tuple] = set()
    for st in plan.stages:
        if st.replicas in seen:  # an interleaved rank's later stages: the same replicas
            continue
        seen.add(st.replicas)
        if st.tp > 1:
            for rep in st.replicas:
                g = dist.new_group(list(rep.ranks))
                if rank in rep.ranks:
                    tp = g
        if st.width > 1:
            for j in range(st.tp):
                ranks = [rep.ranks[j] for rep in st.replicas]
                g = dist.new_group(ranks)
                if rank in ranks:
                    dp = g
    tied = None
    if tied_embeddings and plan.num_stages > 1:
        g = dist.new_group(list(tied_ranks))
        if rank in tied_ranks:
            tied = g
    return StageGroups(tp, dp, tied)


def transfer_groups(plan: Plan, works: Sequence[RankWork],
                    device: torch.device) -> dict[tuple[int, bool], Any]:
    """The groups this rank's transfers go over, their communicators made: one per stage
    boundary and direction, ``(b, True)`` for the activations from stage ``b`` to ``b + 1``,
    ``(b, False)`` for the gradients back.

    NCCL matches a pair's transfers in posting order and runs a communicator's transfers in
    order on one stream, so a receive at its head holds up whatever is behind it. On a group of
    its own, each direction of each boundary carries transfers one way, in micro-batch order on
    both sides: the schedules' lists then finish on NCCL, whether torch makes a communicator
    per pair (its default) or one per group (a default group bound to a device). On one group
    for every transfer, 1F1B's lists hang (`benchmarks/stream_order.py` replays both).
    Every rank creates every group, in the same order (``new_group`` is collective); then
    :func:`_open_pairs` makes the communicators."""
    mine: dict[tuple[int, bool], Any] = {}
    me = works[0].rank
    for b in range(plan.num_stages - 1):
        ranks = sorted(set(plan.stages[b].ranks) | set(plan.stages[b + 1].ranks))
        for forward in (True, False):
            g = dist.new_group(ranks)
            if me in ranks:
                mine[(b, forward)] = g
    _open_pairs(works, mine, device)
    return mine


def _open_pairs(works: Sequence[RankWork], groups: dict[tuple[int, bool], Any],
                device: torch.device) -> None:
    """Send one element over every pair of ranks and direction the lists will use, in one
    order all ranks share (boundary, direction, sender, receiver).

    NCCL makes a pair's communicator on its first transfer, and making it blocks both hosts
    until both get there: left to the lists, a stage that posts its first gradient receive
    before sending on (GPipe's lists, 1F1B's with one micro-batch) would wait for a gradient
    that needs that send. Made here, in one global order, no rank waits for one that waits
    for it."""
    events = []  # (order, send?, peer, group key); the two directions may pair other ranks
    for work in works:
        s, me = work.stage.index, work.rank
        events += [((s - 1, 0, p.peer, me), False, p.peer, (s - 1, True)) for p in work.upstream]
        events += [((s - 1, 1, me, p.peer), True, p.peer, (s - 1, False))
                   for p in work.upstream_grads]
        events += [((s, 0, me, p.peer), True, p.peer, (s, True)) for p in work.downstream]
        events += [((s, 1, p.peer, me), False, p.peer, (s, False))
                   for p in work.downstream_grads]
    one = torch.zeros(1, device=device)
    for _, send, peer, key in sorted(events):
        (dist.send if send else dist.recv)(one, peer, group=groups[key])
