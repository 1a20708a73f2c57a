"""What each tensor-parallel lever of the planner gives on one scenario.

    python3 benchmarks/tp_levers.py [--scenario scale_llama70b_mixed256]

Plans the scenario once per row (:data:`LEVERS`): one degree per group
(``tp_stage_rounds=0``), no sequence parallelism (``allow_sequence_parallel=False``) and the
LM head whole on every rank (the model's ``head_tp_plan`` emptied, as for a class whose plan
does not split it), then each lever alone or added, then all three (the default). Prints each
plan's time (its kind, zero_bubble or H-1F1B, as the search keeps it, and its pipeline under
H-1F1B), its distance to the physical limit, its degrees and the search's CPU seconds.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import scenario_path  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.search import PlannerOptions, plan_job  # noqa: E402

LEVERS = (
    ("one degree per group, head whole, no sequence parallelism",
     dict(tp_stage_rounds=0, allow_sequence_parallel=False), False),
    ("+ a degree per stage", dict(allow_sequence_parallel=False), False),
    ("one degree per group + the vocabulary-split head",
     dict(tp_stage_rounds=0, allow_sequence_parallel=False), True),
    ("one degree per group + the head + sequence parallelism", dict(tp_stage_rounds=0), True),
    ("all three (the default)", {}, True),
)
"""(row, planner options, whether the head splits where the runtime splits it)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="scale_llama70b_mixed256")
    args = ap.parse_args(argv)
    job = load_job(scenario_path(args.scenario))
    print(f"{args.scenario}: | lever | s/iteration (kind) | h1f1b s | above limit | "
          "stages at each degree | sequence parallel stages | search s CPU |")
    for name, options, head in LEVERS:
        model = job.model if head else replace(job.model, head_tp_plan=())
        c0 = time.process_time()
        res = plan_job(model, job.cluster, job.global_batch_size, profile=job.profile,
                       options=PlannerOptions(**options))
        cpu = time.process_time() - c0
        plan, it = res.plan, res.sim.iteration_s
        h1 = dict(res.schedule_kinds).get("h1f1b", it)
        tp = [s.tp for s in plan.stages]
        counts = ", ".join(f"{tp.count(t)} at {t}" for t in sorted(set(tp)))
        sp = sum(s.sequence_parallel for s in plan.stages)
        above = (it - res.physical_limit_s) / res.physical_limit_s
        print(f"| {name} | {it:.3f} ({plan.schedule}) | {h1:.3f} | {100 * above:.1f}% | "
              f"{counts} | {sp} | {cpu:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
