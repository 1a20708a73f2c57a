"""What each tensor-parallel lever of the planner gives on one scenario.

    python3 benchmarks/tp_levers.py [--scenario scale_llama70b_mixed256]

Plans the scenario once per row (:data:`LEVERS`): one degree per group
(``tp_stage_rounds=0``), no sequence parallelism (``allow_sequence_parallel=False``) and the
LM head whole on every rank (the model's ``head_tp_plan`` emptied, as for a class whose plan
does not split it), then each lever alone or added, then all three (the default). Prints each
plan's time (its kind, zero_bubble or H-1F1B, as the search keeps it, and its pipeline under
H-1F1B), its distance to the physical limit, its degrees, the stages recomputing all their
blocks or their first ones only (``Stage.recompute_layers``), the plan's own degree floor
(:func:`degree_floor_s`) and the search's CPU seconds. Then the degree floors of every group
at one degree (1, 2, 4, 8): what any plan at those degrees could reach.
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
from hapt_hf.planner.cost_model import CostModel  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.search import PlannerOptions, plan_job  # noqa: E402

LEVERS = (
    ("one degree per group, head whole, no sequence parallelism",
     dict(tp_stage_rounds=0, allow_sequence_parallel=False), False),
    ("+ a degree per stage", dict(allow_sequence_parallel=False), False),
    ("one degree per group + the vocabulary-split head",
     dict(tp_stage_rounds=0, allow_sequence_parallel=False), True),
    ("one degree per group + the head + sequence parallelism", dict(tp_stage_rounds=0), True),
    ("all three, a stage recomputing all its blocks or none",
     dict(allow_partial_recompute=False), True),
    ("all three + partial recompute (the default)", {}, True),
)
"""(row, planner options, whether the head splits where the runtime splits it)."""


def degree_floor_s(cm: CostModel, plan, global_batch_size: int) -> float:
    """The plan's own degree floor: the global batch's work over the summed speed of every GPU
    of the plan, each at its speed inside a replica of its stage's degree (the physical limit
    with tensor parallelism's cost; no plan at these degrees beats it)."""
    rate = 0.0
    for s in plan.stages:
        for rep in s.replicas:
            g = cm.group(rep.group)
            rate += 1.0 / cm.sample_time_s(g, max(rep.samples, 1), rep.tp)
    return global_batch_size / rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="scale_llama70b_mixed256")
    args = ap.parse_args(argv)
    job = load_job(scenario_path(args.scenario))
    print(f"{args.scenario}: | lever | s/iteration (kind) | h1f1b s | above limit | "
          "stages at each degree | sequence parallel stages | recompute all / first k | "
          "degree floor s | search s CPU |")
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
        rc = sum(s.recompute for s in plan.stages)
        ks = [s.recompute_layers for s in plan.stages if s.recompute_layers]
        cm = CostModel(model, job.cluster, job.profile)
        floor = degree_floor_s(cm, plan, job.global_batch_size)
        print(f"| {name} | {it:.3f} ({plan.schedule}) | {h1:.3f} | {100 * above:.1f}% | "
              f"{counts} | {sp} | {rc} / {ks or '-'} | {floor:.2f} | {cpu:.1f} |", flush=True)
    cm = CostModel(job.model, job.cluster, job.profile)
    for t in (1, 2, 4, 8):
        rate = sum(g.size / (t * cm.sample_time_s(g, 1, t)) for g in job.cluster.groups)
        print(f"every group at degree {t}: floor {job.global_batch_size / rate:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
