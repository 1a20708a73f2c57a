"""Elastic runs under torchrun's elastic agent: the GPUs present, re-planned on, and the
checkpoint a restarted run resumes from, with no hand step.

When a node is lost (or comes back) the agent stops every worker, holds a new rendezvous among
the nodes left and starts the workers again, numbered anew. Each start of a HaptTrainer run then:

1. **Maps the world to the cluster file's groups.** Every node says which group of the cluster
   file it is with the ``HAPT_GROUP`` environment variable, set per node (per agent), or by its
   hostname, which the cluster file's ``hosts:`` patterns map to a group
   (:func:`resolve_groups`; ``HAPT_GROUP`` wins); every rank sends its place to every other
   (:func:`gather_places`), and rank 0 plans on :func:`present_cluster`:
   the cluster file's groups shrunk to the GPUs present, listed in the order of the ranks, so
   that the planner's numbering (group by group, in file order) is the launcher's. Where no node
   sets ``HAPT_GROUP`` and the file maps no hosts, it is taken as it is, as on any launch.
2. **Keeps the run's global batch** (:func:`keep_global_batch`): the hapt config's
   ``global_batch_size`` or, on a restart, the one the run was planned with; Trainer's
   ``gradient_accumulation_steps`` (else ``per_device_train_batch_size``) is set so that
   per-device batch x accumulation x processes gives it, and the rows of every step are the
   same rows in the same order.
3. **Resumes from the latest complete checkpoint** the run wrote in the output directory
   (:func:`resume_point`): a ``checkpoint-N`` directory exists only once every rank has written
   and synced its part (trainer_checkpoint commits it by a rename), and its portable part
   resumes on any plan; those an earlier run left there are noted at the first start and
   never resumed. Rank 0 says ``restart N: world W (groups ...), re-planned, resuming from
   checkpoint-S``.

A start is a restart where ``TORCHELASTIC_RESTART_COUNT`` (the agent's count of failures) is
above 0, or where the output directory's ``hapt_elastic.json`` names this run's rendezvous id
(``--rdzv-id``; a node joining, or coming back, restarts the workers without counting a
failure, and a node started again has a fresh agent that counted none). A restartable launch
without a run id is refused (:func:`check_restartable`).

A HaptAccelerator loop resumes the same way by calling
:meth:`~hapt_hf.integration.accelerate_plugin.HaptAccelerator.resume_if_restarted` after
``prepare``: the newest complete ``checkpoint_<n>`` state (Accelerate's naming) this run saved.
"""
from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from hapt_hf.errors import ConfigError, LaunchError, TrainingArgsError
from hapt_hf.planner.cluster import Cluster, GpuGroup, GroupLink

__all__ = ["GROUP_ENV", "HOST_ENV", "RUN_FILE", "ElasticEnv", "read_elastic_env", "restartable",
           "check_restartable",
           "Place", "this_place", "gather_places", "resolve_groups", "present_cluster",
           "describe_places", "missing_gpus",
           "run_global_batch", "keep_global_batch",
           "plan_groups", "TRAINER_NAMING", "ACCELERATE_NAMING", "latest_checkpoint", "resume_point"]

GROUP_ENV = "HAPT_GROUP"
"""Set on each node (in the environment of its ``torchrun``): the cluster file group it is."""
HOST_ENV = "HAPT_HOSTNAME"
"""Where set, the hostname a node's ``hosts:`` patterns are matched against (else its own)."""
RUN_FILE = "hapt_elastic.json"
"""In the output directory: the run's rendezvous id and how many times it started."""
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
UNNAMED_RUN = "none"  # torchrun's run id where --rdzv-id is not given
TRAINER_NAMING = r"checkpoint-(\d+)"
"""HaptTrainer's checkpoint directories (Trainer's naming)."""
ACCELERATE_NAMING = r"checkpoint_(\d+)"
"""HaptAccelerator's ``save_state`` directories (Accelerate's automatic naming)."""


@dataclass(frozen=True)
class ElasticEnv:
    """What torchrun's elastic agent tells its workers."""

    run_id: str
    restart_count: int
    """The agent's failures so far (0 on the first start; a node joining does not count)."""
    max_restarts: int
    agent_store: bool
    """The workers share the agent's store (torch's default with the c10d rendezvous)."""


def read_elastic_env(env: Mapping[str, str] | None = None) -> ElasticEnv | None:
    """The elastic agent's variables, or None where the process was not started by one."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return ElasticEnv(env["TORCHELASTIC_RUN_ID"], int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
                      int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0),
                      env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def restartable() -> bool:
    """Whether torchrun's agent may restart this process's workers (``--max-restarts`` > 0)."""
    elastic = read_elastic_env()
    return elastic is not None and elastic.max_restarts > 0


def check_restartable(elastic: ElasticEnv | None) -> None:
    """Refuse restarts the workers could not survive or resume. With the agent's store shared
    (torch's default), the store outlives a restart with the previous workers' keys in it, and
    a restarted worker connects to the addresses of workers that are gone (Gloo's
    ``connectFullMesh`` is refused; NCCL reads a stale unique id: pytorch/pytorch#135712).
    Without a run id (``--rdzv-id``; ``accelerate launch`` passes none), a restart because a
    node joined counts no failure and cannot be told from a new run: it would start at step 0."""
    if elastic is None or elastic.max_restarts == 0:
        return
    if elastic.run_id == UNNAMED_RUN:
        raise LaunchError(f"torchrun was given --max-restarts {elastic.max_restarts} but no "
                          "--rdzv-id: a restart because a node joined or came back counts no "
                          "failure, and without the run's id it cannot be told from a new run "
                          "(it would start again from step 0); give every run its own id: "
                          "torchrun --rdzv-id <run>, or PET_RDZV_ID=<run> in the environment of "
                          "accelerate launch, which passes torchrun none (docs/usage.md, Elastic "
                          "runs)")
    if not elastic.agent_store:
        return
    raise LaunchError(f"torchrun was given --max-restarts {elastic.max_restarts} but its workers "
                      "share the agent's store, which keeps the previous workers' addresses "
                      "across a restart (a restarted job cannot connect); launch with "
                      f"--rdzv-backend c10d and {SHARED_STORE_ENV}=1 in torchrun's environment "
                      "(docs/usage.md, Elastic runs)")


# -- the world present -------------------------------------------------------------------------
@dataclass(frozen=True)
class Place:
    """Where one rank runs: the group its node says it is (None: not said), its node, and its
    node's hostname."""

    group: str | None
    node: str
    host: str = ""


def this_place(env: Mapping[str, str] | None = None) -> Place:
    env = os.environ if env is None else env
    host = env.get(HOST_ENV) or socket.gethostname()
    return Place(env.get(GROUP_ENV) or None, f"{host}/{env.get('GROUP_RANK', '0')}", host)


def resolve_groups(cluster: Cluster, places: Sequence[Place]) -> list[Place]:
    """Each place whose node did not set ``HAPT_GROUP`` given the group its hostname is, by
    the cluster file's ``hosts:`` patterns (:meth:`Cluster.group_of_host`: a host of no group,
    or of two, is refused naming it); unchanged where the file maps no hosts."""
    return [p if p.group is not None else Place(cluster.group_of_host(p.host), p.node, p.host)
            for p in places]


def gather_places(world_size: int) -> list[Place] | None:
    """Every rank's :class:`Place`, on every rank (collective); None without a process group
    (a caller that plans without one), or for one process that no elastic agent started (one
    the agent restarted alone after losing nodes has its own place)."""
    import torch.distributed as dist

    if world_size == 1:
        return [this_place()] if read_elastic_env() is not None else None
    if not dist.is_initialized():
        return None
    places: list[Any] = [None] * world_size
    dist.all_gather_object(places, this_place())
    return places


def _runs(places: Sequence[Place]) -> list[tuple[str, list[Place]]]:
    """The ranks cut where the group changes: (group, its consecutive ranks' places)."""
    runs: list[tuple[str, list[Place]]] = []
    for p in places:
        if runs and runs[-1][0] == p.group:
            runs[-1][1].append(p)
        else:
            runs.append((str(p.group), [p]))
    return runs


def _checked(cluster: Cluster, places: Sequence[Place]) -> None:
    names = cluster.group_names
    unset = [r for r, p in enumerate(places) if p.group is None]
    if unset:
        raise ConfigError(f"rank(s) {unset} do not say which group of cluster {cluster.name!r} "
                          f"they are while others do; set {GROUP_ENV}=<group> (one of "
                          f"{', '.join(names)}) in the environment of every node's torchrun, "
                          "or list the nodes' hostnames under their groups' hosts: in the "
                          "cluster file")
    for group in dict.fromkeys(p.group for p in places):
        ranks = [r for r, p in enumerate(places) if p.group == group]
        if group not in names:
            raise ConfigError(f"rank(s) {ranks} say {GROUP_ENV}={group!r}, which is no group of "
                              f"cluster {cluster.name!r}; use one of {', '.join(names)}")
        size = cluster.group(str(group)).size
        if len(ranks) > size:
            raise ConfigError(f"{len(ranks)} ranks say {GROUP_ENV}={group!r} but cluster "
                              f"{cluster.name!r} gives group {group!r} {size} GPU(s); fix the "
                              "variable on the nodes that are not of that group, or the group's "
                              "nodes / gpus_per_node")


def _run_group(name: str, original: GpuGroup, places: list[Place]) -> GpuGroup:
    """One run of ranks as a group: node by node where every node holds as many of them, else
    one node of them all, its links the slower inter-node ones if they span nodes."""
    per_node = list(dict.fromkeys(p.node for p in places))
    counts = {n: sum(p.node == n for p in places) for n in per_node}
    if len(set(counts.values())) == 1:
        return GpuGroup(name, original.gpu, len(per_node), len(places) // len(per_node),
                        original.intra_node, original.inter_node)
    intra = original.inter_node if len(per_node) > 1 else original.intra_node
    return GpuGroup(name, original.gpu, 1, len(places), intra, original.inter_node)


def present_cluster(cluster: Cluster, places: Sequence[Place] | None) -> Cluster | None:
    """The cluster of the ranks present: each run of consecutive ranks of one group becomes a
    group of the GPUs present (the group's name; ``name.1``, ``name.2``... where its ranks are
    not consecutive, linked by the group's inter-node link), in rank order, so that the
    planner numbers ranks as the launcher did. A node's group is its ``HAPT_GROUP``, else
    the group its hostname is (:func:`resolve_groups`). None where no rank's group is known."""
    if not places:
        return None
    places = resolve_groups(cluster, places)
    if all(p.group is None for p in places):
        return None
    _checked(cluster, places)
    runs = _runs(places)
    seen: dict[str, int] = {}
    for group, _ in runs:
        seen[group] = seen.get(group, 0) + 1
    index: dict[str, int] = {}
    groups, origin = [], {}
    for group, members in runs:
        index[group] = index.get(group, 0) + 1
        name = group if seen[group] == 1 else f"{group}.{index[group]}"
        groups.append(_run_group(name, cluster.group(group), members))
        origin[name] = group
    links = []
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            oa, ob = origin[a.name], origin[b.name]
            link = cluster.group(oa).inter_node if oa == ob else cluster.link(oa, ob)
            if link is not None:
                links.append(GroupLink(a.name, b.name, link))
    return Cluster(cluster.name, tuple(groups), tuple(links), cluster.job, cluster.profiles)


def describe_places(places: Sequence[Place]) -> str:
    """``big x2, small x2``: the groups present and their GPUs, in rank order."""
    counts: dict[str, int] = {}
    for p in places:
        counts[str(p.group)] = counts.get(str(p.group), 0) + 1
    return ", ".join(f"{g} x{n}" for g, n in counts.items())


def missing_gpus(cluster: Cluster, places: Sequence[Place]) -> str:
    """``big x2``: the cluster file's GPUs that no rank present is, group by group."""
    gone = {g.name: g.size - sum(p.group == g.name for p in places) for g in cluster.groups}
    return ", ".join(f"{g} x{n}" for g, n in gone.items() if n > 0)


def plan_groups(plan: Any) -> str:
    """The same for a plan: each group's ranks, in rank order."""
    group_of = {r: rep.group for s in plan.stages for rep in s.replicas for r in rep.ranks}
    return describe_places([Place(group_of[r], "") for r in sorted(group_of)])


# -- the run's global batch ----------------------------------------------------------------------
def _run_record(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_restart(elastic: ElasticEnv | None, output_dir: str | os.PathLike) -> bool:
    if elastic is None:
        return False
    record = _run_record(output_dir)
    same_run = (elastic.run_id != UNNAMED_RUN and record is not None
                and record.get("run_id") == elastic.run_id)
    return elastic.restart_count > 0 or same_run


def _checkpoints(output_dir: str | os.PathLike, naming: str = TRAINER_NAMING) -> dict[str, int]:
    """The complete ``checkpoint-N`` directories of ``output_dir`` (``naming``) and their steps
    (a ``.tmp-`` one, a save cut short, is no checkpoint)."""
    out: dict[str, int] = {}
    if os.path.isdir(output_dir):
        for d in Path(output_dir).iterdir():
            m = re.fullmatch(naming, d.name)
            if m and d.is_dir():
                out[d.name] = int(m.group(1))
    return out


def _resumable(ckpt: Path) -> bool:
    """Whether a committed checkpoint's portable part is whole (checkpoint_store's one rule,
    :func:`~hapt_hf.pipeline.checkpoint_store.copy_whole`): with a node-local directory its
    tensors reach ``portable/`` by a background copy after the commit (a node lost during the
    copy leaves it without its ``.complete`` marker)."""
    from hapt_hf.integration.trainer_checkpoint import PORTABLE_DIR, PORTABLE_STATE
    from hapt_hf.pipeline.checkpoint_store import copy_whole

    has_portable = (ckpt / PORTABLE_STATE).is_file() or (ckpt / PORTABLE_DIR).is_dir()
    return not has_portable or copy_whole(ckpt / PORTABLE_DIR)


def _own_checkpoints(output_dir: str | os.PathLike, naming: str = TRAINER_NAMING) -> list[Path]:
    """The checkpoints this run wrote in ``output_dir``, newest first: those the output
    directory held when the run first started (an earlier run's) are not its own."""
    before = set((_run_record(output_dir) or {}).get("before", []))
    mine = {n: s for n, s in _checkpoints(output_dir, naming).items() if n not in before}
    return [Path(output_dir) / n for n in sorted(mine, key=mine.__getitem__, reverse=True)]


def latest_checkpoint(output_dir: str | os.PathLike, naming: str = TRAINER_NAMING) -> Path | None:
    """The newest checkpoint this run wrote in ``output_dir`` whose portable part is whole."""
    return next((c for c in _own_checkpoints(output_dir, naming) if _resumable(c)), None)


def run_global_batch(config_batch: int | None, output_dir: str | os.PathLike) -> int | None:
    """The global batch an elastic run keeps whatever its world: the hapt config's
    ``global_batch_size`` where the agent may restart the workers, else, on a restart, the one
    the run was planned with (its latest checkpoint's plan, else the plan its last start
    wrote); None where the run is not elastic or starts for the first time."""
    from hapt_hf.planner.plan import Plan, PlanError

    elastic = read_elastic_env()
    if elastic is None:
        return None
    restart = _is_restart(elastic, output_dir)
    if config_batch is not None and (restart or elastic.max_restarts > 0):
        return config_batch
    if not restart:
        return None
    last = latest_checkpoint(output_dir)
    for path in ([last / "plan.json"] if last else []) + [Path(output_dir) / "plan.json"]:
        try:
            return Plan.load(path).global_batch_size
        except (OSError, PlanError):
            continue
    return None


def keep_global_batch(args: Any, target: int, world_size: int) -> None:
    """Set Trainer's batch arguments so that ``per_device_train_batch_size x
    gradient_accumulation_steps x world_size`` is ``target``: the accumulation where the
    per-device batch allows it, else the per-device batch at the same accumulation, else one
    accumulation step."""
    per, acc = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if per * acc * world_size == target:
        return
    for new_per, new_acc in ((per, target // max(1, per * world_size)),
                             (target // max(1, acc * world_size), acc),
                             (target // world_size, 1)):
        if new_per >= 1 and new_acc >= 1 and new_per * new_acc * world_size == target:
            args.per_device_train_batch_size, args.gradient_accumulation_steps = new_per, new_acc
            return
    raise TrainingArgsError(f"the run's global batch of {target} samples cannot be drawn by "
                            f"{world_size} processes (per_device_train_batch_size x "
                            "gradient_accumulation_steps x processes); choose a global_batch_size "
                            "that every world size the run may shrink to divides")


# -- where a start resumes -------------------------------------------------------------------------
def resume_point(rank: int, world_size: int, given: Path | None, output_dir: str | os.PathLike,
                 describe: str, naming: str = TRAINER_NAMING) -> Path | None:
    """The checkpoint this start resumes from (collective: rank 0 decides, every rank learns
    it): on a restart of an elastic run the latest complete checkpoint this run wrote in
    ``output_dir`` (directories named by ``naming``; else ``given``); on a first start
    ``given``. Rank 0 records the start in ``RUN_FILE`` and, on a restart,
    says so with ``describe`` (the world and its groups)."""
    import torch.distributed as dist

    elastic = read_elastic_env()
    if elastic is None or (elastic.max_restarts == 0 and elastic.restart_count == 0):
        return given  # the agent restarts nothing: every start is a first one
    box: list[Any] = [None]
    if rank == 0:
        record = _run_record(output_dir) or {}
        restart = _is_restart(elastic, output_dir)
        starts = int(record.get("starts", 0)) if restart else 0
        chosen = latest_checkpoint(output_dir, naming) if restart else None
        chosen = chosen or given
        if restart:
            where = (f"resuming from {chosen.name}" if chosen is not None
                     else f"no checkpoint in {str(output_dir)!r} yet: starting from step 0")
            torn = [c.name for c in _own_checkpoints(output_dir, naming) if not _resumable(c)]
            if torn:
                where += f" ({', '.join(torn)}: portable part incomplete, not resumed)"
            print(f"hapt_hf: restart {starts}: world {world_size} (groups {describe}), re-planned, "
                  f"{where}", flush=True)
        # a first start notes the checkpoints already there: an earlier run's, never resumed
        # by a restart (this run's own are)
        before = record.get("before", []) if restart else sorted(_checkpoints(output_dir, naming))
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(output_dir) / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"run_id": elastic.run_id, "starts": starts + 1,
                                   "before": before}))
        os.replace(tmp, Path(output_dir) / RUN_FILE)
        box[0] = None if chosen is None else str(chosen)
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else Path(box[0])
