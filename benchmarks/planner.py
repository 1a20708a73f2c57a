"""Planner benchmark: plan every scenario, set the plan beside every baseline and the limit.

    python3 benchmarks/planner.py [--scenarios ../shared/scenarios] [--json out.json]
                                  [--update-doc docs/benchmarks.md] [--only NAME ...]

For each scenario file (a cluster file with a ``job:`` section) it reports the search time, the
simulated iteration time of the plan and of every baseline split, the plan's speed-up over each,
and the plan's distance to the physical limit, ``(plan - limit) / limit``. It prints a markdown
report; ``--update-doc`` writes the same report into the "## Planner" section of the given file,
so the figures there are exactly what was measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hapt_hf.cli import resolve_job  # noqa: E402

__all__ = ["ScenarioResult", "run_scenario", "main"]

HAPT_LIKE = ("harp_", "consumer_")
"""Scenarios after HAPT/HARP's own evaluation clusters: the 5%-of-limit and 1 s targets."""
SCALE = "scale_llama70b_mixed256"
FLAGSHIP = "harp_v100x8_a100x4_5gbps"
SECTION = "## Planner"


@dataclass(frozen=True)
class BaselineFigure:
    name: str
    iteration_s: float | None
    """None: the baseline has no feasible plan (``reason`` says why)."""
    speedup: float | None
    reason: str = ""


@dataclass(frozen=True)
class ScenarioResult:
    scenario: str
    gpus: int
    model: str
    search_time_s: float
    """The search's own measure (PlanResult.search_time_s)."""
    wall_s: float
    """Wall time of the whole plan_job call, baselines included."""
    iteration_s: float
    physical_limit_s: float
    limit_distance: float
    stages: int
    micro_batch_size: int
    baselines: tuple[BaselineFigure, ...] = field(default_factory=tuple)
    error: str = ""


def run_scenario(path: Path) -> ScenarioResult:
    from hapt_hf.planner.search import plan_job

    job = resolve_job(str(path))
    t0 = time.perf_counter()
    res = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile)
    wall = time.perf_counter() - t0
    it = res.sim.iteration_s
    base = []
    for name, b in res.baselines.items():
        ok = b.plan is not None and b.sim is not None and b.sim.feasible
        if ok:
            base.append(BaselineFigure(name, b.sim.iteration_s, b.sim.iteration_s / it, b.reason))
        else:
            why = b.reason or (b.sim.reason if b.sim is not None else "") or "infeasible"
            base.append(BaselineFigure(name, None, None, why))
    limit = res.physical_limit_s
    return ScenarioResult(
        scenario=path.stem, gpus=job.cluster.world_size, model=job.model.name,
        search_time_s=res.search_time_s, wall_s=wall, iteration_s=it, physical_limit_s=limit,
        limit_distance=(it - limit) / limit if limit > 0 else float("nan"),
        stages=res.plan.num_stages, micro_batch_size=res.plan.micro_batch_size,
        baselines=tuple(base))


def _failed(path: Path, err: Exception) -> ScenarioResult:
    nan = float("nan")
    return ScenarioResult(path.stem, 0, "", nan, nan, nan, nan, nan, 0, 0, (),
                          f"{type(err).__name__}: {err}")


# -- report -----------------------------------------------------------------------------------

def _speedup(r: ScenarioResult, name: str) -> str:
    b = next((b for b in r.baselines if b.name == name), None)
    if b is None:
        return "-"
    if b.iteration_s is None:
        return "infeasible"
    return f"{b.speedup:.2f}x ({b.iteration_s:.3f} s)"


def _tables(results: list[ScenarioResult]) -> list[str]:
    ok = [r for r in results if not r.error]
    names = sorted({b.name for r in ok for b in r.baselines})
    out = ["| scenario | GPUs | stages | micro-batch | search s | plan s/iter | limit s/iter "
           "| above limit |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ok:
        out.append(f"| {r.scenario} | {r.gpus} | {r.stages} | {r.micro_batch_size} | "
                   f"{r.search_time_s:.3f} | {r.iteration_s:.3f} | {r.physical_limit_s:.3f} | "
                   f"{100 * r.limit_distance:.1f}% |")
    out += ["", "Speed-up of the plan over each baseline (baseline's simulated s/iteration):", "",
            "| scenario | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names)]
    for r in ok:
        out.append(f"| {r.scenario} | " + " | ".join(_speedup(r, n) for n in names) + " |")
    reasons = [(r.scenario, b) for r in ok for b in r.baselines if b.iteration_s is None]
    if reasons:
        out += ["", "Infeasible baselines:", ""]
        out += [f"- {s}, {b.name}: {b.reason}" for s, b in reasons]
    failed = [r for r in results if r.error]
    if failed:
        out += ["", "Scenarios the planner failed on:", ""]
        out += [f"- {r.scenario}: {r.error}" for r in failed]
    return out


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**not met**")


def _targets(results: list[ScenarioResult]) -> list[str]:
    by = {r.scenario: r for r in results if not r.error}
    flag = by.get(FLAGSHIP)
    uni = next((b for b in flag.baselines if b.name == "uniform"), None) if flag else None
    uni_ok = None if uni is None or uni.speedup is None else uni.speedup >= 1.4
    uni_txt = "no result" if uni is None else (
        "uniform infeasible" if uni.speedup is None else f"{uni.speedup:.2f}x")
    hapt = [r for r in by.values() if r.scenario.startswith(HAPT_LIKE)]
    worst = max(hapt, key=lambda r: r.limit_distance, default=None)
    slow = max(hapt, key=lambda r: r.search_time_s, default=None)
    scale = by.get(SCALE)
    return [
        "| target | measured | verdict |", "|---|---|---|",
        f"| >= 1.4x over uniform on {FLAGSHIP} | {uni_txt} | {_verdict(uni_ok)} |",
        f"| within 5% of the physical limit on every HAPT-like scenario | worst: "
        + (f"{worst.scenario} {100 * worst.limit_distance:.1f}% |" if worst else "no result |")
        + f" {_verdict(None if worst is None else worst.limit_distance <= 0.05)} |",
        "| search < 1 s on every HAPT-like scenario | slowest: "
        + (f"{slow.scenario} {slow.search_time_s:.3f} s |" if slow else "no result |")
        + f" {_verdict(None if slow is None else slow.search_time_s < 1.0)} |",
        f"| search < 30 s on {SCALE} | "
        + (f"{scale.search_time_s:.2f} s |" if scale else "no result |")
        + f" {_verdict(None if scale is None else scale.search_time_s < 30.0)} |",
    ]


def render(results: list[ScenarioResult], command: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        SECTION, "",
        "Every scenario in `../shared/scenarios` planned by `plan_job` with default options; "
        "every figure is the event simulator's iteration time for the same cluster, model and "
        "layer times (measured profiles where the scenario names them, catalogue figures "
        "otherwise). *above limit* is (plan - limit) / limit, where the limit is the total work "
        "divided by the sum of every GPU's speed. HAPT-like scenarios: `harp_*` and "
        "`consumer_*`.", "",
        f"Command (from the repository root): `{command}`", "",
        f"Measured {when} on {platform.machine()} Python {platform.python_version()}, "
        f"{_cpus()} CPU cores.", "",
    ]
    lines += _tables(results) + ["", "Targets:", ""] + _targets(results)
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def update_doc(doc: Path, section: str) -> None:
    """Replace the "## Planner" section of ``doc`` (other sections are left as they are)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.rstrip() == SECTION), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")),
                   len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    doc.write_text(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=Path, default=REPO / ".." / "shared" / "scenarios",
                    help="folder of scenario YAML files (default ../shared/scenarios)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--update-doc", type=Path, help="rewrite the Planner section of this file")
    ap.add_argument("--only", nargs="*", help="scenario names (file stems) to run")
    args = ap.parse_args(argv)
    files = sorted(args.scenarios.glob("*.yaml"))
    if args.only:
        files = [f for f in files if f.stem in args.only]
    if not files:
        print(f"no scenario files in {args.scenarios}", file=sys.stderr)
        return 2
    results = []
    for f in files:
        try:
            r = run_scenario(f)
        except Exception as e:  # a failing scenario is a result to report, not a crash
            r = _failed(f, e)
        print(f"{f.stem}: " + (r.error or f"{r.iteration_s:.3f} s/iter, "
                                f"search {r.search_time_s:.3f} s"), file=sys.stderr)
        results.append(r)
    command = "python3 benchmarks/planner.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    text = render(results, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if args.update_doc:
        update_doc(args.update_doc, text)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
