"""The plan every rank of a launched job runs: rank 0 loads or plans it, every rank checks it.

With a cluster file rank 0 plans and broadcasts the plan (or its error, so a bad
input ends every rank with the same message instead of a hang); every rank then checks the plan
against the world it found. Only user errors (:class:`~hapt_hf.errors.HaptError`) become that
message; anything else is a bug: rank 0 raises it with its traceback and the other ranks stop
saying rank 0 failed.

Under torchrun's elastic agent the ranks present may be fewer than the cluster file's GPUs: where
the nodes say which group they are (``HAPT_GROUP``), rank 0 plans on the groups shrunk to the
GPUs present (:mod:`~hapt_hf.integration.elastic`), and where nothing fits them, the one
message says what would.

Also here: the model-family check, the console table of the plan (:func:`format_plan`) and the
plan.json rank 0 writes (:func:`write_plan`). Where this process sits in the job
(:class:`~hapt_hf.integration.launch.LaunchEnv`) is read in :mod:`~hapt_hf.integration.launch`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hapt_hf.core.families import (SUPPORTED_MODEL_TYPES, accepted_model_types, unverified_reason,
                                   verified_generic_types)
from hapt_hf.core.layers import layer_name, num_layers
from hapt_hf.core.precision import SHARDED
from hapt_hf.errors import HaptError, LaunchError, PlanningError
from hapt_hf.integration import elastic
from hapt_hf.integration.config import HaptConfig
from hapt_hf.integration.launch import LaunchEnv
from hapt_hf.planner.plan import Plan, PlanError

__all__ = ["resolve_plan", "check_model_family", "check_model_matches_plan", "format_plan",
           "write_plan", "SUPPORTED_MODEL_TYPES"]


def check_model_family(model_config: Any) -> None:
    """Refuse model families the stage builder cannot cut, naming the ones it can."""
    model_type = getattr(model_config, "model_type", None)
    if model_type not in accepted_model_types():
        raise LaunchError(f"model type {model_type!r} is not supported by the pipeline stage "
                          f"builder ({unverified_reason(str(model_type))}); supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} and the "
                          f"{len(verified_generic_types())} verified types of docs/models.md")


def check_model_matches_plan(plan: Plan, model_config: Any, seq_len: int) -> None:
    """A plan made for another model or sequence length would cut the wrong layers."""
    blocks = int(getattr(model_config, "num_hidden_layers", getattr(model_config, "n_layer", 0)))
    expected = num_layers(blocks, plan.layer_unit)
    if plan.num_layers != expected:
        raise PlanError(f"the plan cuts {plan.num_layers} layers but the model has {blocks} "
                        f"blocks (+ embedding and head = {expected} layers with layer_unit "
                        f"{plan.layer_unit!r}); re-plan for this model")
    if plan.seq_len != seq_len:
        raise PlanError(f"the plan was made for seq_len {plan.seq_len} but the run uses "
                        f"{seq_len}; pass --seq_len {plan.seq_len} or re-plan")


def _check_plan_against_cluster(plan: Plan, plugin: HaptConfig) -> None:
    cluster = plugin.load_cluster()
    groups = {g.name for g in cluster.groups}
    # a plan may leave groups idle: its ranks cover the other groups only
    used = sum(g.size for g in cluster.groups if g.name not in plan.idle_groups)
    if used != plan.world_size:
        idle = f" (without its idle groups {list(plan.idle_groups)})" if plan.idle_groups else ""
        raise PlanError(f"{plugin.source}: the plan {str(plugin.plan)!r} uses {plan.world_size} "
                        f"ranks but the cluster {str(plugin.cluster)!r} has {used}{idle}; give "
                        "only one of 'plan' and 'cluster', or re-plan on this cluster")
    # a stage's replicas may sit in different groups: every one of them must exist
    foreign = sorted({g for g in [g for s in plan.stages for g in s.groups]
                      + list(plan.idle_groups) if g and g not in groups})
    if foreign or (plan.cluster_name and plan.cluster_name != cluster.name):
        raise PlanError(f"{plugin.source}: the plan {str(plugin.plan)!r} was made for cluster "
                        f"{plan.cluster_name!r} (groups {foreign or 'as named'}) but the "
                        f"cluster file is {cluster.name!r} with groups {sorted(groups)}; give "
                        "only one of 'plan' and 'cluster', or re-plan on this cluster")


def _check_plan_against_settings(plan: Plan, plugin: HaptConfig) -> None:
    """A ready plan runs with its own precision and attention: one the config sets otherwise
    cannot be honoured."""
    asked = plugin.requested_precision
    if asked not in (None, "auto") and asked != plan.dtype:
        raise PlanError(f"{plugin.source}: precision {asked!r} but the plan {str(plugin.plan)!r} "
                        f"was made for {plan.dtype}; remove 'precision' or re-plan")
    if plugin.attn_implementation not in (None, plan.attn_implementation):
        raise PlanError(f"{plugin.source}: attn_implementation {plugin.attn_implementation!r} "
                        f"but the plan {str(plugin.plan)!r} budgets memory for "
                        f"{plan.attn_implementation!r}; remove it or re-plan")


def _plan_from_cluster(plugin: HaptConfig, model_config: Any, seq_len: int,
                       world_size: int) -> Plan:
    """Rank 0's plan for the ``world_size`` processes launched. Where the best plan leaves
    groups idle but processes were started for them too, those processes are used (the runtime
    has no idle ranks) and rank 0 says what launching only the kept groups would give."""
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.search import plan_job
    from hapt_hf.profiling.model_figures import MeasuringReader
    name = Path(str(getattr(model_config, "name_or_path", "") or model_config.model_type)).name
    if plugin.global_batch_size is None:
        raise LaunchError(f"{plugin.source}: set global_batch_size (samples per optimizer step)"
                          "; the cluster file is planned for one")
    cluster = plugin.load_cluster()
    precision = cluster.precision(plugin.requested_precision)
    # every type's figures read off the model; no attention asked: the model's best
    spec = ModelSpec.from_config(model_config, seq_len=seq_len, dtype=precision.compute, name=name,
                                 attn_implementation=plugin.attn_implementation,
                                 reader=MeasuringReader())
    # plugin.planner was checked when the config was read, with plugin.schedule in it
    best = plan_job(spec, cluster, plugin.global_batch_size, profile=None,
                    options=plugin.planner).plan
    if not best.idle_groups or best.world_size == world_size:
        return best
    every = plan_job(spec, cluster, plugin.global_batch_size, profile=None,
                     options=replace(plugin.planner, all_groups=True)).plan
    kept = sorted({g for s in best.stages for g in s.groups if g})
    print(f"hapt_hf: leaving group(s) {', '.join(best.idle_groups)} idle would be faster "
          f"({best.predicted.iteration_s:.3f} s per iteration against "
          f"{every.predicted.iteration_s:.3f} s on every group); this run uses the "
          f"{world_size} processes launched; launch only the {best.world_size} of group(s) "
          f"{', '.join(kept)} to run the faster plan", file=sys.stdout, flush=True)
    return every


def _plan_present(plugin: HaptConfig, model_config: Any, seq_len: int, world_size: int,
                  places: list[elastic.Place] | None) -> Plan:
    """Rank 0's plan for the GPUs present: the cluster file's, or where the nodes say their
    groups, the groups shrunk to the ranks present (an elastic run after losing nodes)."""
    cluster = plugin.load_cluster()
    places = elastic.resolve_groups(cluster, places) if places else places  # hosts: patterns
    present = elastic.present_cluster(cluster, places) if places else None
    if present is None:
        return _plan_from_cluster(plugin, model_config, seq_len, world_size)
    groups = elastic.describe_places(places or [])
    print(f"hapt_hf: planning on the {world_size} GPUs present (groups {groups})", flush=True)
    try:
        return _plan_from_cluster(replace(plugin, cluster=present), model_config, seq_len,
                                  world_size)
    except PlanningError as e:
        missing = elastic.missing_gpus(plugin.load_cluster(), places or [])
        raise PlanningError(f"the {world_size} GPUs present (groups {groups}; of the cluster "
                            f"file's, {missing or 'none'} not present) cannot hold the job: "
                            f"{e}") from None


def _plan_on_rank0(plugin: HaptConfig, model_config: Any, seq_len: int, world_size: int,
                   places: list[elastic.Place] | None = None
                   ) -> tuple[dict[str, Any], BaseException | None]:
    """The payload every rank receives, and the exception rank 0 re-raises, if any.

    The payload is the plan as a dict, ``{'error': message}`` for a user error (every rank
    raises it alike), or ``{'crash': description}`` for anything else: a bug, which rank 0
    re-raises with its traceback while the others stop instead of waiting for a plan.
    """
    try:
        if plugin.plan is not None:
            plan = Plan.load(plugin.plan)
            _check_plan_against_settings(plan, plugin)
            if plugin.cluster is not None:
                _check_plan_against_cluster(plan, plugin)
        else:
            plan = _plan_present(plugin, model_config, seq_len, world_size, places)
        return plan.to_dict(), None
    except HaptError as e:
        return {"error": str(e)}, None
    except Exception as e:  # a bug: re-raised on rank 0 after the broadcast
        return {"crash": f"{type(e).__name__}: {e}"}, e


def resolve_plan(plugin: HaptConfig, model_config: Any, seq_len: int,
                 launch: LaunchEnv) -> Plan:
    """The same validated plan on every rank: rank 0 loads or plans (on the GPUs present,
    where the nodes say their groups), then broadcasts."""
    places = elastic.gather_places(launch.world_size) if plugin.plan is None else None
    payload, crash = _plan_on_rank0(plugin, model_config, seq_len, launch.world_size, places) \
        if launch.is_main \
        else (None, None)
    box = [payload]
    if launch.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    data = box[0]
    if crash is not None:
        raise crash
    if "crash" in data:
        raise RuntimeError(f"rank 0 failed while planning ({data['crash']}); its traceback "
                           "says where")
    if "error" in data:
        raise PlanError(data["error"])
    plan = Plan.from_dict(data)
    if plugin.plan is not None and plugin.schedule is not None and \
            plan.schedule != plugin.schedule:
        # The plan's warm-ups were chosen for its own schedule; a different one is re-derived.
        plan = plan.with_schedule(plugin.schedule)
    check_model_matches_plan(plan, model_config, seq_len)
    restarts = elastic.read_elastic_env()
    if plugin.plan is not None and plan.world_size != launch.world_size and \
            restarts is not None and restarts.max_restarts > 0:
        raise PlanError(f"{plugin.source}: the plan {str(plugin.plan)!r} runs on "
                        f"{plan.world_size} ranks but the elastic agent started "
                        f"{launch.world_size}; give 'cluster' instead of 'plan' so that rank 0 "
                        "plans on the GPUs present at each start (docs/usage.md, Elastic runs)")
    plan.validate(world_size=launch.world_size)
    return plan


def format_plan(plan: Plan) -> str:
    """A short table of the plan for the console (rank 0 prints it)."""
    lines = [f"hapt_hf plan: {plan.model_name or 'model'} | {plan.num_stages} stages on "
             f"{plan.world_size} ranks | schedule {plan.schedule} | global batch "
             f"{plan.global_batch_size} = {plan.num_microbatches} micro-batches x "
             f"{plan.micro_batch_size} | seq_len {plan.seq_len}"]
    for s in plan.stages:
        names = [layer_name(i, plan.num_layers, plan.layer_unit) for i in range(*s.layers)]
        if len(names) > 5:  # keep one line per stage for deep models
            names = [names[0], "..", names[-1]]
        # a tensor-parallel stage: each replica's ranks, which hold it together
        ranks = (f"ranks {[list(r.ranks) for r in s.replicas]} tp {s.tp}" if s.tp > 1
                 else f"ranks {list(s.ranks)}")
        where = (f"{ranks} samples {list(s.shares(plan.micro_batch_size))} "
                 f"groups {'+'.join(s.groups)}" if s.uneven
                 else f"{ranks} group {s.group or '-'}")
        state = " optimizer sharded" if s.optimizer == SHARDED else ""
        lines.append(f"  stage {s.index}: layers [{s.layers[0]}, {s.layers[1]}) "
                     f"{' '.join(names):<28} {where} warmup {s.warmup}{state}")
    if plan.predicted.iteration_s:
        lines.append(f"  predicted: {plan.predicted.iteration_s:.3f} s/iteration, bubble "
                     f"{plan.predicted.bubble_fraction:.0%}")
    return "\n".join(lines)


def write_plan(plan: Plan, output_dir: str | os.PathLike, launch: LaunchEnv) -> Path | None:
    """Rank 0 writes output_dir/plan.json (atomically, through Plan.save)."""
    if not launch.is_main:
        return None
    path = plan.save(Path(output_dir) / "plan.json")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # Plan.save writes through a 0600 temp file
    return path
