"""The ``hapt-hf`` command: plan a cluster, replay a plan, profile GPUs.

    hapt-hf plan [--cluster FILE_OR_BUILTIN] [--model NAME_OR_PATH] [-o plan.json] [--timeline p.png]
    hapt-hf simulate plan.json --cluster FILE [--timeline p.png]   # the model plan.json names
    hapt-hf profile ...

A user mistake (a wrong cluster file, an unknown model, a hand-edited plan that does not add up,
a model that fits nowhere) ends with one line ``hapt-hf: error: <message>`` on stderr and exit
code 2; nothing is written unless planning succeeded.
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Sequence

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS
from hapt_hf.core.precision import DTYPES, PRECISIONS
from hapt_hf.core.schedules import SCHEDULES, ScheduleKind
from hapt_hf.errors import HaptError

from .commands import cmd_plan, cmd_profile, cmd_simulate
from .inputs import DEMO_CLUSTER, DEMO_MODEL, JobInputs, UsageError, load_cluster, resolve_job

__all__ = ["main", "build_parser", "JobInputs", "resolve_job", "load_cluster", "UsageError"]

# Wrong paths the user typed (an output directory that does not exist...): as user errors.
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, PermissionError)


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
    p.add_argument("--precision", choices=PRECISIONS,
                   help="compute dtype (weights and optimizer state stay fp32); auto: bf16 "
                        "where every GPU has it, else fp16 with dynamic loss scaling, fp32 on "
                        "CPUs; default job.precision or auto")
    p.add_argument("--dtype", choices=DTYPES, help="older name of --precision (deprecated)")
    p.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS,
                   help="attention the runtime builds (eager keeps the s x s probabilities); "
                        "default job.attn_implementation, else the model's best (sdpa where "
                        "the model supports it, else eager)")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help=f"pipeline schedule, kept as given; default: the planner's choice "
                        f"({ScheduleKind.H1F1B}, 1F1B with per-stage warm-ups, or zero_bubble / "
                        "interleaved where they replay faster on its best pipeline and fit)")
    p.add_argument("--virtual-stages", type=int, metavar="V",
                   help="chunks per pipeline rank of an interleaved plan (>= 2); default: "
                        "weigh 2 and 3")
    p.add_argument("--max-tp", type=int, metavar="N", default=8,
                   help="largest tensor-parallel degree of a stage's replicas (1, 2, 4 or 8; "
                        "1: no tensor parallelism); default 8")
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help="fix the micro-batch size instead of searching it")
    p.add_argument("--all-groups", action="store_true",
                   help="use every group; by default the search may leave whole groups idle "
                        "where the plan is faster without them (the report names them)")
    p.add_argument("--no-sharded-optimizer", action="store_true",
                   help="keep every stage's whole optimizer state on each of its replicas; by "
                        "default a stage may shard its Adam moments among them (ZeRO-1) where "
                        "that fits more layers, needs less recompute or steps faster")
    p.add_argument("--no-mixed-stages", action="store_true",
                   help="keep every pipeline stage on one group; by default a stage may hold "
                        "GPUs of several linked groups, each GPU's share of the micro-batch by "
                        "its speed, where the simulator finds that faster")
    p.add_argument("-o", "--output", metavar="PLAN_JSON", help="write the plan here")
    p.add_argument("--timeline", metavar="PNG", help="draw the simulated iteration here")
    p.add_argument("--json", action="store_true", help="print the report and plan as JSON")
    p.set_defaults(run=cmd_plan)

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
    s.set_defaults(run=cmd_simulate)

    sub.add_parser("profile", add_help=False,
                   help="measure per-layer times and link speeds (see `hapt-hf profile --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hapt-hf`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:
        run = partial(cmd_profile, argv[1:])  # the profiler parses its own flags
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "run", None):
            parser.print_help(sys.stderr)
            return 2
        run = partial(args.run, args)
    try:
        return run()
    except (HaptError, *_PATH_ERRORS) as e:
        msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename else e
        print(f"hapt-hf: error: {msg}", file=sys.stderr)
        return 2
