"""The ``hapt-hf`` command: plan a cluster, replay a plan, profile GPUs.

    hapt-hf plan [--cluster FILE_OR_BUILTIN] [--model NAME_OR_PATH] [-o plan.json] [--timeline p.png]
    hapt-hf simulate plan.json --cluster FILE [--timeline p.png]   # the model plan.json names
    hapt-hf profile ...

A user mistake (a wrong cluster file, an unknown model, a hand-edited plan that does not add up,
a model that fits nowhere) ends with one line ``hapt-hf: error: <message>`` on stderr and exit
code 2; nothing is written unless planning succeeded.

Length: over 400 lines because ``plan`` and ``simulate`` resolve the same job (flags, then the
cluster file's ``job:``: model, batch, precision, attention) and check a hand-edited plan
against it; the resolution and the checks are shared, so they stay in the one module.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # imported lazily below, so that `hapt-hf --help` answers at once
    from hapt_hf.planner.cluster import Cluster
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.profile import Profile
    from hapt_hf.planner.report import PlanReport

__all__ = ["main", "JobInputs", "resolve_job", "load_cluster", "UsageError"]

DEMO_CLUSTER = "v100x8_a100x4"
DEMO_MODEL = "gpt2"
DEMO_SEQ_LEN = 1024
DEMO_GLOBAL_BATCH = 64


class UsageError(ValueError):
    """A command line that cannot be carried out; the message says which flag to give."""


@dataclass(frozen=True)
class JobInputs:
    """Everything the planner needs, resolved from the flags and the cluster file's ``job:``."""

    cluster: Cluster
    model: ModelSpec
    profile: Profile | None
    """Measured layer times from the cluster file's ``profiles:``, or None."""
    global_batch_size: int
    cluster_source: str
    """The file the cluster came from, or ``built-in <name>``."""
    precision: Any = None
    """The job's Precision, resolved on the cluster's devices (with why it was chosen)."""


# -- resolving the inputs ----------------------------------------------------------------------

def load_cluster(name_or_path: str | None) -> tuple[Cluster, str]:
    """A cluster file, or the name of a built-in one (default: the demo cluster)."""
    from hapt_hf.planner.cluster import Cluster, builtin_cluster_names, builtin_cluster_path

    name = name_or_path or DEMO_CLUSTER
    path = Path(name)
    if path.is_file():
        return Cluster.load(path), str(path)
    if path.suffix in (".yaml", ".yml", ".json") or "/" in name:
        raise UsageError(f"--cluster: file {name!r} does not exist; give a cluster file or a "
                         f"built-in name ({', '.join(builtin_cluster_names())})")
    if name.removesuffix(".yaml") not in builtin_cluster_names():
        raise UsageError(f"--cluster: {name!r} is neither a file nor a built-in cluster; "
                         f"built-ins: {', '.join(builtin_cluster_names())}")
    return Cluster.load(builtin_cluster_path(name)), f"built-in {name}"


def _model_spec(model: str | dict | None, seq_len: int, dtype: str, where: str,
                attn: str | None = None) -> ModelSpec:
    from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
    from hapt_hf.planner.model_spec import ModelSpec, ModelSpecError

    if (isinstance(model, str) and model) or isinstance(model, dict):
        return ModelSpec.from_job_model(model, seq_len, dtype,
                                        attn or DEFAULT_ATTN_IMPLEMENTATION)
    raise ModelSpecError(f"no model given: pass --model NAME_OR_PATH or set job.model in {where}")


def _load_profile(cluster: Cluster, model: ModelSpec, store: str | None = None
                  ) -> tuple[Cluster, Profile | None]:
    """Measured figures: the cluster file's ``profiles:``, then a ``hapt-hf profile`` store.

    The store wins where both measured the same thing, and its measured links replace the
    cluster file's link figures, so a plan follows what this machine's devices really do.
    """
    from hapt_hf.planner.search import cluster_profile
    profile = cluster_profile(cluster, model)
    if store is None:
        return cluster, profile
    if not Path(store).is_file():
        raise UsageError(f"--profile {store}: no such profile store; write one with "
                         "`hapt-hf profile ... --store FILE`")
    from hapt_hf.planner.profile import Profile, cluster_with_links
    measured = Profile.load(store)
    profile = measured if profile is None else profile.merge(measured)
    return cluster_with_links(cluster, measured), profile


def _first(*values: Any) -> Any:
    """The first value given (a flag of 0 counts as given, and is then rejected as such)."""
    return next((v for v in values if v is not None), None)


def _precision_flag(precision: str | None, dtype: str | None) -> str | None:
    """--precision, or the older --dtype (the same setting under its former name)."""
    if precision is not None and dtype is not None and precision != dtype:
        raise UsageError(f"--precision {precision} and --dtype {dtype} disagree; give "
                         "--precision only (--dtype is its older name)")
    return precision or dtype


def resolve_job(cluster_arg: str | None, *, model: str | None = None, seq_len: int | None = None,
                global_batch: int | None = None, dtype: str | None = None,
                profile_store: str | None = None, precision: str | None = None,
                attn_implementation: str | None = None) -> JobInputs:
    """Flags first, then the cluster file's ``job:``; with no cluster at all, the demo job."""
    cluster, source = load_cluster(cluster_arg)
    job = cluster.job
    demo = cluster_arg is None
    model_arg = _first(model, job.model, DEMO_MODEL if demo else None)
    seq = _first(seq_len, job.seq_len, DEMO_SEQ_LEN if demo else None)
    gbs = _first(global_batch, job.global_batch_size, DEMO_GLOBAL_BATCH if demo else None)
    if seq is None:
        raise UsageError(f"no sequence length: pass --seq-len N or set job.seq_len in {source}")
    if gbs is None:
        raise UsageError(f"no global batch: pass --global-batch N or set "
                         f"job.global_batch_size in {source}")
    for flag, value in (("--seq-len", seq), ("--global-batch", gbs)):
        if int(value) < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    prec = cluster.precision(_first(_precision_flag(precision, dtype), job.precision))
    spec = _model_spec(model_arg, int(seq), prec.compute, source,
                       _first(attn_implementation, job.attn_implementation))
    cluster, profile = _load_profile(cluster, spec, profile_store)
    return JobInputs(cluster, spec, profile, int(gbs), source, prec)


def capacities_gb(cluster: Cluster) -> dict[str, float]:
    """Memory of one GPU of each group, for the table's 'memory GB' column."""
    return {g.name: float(g.gpu.memory_gb) for g in cluster.groups}


def stage_labels(plan: Plan) -> list[str]:
    return [f"{s.index} {s.group} x{s.dp}" for s in plan.stages]


# -- subcommands ------------------------------------------------------------------------------

def _emit(report: PlanReport, plan: Plan, as_json: bool) -> None:
    from hapt_hf.planner.report import format_report, report_to_dict
    if as_json:
        print(json.dumps({"report": report_to_dict(report), "plan": plan.to_dict()}, indent=2))
    else:
        print(format_report(report))


def _cmd_plan(args: argparse.Namespace) -> int:
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
    options = PlannerOptions(
        schedule=args.schedule,
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
                          search_time_s=result.search_time_s, baselines=result.baselines)
    # outputs only now that planning succeeded; each is written atomically
    if args.timeline:
        from hapt_hf.planner.timeline import draw_timeline
        draw_timeline(sim, args.timeline, title=report.title,
                      stage_labels=stage_labels(plan))
    if args.output:
        plan.save(args.output)
    _emit(report, plan, args.json)
    print(f"precision: {job.precision.describe()}; attention: {plan.attn_implementation}",
          file=note)
    written = [str(p) for p in (args.output, args.timeline) if p]
    if written:
        print(f"wrote {', '.join(written)}", file=note)
    return 0


def _physical_limit(plan: Plan, job: JobInputs) -> float:
    """No plan of this job can beat this: total work over the sum of every GPU's speed."""
    from hapt_hf.planner.cost_model import CostModel
    from hapt_hf.planner.search import physical_limit_s
    return physical_limit_s(CostModel(job.model, job.cluster, job.profile), plan.global_batch_size)


def _check_devices(plan: Plan, cluster: Cluster, where: str) -> None:
    """A hand-edited stage must not claim GPUs its group does not have: the replay prices the
    group's GPUs, so a mismatch would print figures for hardware other than the one named."""
    from hapt_hf.planner.catalogue import device_names
    from hapt_hf.planner.plan import PlanError
    groups = {g.name: g for g in cluster.groups}
    for s in plan.stages:
        g = groups.get(s.group)
        if g is None or not s.device_type:
            continue  # an unknown group is reported by the cost model, naming the groups
        ok = {n.upper() for n in device_names(g.gpu.name)}
        if s.device_type.upper() not in ok:
            raise PlanError(f"{where}: stage {s.index} has device_type {s.device_type!r} but "
                            f"group {s.group!r} has {g.gpu.name} GPUs; set device_type to "
                            f"{g.gpu.name!r} or move the stage to a group of {s.device_type}")


def _model_for(plan: Plan, model: ModelSpec, where: str) -> ModelSpec:
    """The model's layer sequence in the plan's unit: a plan may cut inside blocks."""
    from hapt_hf.planner.plan import PlanError
    if plan.layer_unit != "half" or model.layer_unit == "half":
        return model
    if not model.can_split_blocks:
        raise PlanError(f"{where}: layer_unit is 'half' but {model.name} ({model.family}) cannot "
                        "be cut inside its blocks; use a plan with whole blocks")
    return model.split_blocks()


def _spec_or_none(model: str | dict | None, plan: Plan) -> ModelSpec | None:
    from hapt_hf.planner.model_spec import ModelSpecError
    try:
        return _model_spec(model, plan.seq_len, plan.dtype, "", plan.attn_implementation)
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
            _model_spec(flag, plan.seq_len, plan.dtype, where, plan.attn_implementation),
            planned):
        raise UsageError(f"--model {flag!r} is not the model {where} was made for "
                         f"({plan.model_name!r}); leave --model out to replay the plan's model, "
                         f"or re-plan for {flag!r}")
    return flag


def _cmd_simulate(args: argparse.Namespace) -> int:
    from hapt_hf.planner.plan import Plan, PlanError
    from hapt_hf.planner.report import build_report
    from hapt_hf.planner.simulate import simulate_plan

    plan = Plan.load(args.plan).validate()
    cluster, _ = load_cluster(args.cluster)
    model_arg = _replayed_model(plan, args.plan, args.model, cluster.job.model)
    job = resolve_job(args.cluster, model=model_arg, seq_len=plan.seq_len,
                      global_batch=plan.global_batch_size, precision=plan.dtype,
                      profile_store=args.profile,
                      attn_implementation=plan.attn_implementation)
    model = _model_for(plan, job.model, args.plan)
    if model.num_layers != plan.num_layers:
        raise PlanError(f"model.num_layers is {plan.num_layers} in {args.plan} but "
                        f"{model.name} has {model.num_layers} layers (blocks + 2, or twice the "
                        "blocks + 2 with layer_unit 'half'); re-plan for this model, or name the "
                        "model the plan was made for (model.name in the plan, or --model)")
    _check_devices(plan, job.cluster, args.plan)
    sim = simulate_plan(plan, model, job.cluster, job.profile, record_events=True)
    report = build_report(plan, sim, title=f"{args.plan} on {job.cluster.name}",
                          capacity_gb=capacities_gb(job.cluster),
                          physical_limit_s=_physical_limit(plan, job))
    if args.timeline:
        from hapt_hf.planner.timeline import draw_timeline
        draw_timeline(sim, args.timeline, title=report.title, stage_labels=stage_labels(plan))
    _emit(report, plan, args.json)
    return 0 if sim.feasible else 1


def _cmd_profile(argv: list[str]) -> int:
    try:
        from hapt_hf.profiling.cli import cli_main
    except ImportError:
        print("hapt-hf: error: the profiler is not installed in this hapt_hf "
              "(hapt_hf.profiling.cli is missing)", file=sys.stderr)
        return 2
    return int(cli_main(argv) or 0)


# -- argument parsing --------------------------------------------------------------------------

def _job_flags(p: argparse.ArgumentParser, model_default: str = "the cluster file's job.model"
               ) -> None:
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="a model name (gpt2, meta-llama/Llama-2-7b-hf...) or a config.json "
                        f"path; default: {model_default}")
    p.add_argument("--profile", metavar="STORE",
                   help="profile store written by `hapt-hf profile`: its measured layer times "
                        "and links replace catalogue and cluster-file figures")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hapt-hf",
        description="Heterogeneity-aware pipeline planning for Hugging Face causal LMs.",
        epilog="examples:\n"
               "  hapt-hf plan                      # GPT-2 on the built-in 8 V100 + 4 A100 "
               "cluster\n"
               "  hapt-hf plan --cluster cluster.yaml --model gpt2 --seq-len 1024 "
               "--global-batch 64 -o plan.json --timeline plan.png\n"
               "  hapt-hf simulate plan.json --cluster cluster.yaml\n"
               "errors in the input end with one line 'hapt-hf: error: ...' and exit code 2.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{plan,simulate,profile}")

    p = sub.add_parser(
        "plan", help="find the fastest pipeline plan for a cluster and a model",
        description="Search the pipeline plan (group order, stages, layer ranges, micro-batch, "
                    "warm-ups) with the lowest simulated iteration time, print it beside the "
                    "baseline splits, and optionally write plan.json and a timeline PNG. "
                    f"Without --cluster: the built-in {DEMO_CLUSTER} cluster and {DEMO_MODEL}.")
    p.add_argument("--cluster", metavar="FILE_OR_BUILTIN",
                   help=f"cluster file (YAML) or built-in cluster name; default {DEMO_CLUSTER}")
    _job_flags(p)
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample; default job.seq_len")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="samples per optimizer step; default job.global_batch_size")
    p.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"),
                   help="compute dtype (weights and optimizer state stay fp32); auto: bf16 "
                        "where every GPU has it, else fp16 with dynamic loss scaling, fp32 on "
                        "CPUs; default job.precision or auto")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"),
                   help="older name of --precision (deprecated)")
    p.add_argument("--attn-implementation", choices=("eager", "sdpa"),
                   help="attention the runtime builds (eager keeps the s x s probabilities); "
                        "default job.attn_implementation or sdpa")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "h1f1b"), default="h1f1b",
                   help="pipeline schedule (default h1f1b: 1F1B with per-stage warm-ups)")
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help="fix the micro-batch size instead of searching it")
    p.add_argument("-o", "--output", metavar="PLAN_JSON", help="write the plan here")
    p.add_argument("--timeline", metavar="PNG", help="draw the simulated iteration here")
    p.add_argument("--json", action="store_true", help="print the report and plan as JSON")
    p.set_defaults(run=_cmd_plan)

    s = sub.add_parser(
        "simulate", help="replay a plan (also one edited by hand) on a cluster",
        description="Validate PLAN_JSON, replay it in the event simulator on the cluster and "
                    "print the simulated per-stage times, memory against each GPU's capacity, "
                    "iteration time and bubble. Exit 1 if the plan does not fit in memory.")
    s.add_argument("plan", metavar="PLAN_JSON", help="plan file written by `hapt-hf plan -o`")
    s.add_argument("--cluster", metavar="FILE_OR_BUILTIN", required=True,
                   help="cluster file (YAML) or built-in cluster name")
    _job_flags(s, model_default="the model PLAN_JSON names (another model is refused)")
    s.add_argument("--timeline", metavar="PNG", help="draw the simulated iteration here")
    s.add_argument("--json", action="store_true", help="print the report and plan as JSON")
    s.set_defaults(run=_cmd_simulate)

    sub.add_parser("profile", add_help=False,
                   help="measure per-layer times and link speeds (see `hapt-hf profile --help`)")
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean the input is wrong, not the program."""
    from hapt_hf.planner.cluster import ClusterError
    from hapt_hf.planner.model_spec import ModelSpecError
    from hapt_hf.planner.plan import PlanError
    from hapt_hf.planner.schedule import ScheduleError
    from hapt_hf.planner.cost_model import CostModelError
    from hapt_hf.planner.profile import ProfileError
    from hapt_hf.planner.search import PlanningError
    return (UsageError, ClusterError, ModelSpecError, PlanError, ScheduleError, PlanningError,
            CostModelError, ProfileError, FileNotFoundError, IsADirectoryError, PermissionError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hapt-hf`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:
        run = partial(_cmd_profile, argv[1:])  # the profiler parses its own flags
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "run", None):
            parser.print_help(sys.stderr)
            return 2
        run = partial(args.run, args)
    try:
        return run()
    except _user_errors() as e:
        msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename else e
        print(f"hapt-hf: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
