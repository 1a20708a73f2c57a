"""What zero-bubble would give on each scenario's planned partition.

    python3 benchmarks/zero_bubble_gain.py [--only NAME ...]

For each scenario the planner plans under H-1F1B alone (``weigh_kinds=False``; by default
the search weighs zero_bubble on its pipeline itself, search/kinds.py), and the same partition,
replicas and warm-ups are replayed under ``zero_bubble``: once with the schedule's own
deferrals (every stage holding the first stage's warm-up of micro-batches) and once with
``fitting_deferrals`` (each stage deferring no more weight gradients than its GPU's memory
holds, as the cost model prices it). A split backward is priced by the simulator's default
share (``simulate.WEIGHT_GRADIENT_SHARE``). It prints one markdown row per scenario.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import scenario_path, scenario_paths  # noqa: E402
from hapt_hf.core.schedules import fitting_deferrals  # noqa: E402
from hapt_hf.planner.cost_model import CostModel  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.plan import Plan  # noqa: E402
from hapt_hf.planner.search.driver import plan_job  # noqa: E402
from hapt_hf.planner.search.options import PlannerOptions  # noqa: E402
from hapt_hf.planner.simulate import SimResult, simulate_plan  # noqa: E402

__all__ = ["zero_bubble_rows", "main"]


def _cell(r: SimResult) -> str:
    return f"{r.iteration_s:.3f}" + ("" if r.feasible else " (does not fit)")


def zero_bubble_rows(path: Path) -> str:
    """The scenario's markdown row: stages, micro-batches, H-1F1B's iteration and zero-bubble's
    with each kind of deferrals."""
    job = load_job(path)
    # the search's pipeline under H-1F1B (by default the search itself may keep zero_bubble)
    plan = plan_job(job.model, job.cluster, job.global_batch_size, job.profile,
                    PlannerOptions(weigh_kinds=False)).plan
    model = job.model.with_layer_unit(plan.layer_unit)
    tp = {rep.group: rep.tp for s in plan.stages for rep in s.replicas}
    cm = CostModel(model, job.cluster, job.profile, tp=tp)

    def sim(p: Plan) -> SimResult:
        return simulate_plan(p, model, job.cluster, job.profile, record_events=False,
                             cost_model=cm)

    m = plan.num_microbatches
    held = [c.most_held(m) for c in cm.plan_costs(plan).stages]
    zb = plan.with_schedule("zero_bubble", plan.warmups())
    fit = fitting_deferrals(plan.warmups(), m, held)
    fitted = replace(zb, stages=tuple(replace(s, deferral=d) for s, d in zip(zb.stages, fit)))
    base, own, fits = sim(plan), sim(zb), sim(fitted.validate())
    gain = 1 - fits.iteration_s / base.iteration_s if fits.feasible else float("nan")
    return (f"| {path.stem} | {plan.num_stages} | {m} | {_cell(base)} | {_cell(own)} | "
            f"{_cell(fits)} | {100 * gain:.1f}% |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="scenario names (default: every scenario)")
    args = ap.parse_args(argv)
    paths = [scenario_path(n) for n in args.only] if args.only else scenario_paths()
    print("| scenario | stages | micro-batches | h1f1b s/iter | zero_bubble, own deferrals | "
          "zero_bubble, fitting deferrals | gain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        print(zero_bubble_rows(path), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
