"""The verbs of ``hapt-hf``: ``plan`` searches and reports a plan, ``simulate`` replays one
(also one edited by hand) after checking it names the model and the GPUs it is replayed on,
``profile`` hands over to the profiler."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from hapt_hf.core.layers import num_blocks
from hapt_hf.errors import ModelSpecError, PlanError

from .inputs import JobInputs, UsageError, load_cluster, model_spec, resolve_job

if TYPE_CHECKING:  # imported lazily below, so that `hapt-hf --help` answers at once
    from hapt_hf.planner.cluster import Cluster
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.report import PlanReport

__all__ = ["cmd_plan", "cmd_simulate", "cmd_profile", "capacities_gb", "stage_labels"]


def capacities_gb(cluster: Cluster) -> dict[str, float]:
    """Memory of one GPU of each group, for the table's 'memory GB' column."""
    return {g.name: float(g.gpu.memory_gb) for g in cluster.groups}


def stage_labels(plan: Plan) -> list[str]:
    return [f"{s.index} {'+'.join(s.groups)} x{s.width}" for s in plan.stages]


# -- subcommands ------------------------------------------------------------------------------

def _emit(report: PlanReport, plan: Plan, as_json: bool) -> None:
    from hapt_hf.planner.report import format_report, report_to_dict
    if as_json:
        print(json.dumps({"report": report_to_dict(report), "plan": plan.to_dict()}, indent=2))
    else:
        print(format_report(report))


def cmd_plan(args: argparse.Namespace) -> int:
    from hapt_hf.planner.report import build_report
    from hapt_hf.planner.search import PlannerOptions, plan_job

    job = resolve_job(args.cluster, model=args.model, seq_len=args.seq_len,
                      global_batch=args.global_batch, dtype=args.dtype,
                      profile_store=args.profile, precision=args.precision,
                      attn_implementation=args.attn_implementation)
    note = sys.stderr if args.json else sys.stdout
    if args.cluster is None:
        print(f"no --cluster given: planning {job.model.name} on the {job.cluster_source} "
              "cluster", file=note)
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UsageError(f"--micro-batch must be a positive integer, got {args.micro_batch}")
    if args.virtual_stages is not None and args.schedule not in (None, "interleaved"):
        raise UsageError(f"--virtual-stages sets the chunks of an interleaved plan, but "
                         f"--schedule is {args.schedule}; drop it or use --schedule "
                         "interleaved")
    options = PlannerOptions(
        # a schedule the user names is the one the plan runs; none: the planner's choice
        schedule=args.schedule or PlannerOptions().schedule, all_groups=args.all_groups,
        max_tp=args.max_tp, weigh_kinds=args.schedule is None,
        virtual_stages=args.virtual_stages,
        allow_sharded_optimizer=not args.no_sharded_optimizer,
        allow_mixed_stages=not args.no_mixed_stages,
        micro_batch_sizes=None if args.micro_batch is None else (args.micro_batch,))
    result = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile,
                      options=options)
    plan = result.plan.validate()
    sim = result.sim
    if not sim.events:  # a replay that kept no events (e.g. a baseline's) cannot be drawn
        from hapt_hf.planner.simulate import simulate_plan
        sim = simulate_plan(plan, _model_for(plan, job.model, "the plan"), job.cluster,
                            job.profile, record_events=True)
    report = build_report(plan, sim, title=f"{job.model.name} on {job.cluster.name}",
                          capacity_gb=capacities_gb(job.cluster),
                          physical_limit_s=result.physical_limit_s,
                          used_limit_s=_used_limit(plan, job),
                          search_time_s=result.search_time_s, baselines=result.baselines,
                          all_groups_s=result.all_groups_s, sharding=result.sharding,
                          attention_reason=job.model.attn_reason)
    # outputs only now that planning succeeded; each is written atomically
    if args.timeline:
        from hapt_hf.planner.timeline import draw_timeline
        draw_timeline(sim, args.timeline, title=report.title, plan=plan)
    if args.output:
        plan.save(args.output)
    _emit(report, plan, args.json)
    print(f"precision: {job.precision.describe()}; attention: {plan.attn_implementation}",
          file=note)
    written = [str(p) for p in (args.output, args.timeline) if p]
    if written:
        print(f"wrote {', '.join(written)}", file=note)
    return 0


def _physical_limit(plan: Plan, job: JobInputs, cluster: Cluster | None = None) -> float:
    """No plan of this job can beat this: total work over the sum of every GPU's speed (of
    ``cluster``, default the job's)."""
    from hapt_hf.planner.cost_model import CostModel
    from hapt_hf.planner.search import SearchProblem, physical_limit_s
    cm = CostModel(job.model, cluster or job.cluster, job.profile)
    return physical_limit_s(SearchProblem(cm, plan.global_batch_size))


def _used_limit(plan: Plan, job: JobInputs) -> float | None:
    """The physical limit over the groups ``plan`` uses, where it leaves some idle."""
    if not plan.idle_groups:
        return None
    kept = [g for g in job.cluster.group_names if g not in plan.idle_groups]
    return _physical_limit(plan, job, job.cluster.subset(kept))


def _check_devices(plan: Plan, cluster: Cluster, where: str) -> None:
    """A hand-edited stage must not claim GPUs its group does not have: the replay prices the
    group's GPUs, so a mismatch would print figures for hardware other than the one named."""
    from hapt_hf.planner.catalogue import device_names
    groups = {g.name: g for g in cluster.groups}
    for s in plan.stages:
        for r in s.replicas:
            g = groups.get(r.group)
            if g is None or not r.device_type:
                continue  # an unknown group is reported by the cost model, naming the groups
            ok = {n.upper() for n in device_names(g.gpu.name)}
            if r.device_type.upper() not in ok:
                raise PlanError(f"{where}: stage {s.index} (rank "
                                f"{', '.join(map(str, r.ranks))}) has device_type "
                                f"{r.device_type!r} but group {r.group!r} has {g.gpu.name} GPUs; "
                                f"set device_type to {g.gpu.name!r} or move the stage to a "
                                f"group of {r.device_type}")


def _model_for(plan: Plan, model: ModelSpec, where: str) -> ModelSpec:
    """The model's layer sequence in the plan's unit: a plan may cut inside blocks."""
    if plan.layer_unit != "half" or model.layer_unit == "half":
        return model
    if not model.can_split_blocks:
        why = f" ({model.half_refusal})" if model.half_refusal else ""
        raise PlanError(f"{where}: layer_unit is 'half' but {model.name} ({model.family}) cannot "
                        f"be cut inside its blocks{why}; use a plan with whole blocks")
    return model.split_blocks()


def _spec_or_none(model: str | dict | None, plan: Plan) -> ModelSpec | None:
    try:
        return model_spec(model, plan.seq_len, plan.dtype, "", plan.attn_implementation)
    except ModelSpecError:
        return None


def _same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """The same layers, whatever each was called (a path, a built-in name, a hub alias)."""
    from dataclasses import replace
    return replace(a, name="", profile_name=None) == replace(b, name="", profile_name=None)


def _replayed_model(plan: Plan, where: str, flag: str | None, job_model: Any) -> str | None:
    """The model ``simulate`` replays, as a --model value (None: the cluster file's job.model).

    It is the model the plan names: the cluster file's job.model where that bears the plan's
    name (a mapping there gets a made-up name, e.g. gpt2-h256), else the name itself as a
    built-in model or a local config. A --model that is another model is refused; where the
    plan's model is known by neither, --model or job.model is replayed as given (the layer
    count is still checked against the plan).
    """
    job_spec = _spec_or_none(job_model, plan) if job_model is not None else None
    if job_spec is not None and job_spec.name == plan.model_name:
        planned, name = job_spec, None
    else:
        planned, name = _spec_or_none(plan.model_name, plan), plan.model_name
    if planned is None and flag is None and job_model is None:
        raise UsageError(f"{where} names model {plan.model_name!r}, which is neither a built-in "
                         "model nor a local config; pass --model NAME_OR_PATH (the model the "
                         "plan was made for) or set job.model in the cluster file")
    if planned is None or flag is None:
        return flag if planned is None else name
    if flag != plan.model_name and not _same_model(
            model_spec(flag, plan.seq_len, plan.dtype, where, plan.attn_implementation),
            planned):
        raise UsageError(f"--model {flag!r} is not the model {where} was made for "
                         f"({plan.model_name!r}); leave --model out to replay the plan's model, "
                         f"or re-plan for {flag!r}")
    return flag


def cmd_simulate(args: argparse.Namespace) -> int:
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.report import build_report
    from hapt_hf.planner.simulate import simulate_plan

    plan = Plan.load(args.plan).validate()
    cluster, _ = load_cluster(args.cluster)
    model_arg = _replayed_model(plan, args.plan, args.model, cluster.job.model)
    job = resolve_job(args.cluster, model=model_arg, seq_len=plan.seq_len,
                      global_batch=plan.global_batch_size, precision=plan.dtype,
                      attn_implementation=plan.attn_implementation,
                      profile_store=args.profile)
    model = _model_for(plan, job.model, args.plan)
    if model.num_layers != plan.num_layers:
        blocks = num_blocks(model.num_layers, model.layer_unit)
        raise PlanError(f"model.num_layers is {plan.num_layers} in {args.plan} but "
                        f"{model.name} has {model.num_layers} layers ({blocks} blocks with "
                        f"layer_unit {model.layer_unit!r}, embedding and head); re-plan for this "
                        "model, or name the model the plan was made for (model.name in the "
                        "plan, or --model)")
    _check_devices(plan, job.cluster, args.plan)
    sim = simulate_plan(plan, model, job.cluster, job.profile, record_events=True)
    report = build_report(plan, sim, title=f"{args.plan} on {job.cluster.name}",
                          capacity_gb=capacities_gb(job.cluster),
                          physical_limit_s=_physical_limit(plan, job),
                          used_limit_s=_used_limit(plan, job))
    if args.timeline:
        from hapt_hf.planner.timeline import draw_timeline
        draw_timeline(sim, args.timeline, title=report.title, plan=plan)
    _emit(report, plan, args.json)
    return 0 if sim.feasible else 1


def cmd_profile(argv: list[str]) -> int:
    try:
        from hapt_hf.profiling.cli import cli_main
    except ImportError:
        print("hapt-hf: error: the profiler is not installed in this hapt_hf "
              "(hapt_hf.profiling.cli is missing)", file=sys.stderr)
        return 2
    return int(cli_main(argv) or 0)
