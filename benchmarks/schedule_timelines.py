"""The schedule kinds side by side on one unlike pipeline, and the timelines of the new ones.

    python3 benchmarks/schedule_timelines.py [--out docs] [--link-gbps 5] [--no-draw]

Four pipeline ranks, two A100s then two V100s behind a 5 Gbit/s, 1 ms link, one GPU each,
GPT-2 of 24 blocks at 1024 tokens, fp16, 12 micro-batches of 4. The layer split is the best
H-1F1B split (every cut giving each rank two layers or more, 1F1B's warm-ups deepened before
the slow link by 0 to 4), and every kind runs on it: 1F1B, H-1F1B, zero-bubble with H-1F1B's
warm-ups, and interleaved with two chunks per rank (each rank's layers cut in two, the first
chunk one layer larger where they are odd). It prints each kind's simulated iteration, bubble
and the peak memory of each rank's GPU, and draws the zero-bubble and interleaved timelines.
``--link-gbps`` sets the link between the groups (the drawings are of 5 Gbit/s).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hapt_hf.core.schedules import warmups_from_steps  # noqa: E402
from hapt_hf.planner.cluster import Cluster  # noqa: E402
from hapt_hf.planner.cost_model import CostModel  # noqa: E402
from hapt_hf.planner.model_spec import ModelSpec  # noqa: E402
from hapt_hf.planner.plan import Plan, Stage  # noqa: E402
from hapt_hf.planner.simulate import simulate_plan  # noqa: E402
from hapt_hf.planner.timeline import draw_timeline, plan_labels  # noqa: E402

CLUSTER = {
    "name": "a100x2-v100x2-5gbps",
    "groups": [
        {"name": "a100", "gpu": "A100-40", "nodes": 1, "gpus_per_node": 2},
        {"name": "v100", "gpu": "V100-32", "nodes": 1, "gpus_per_node": 2},
    ],
    "links": [{"between": ["a100", "v100"], "bandwidth_gbps": 5, "latency_us": 1000}],
}
MODEL = {"family": "gpt2", "hidden_size": 1536, "num_layers": 24, "num_heads": 16,
         "vocab_size": 51200}
SEQ, MBS, M = 1024, 4, 12
GPUS = (("a100", "A100-40"), ("a100", "A100-40"), ("v100", "V100-32"), ("v100", "V100-32"))


def _plan(cuts: tuple[int, ...], warm: tuple[int, ...], schedule: str, layers: int) -> Plan:
    bounds = (0, *cuts, layers)
    stages = tuple(Stage.even(i, (bounds[i], bounds[i + 1]), g, d, (i,), warm[i],
                              micro_batch_size=MBS) for i, (g, d) in enumerate(GPUS))
    return Plan("gpt2-24", layers, SEQ, MBS * M, MBS, M, schedule, stages, dtype="fp16",
                loss_scaling="dynamic").validate()


def best_h1f1b(model: ModelSpec, cluster: Cluster, cm: CostModel) -> Plan:
    """Every cut of the layers into the four ranks (two layers each at least), warm-ups 1F1B's deepened at the slow link
    (between ranks 1 and 2) by 0 to 4: the fastest feasible H-1F1B plan."""
    n = model.num_layers
    best, best_t = None, float("inf")
    for cuts in itertools.combinations(range(1, n), 3):
        if min(b - a for a, b in zip((0, *cuts), (*cuts, n))) < 2:
            continue  # every rank two layers at least: interleaving cuts them in two
        plan = _plan(cuts, (4, 3, 2, 1), "h1f1b", n)
        r = simulate_plan(plan, model, cluster, record_events=False, cost_model=cm)
        if r.feasible and r.iteration_s < best_t:
            best, best_t = plan, r.iteration_s
    assert best is not None
    for extra in range(5):
        warm = warmups_from_steps([1, 1 + extra, 1], M)
        plan = best.with_schedule("h1f1b", list(warm))
        r = simulate_plan(plan, model, cluster, record_events=False, cost_model=cm)
        if r.feasible and r.iteration_s < best_t:
            best, best_t = plan, r.iteration_s
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs"),
                    help="folder for the PNGs (default docs)")
    ap.add_argument("--link-gbps", type=float, default=5.0,
                    help="bandwidth of the A100-V100 link, Gbit/s (default 5)")
    ap.add_argument("--no-draw", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    spec = {**CLUSTER, "links": [{**CLUSTER["links"][0], "bandwidth_gbps": args.link_gbps}]}
    cluster = Cluster.from_dict(spec)
    model = ModelSpec.from_job_model(MODEL, SEQ, "fp16")
    cm = CostModel(model, cluster, None)
    h1 = best_h1f1b(model, cluster, cm)
    plans = {"1f1b": h1.with_schedule("1f1b"), "h1f1b": h1,
             "zero_bubble": h1.with_schedule("zero_bubble", h1.warmups()),
             "interleaved": h1.interleave(2)}
    print(f"layers per rank {[s.num_layers for s in h1.stages]}, H-1F1B warm-ups "
          f"{h1.warmups()}; interleaved chunks "
          f"{[s.num_layers for s in plans['interleaved'].stages]}")
    print("| schedule | iteration (ms) | bubble | peak memory per rank (GB) |")
    print("|---|---|---|---|")
    out = Path(args.out)
    for kind, plan in plans.items():
        plan.validate()
        r = simulate_plan(plan, model, cluster, cost_model=cm)
        p = plan.num_pipeline_ranks
        mem = ", ".join(f"{b / 1e9:.1f}" for b in r.peak_memory_bytes[:p])
        print(f"| {kind} | {r.iteration_s * 1e3:.1f} | {100 * r.bubble_fraction:.1f}% | "
              f"{mem} |")
        if kind in ("zero_bubble", "interleaved") and not args.no_draw:
            path = draw_timeline(r, out / f"schedule_{kind}.png", plan=plan,
                                 title=f"{kind}, A100 x2 then V100 x2 behind "
                                       f"{args.link_gbps:g} Gbit/s",
                                 stage_labels=plan_labels(plan))
            print(f"  drawn: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
