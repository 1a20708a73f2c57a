"""Is there a faster plan than the planner's? A certificate from schedule-free lower bounds.

    python3 benchmarks/plan_bound.py SCENARIO [--target S] [--interleave] [--max-replays N]

Plans the scenario, then enumerates every layout (group order, stage widths, micro-batch size,
layer partition; with ``--interleave`` also a group's stages split by another group's) whose
lower bound (``benchmarks/bound.py``: start, compute, memory slots, exposed all-reduce, drain)
is below the plan's simulated iteration time, and replays each of them under every warm-up depth
(steps 1..k along the pipeline). If none replays faster, no plan over these layouts is faster
than the planner's: its distance to the physical limit is the cost model's, not the search's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import scenario_path  # noqa: E402
from benchmarks.bound import best_warmup_replay, layouts_below  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.search import SearchProblem, physical_limit_s, plan_job  # noqa: E402

__all__ = ["main"]


def _shape_text(stages) -> str:
    return ", ".join(f"{'+'.join(s.groups)}x{s.width}" for s in stages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", help="a scenario name of benchmarks/scenarios (no .yaml)")
    ap.add_argument("--target", type=float, default=None,
                    help="seconds per iteration to beat (default: the planner's plan)")
    ap.add_argument("--interleave", action="store_true",
                    help="also let a group's stages be split by another group's")
    ap.add_argument("--max-replays", type=int, default=4096,
                    help="warm-up depths replayed per layout (default 4096)")
    args = ap.parse_args(argv)
    job = load_job(scenario_path(args.scenario))
    gbs = job.global_batch_size
    res = plan_job(job.model, job.cluster, gbs, profile=job.profile)
    limit = physical_limit_s(SearchProblem.build(job.model, job.cluster, gbs, job.profile))
    target = args.target if args.target is not None else res.sim.iteration_s
    print(f"{args.scenario}: plan {res.sim.iteration_s:.4f} s, limit {limit:.4f} s "
          f"({res.sim.iteration_s / limit - 1:+.2%}); looking for a layout below {target:.4f} s")
    models = [job.model] + ([job.model.split_blocks()] if job.model.can_split_blocks else [])
    faster = []
    for model in models:
        problem = SearchProblem.build(model, job.cluster, gbs, job.profile)
        c0 = time.process_time()
        below, sequences = layouts_below(problem, target, interleave=args.interleave)
        print(f"\n{model.layer_unit} units: {sequences} stage sequences, {len(below)} layouts "
              f"with a bound below the target ({time.process_time() - c0:.1f} s CPU)")
        if below:
            print("| bound s | best replay s | above limit | stages | micro-batch | layers | "
                  "warm-ups |\n|---:|---:|---:|---|---:|---|---|")
        for bl in below:
            got = best_warmup_replay(problem, bl, args.max_replays)
            if got is None:
                print(f"| {bl.lower_bound_s:.4f} | no warm-up fits | | {_shape_text(bl.stages)} "
                      f"| {bl.micro_batch_size} | {[s.layers for s in bl.stages]} | |")
                continue
            lay, r = got
            print(f"| {bl.lower_bound_s:.4f} | {r.iteration_s:.4f} | "
                  f"{r.iteration_s / limit - 1:+.2%} | {_shape_text(bl.stages)} | "
                  f"{bl.micro_batch_size} | {[s.layers for s in bl.stages]} | {list(lay.warmups)} |")
            if r.iteration_s < target * (1 - 1e-9):
                faster.append((r.iteration_s, model.layer_unit, lay))
    if faster:
        t, unit, lay = min(faster, key=lambda f: f[0])
        print(f"\nfaster than the target: {t:.4f} s ({unit} units, {_shape_text(lay.stages)}, "
              f"layers {list(lay.bounds)}, warm-ups {list(lay.warmups)})")
        return 1
    print(f"\nno layout replays below {target:.4f} s: the plan is the fastest there is "
          f"({target / limit - 1:+.2%} above the limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
