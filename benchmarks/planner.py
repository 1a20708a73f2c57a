"""Planner benchmark: plan every scenario, set the plan beside every baseline and the limit.

    python3 benchmarks/planner.py [--scenarios benchmarks/scenarios] [--json out.json]
                                  [--update-doc docs/benchmarks.md] [--only NAME ...]
                                  [--repeat N] [--from-json a.json b.json ...]

For each scenario file (a cluster file with a ``job:`` section) it reports the search time, the
simulated iteration time of the plan and of every baseline split, the plan's speed-up over each,
and the plan's distance to the physical limit, ``(plan - limit) / limit``. It prints a markdown
report; ``--update-doc`` writes the same report into the "## Planner" section of the given file,
so the figures there are exactly what was measured. ``--from-json`` renders the report from the
``--json`` files of earlier runs (e.g. one scenario a run, so that no run holds the machine
long) instead of planning.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import SCENARIOS_DIR, scenario_paths  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.report import BaselineRow  # noqa: E402

__all__ = ["ScenarioResult", "run_scenario", "run_isolated", "main"]

HAPT_LIKE = ("harp_", "consumer_")
"""Scenarios after HAPT/HARP's own evaluation clusters: the 5%-of-limit and 1 s targets."""
SCALE = "scale_llama70b_mixed256"
TP_FIT = "tp_llama34b_v100x64_16k"
"""The scenario where tensor parallelism is what makes the job fit."""
FLAGSHIP = "harp_v100x8_a100x4_5gbps"
SECTION = "## Planner"


@dataclass(frozen=True)
class ScenarioResult:
    scenario: str
    gpus: int
    model: str
    search_time_s: float
    """The search's own measure (PlanResult.search_time_s)."""
    wall_s: float
    """Wall time of the whole plan_job call, baselines included."""
    cpu_s: float
    """CPU time of this process during plan_job: what the search costs when the machine is
    not shared with other work (the search runs in one thread)."""
    iteration_s: float
    physical_limit_s: float
    limit_distance: float
    stages: int
    micro_batch_size: int
    baselines: tuple[BaselineRow, ...] = field(default_factory=tuple)
    error: str = ""
    pipeline_s: float | None = None
    """Where the plan is the data-parallel candidate (one stage whose GPUs differ in group or
    share): the best pipeline's time, planned with that candidate switched off
    (``allow_uneven_dp=False``)."""
    tp: tuple[int, ...] = ()
    """Each stage's tensor-parallel degree."""
    no_tp_s: float | None = None
    """Where the plan has a tensor-parallel stage: the best plan's time without tensor
    parallelism (``max_tp=1``); None where none fits (``no_tp_reason``)."""
    no_tp_reason: str = ""
    runs_cpu_s: tuple[float, ...] = ()
    """With ``--repeat``: every run's CPU time (the figures above are the medians)."""
    runs_wall_s: tuple[float, ...] = ()
    schedule: str = "h1f1b"
    """The plan's schedule kind."""
    virtual_stages: int = 1
    """Chunks per pipeline rank (above 1 only for interleaved)."""
    deferrals: tuple[int, ...] = ()
    """zero_bubble: each stage's deferral the plan sets."""
    h1f1b_s: float | None = None
    """Where the plan's kind is not h1f1b: the same pipeline under h1f1b (its warm-ups)."""
    kinds: tuple[tuple[str, float | None], ...] = ()
    """Every other kind the search replayed on its best pipeline (None: does not fit)."""


def run_scenario(path: Path) -> ScenarioResult:
    from hapt_hf.planner.search import PlannerOptions, PlanningError, plan_job

    job = load_job(path)
    t0, c0 = time.perf_counter(), time.process_time()
    res = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    it = res.sim.iteration_s
    base = []
    for name, b in res.baselines.items():
        ok = b.plan is not None and b.sim is not None and b.sim.feasible
        if ok:
            base.append(BaselineRow(name, b.sim.iteration_s, b.sim.iteration_s / it, b.reason))
        else:
            why = b.reason or (b.sim.reason if b.sim is not None else "") or "infeasible"
            base.append(BaselineRow(name, None, None, why))
    limit = res.physical_limit_s
    pipeline = None
    if res.plan.num_stages == 1 and res.plan.stages[0].uneven:
        pipeline = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile,
                            options=PlannerOptions(allow_uneven_dp=False)).sim.iteration_s
    no_tp, no_tp_reason = None, ""
    tp = tuple(s.tp for s in res.plan.stages)
    if max(tp) > 1:
        try:
            no_tp = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile,
                             options=PlannerOptions(max_tp=1)).sim.iteration_s
        except PlanningError as e:
            no_tp_reason = str(e)
    plan = res.plan
    h1f1b = dict(res.schedule_kinds).get("h1f1b") if plan.schedule != "h1f1b" else None
    return ScenarioResult(
        scenario=path.stem, gpus=job.cluster.world_size, model=job.model.name,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages,
        deferrals=tuple(d for d in plan.deferrals() or () if d is not None), h1f1b_s=h1f1b,
        kinds=tuple(res.schedule_kinds),
        tp=tp, no_tp_s=no_tp, no_tp_reason=no_tp_reason,
        search_time_s=res.search_time_s, wall_s=wall, cpu_s=cpu, iteration_s=it, physical_limit_s=limit,
        limit_distance=(it - limit) / limit if limit > 0 else float("nan"),
        stages=res.plan.num_stages, micro_batch_size=res.plan.micro_batch_size,
        baselines=tuple(base), pipeline_s=pipeline)


def _failed(path: Path, why: str) -> ScenarioResult:
    nan = float("nan")
    return ScenarioResult(path.stem, 0, "", nan, nan, nan, nan, nan, nan, 0, 0, (), why)


def _from_dict(d: dict) -> ScenarioResult:
    d = dict(d, baselines=tuple(BaselineRow(**b) for b in d["baselines"]),
             tp=tuple(d.get("tp", ())), runs_cpu_s=tuple(d.get("runs_cpu_s", ())),
             runs_wall_s=tuple(d.get("runs_wall_s", ())),
             deferrals=tuple(d.get("deferrals", ())),
             kinds=tuple(tuple(k) for k in d.get("kinds", ())))
    return ScenarioResult(**d)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def run_repeated(path: Path, timeout_s: float, repeat: int) -> ScenarioResult:
    """``repeat`` isolated runs: the plan (deterministic) of the first, the median search
    times, every run's times kept."""
    runs = [run_isolated(path, timeout_s) for _ in range(repeat)]
    bad = next((r for r in runs if r.error), None)
    if bad is not None or repeat == 1:
        return bad or runs[0]
    if len({r.iteration_s for r in runs}) != 1:
        return _failed(path, f"the runs planned different iterations: "
                             f"{sorted({r.iteration_s for r in runs})}")
    return replace(runs[0], search_time_s=_median([r.search_time_s for r in runs]),
                   wall_s=_median([r.wall_s for r in runs]),
                   cpu_s=_median([r.cpu_s for r in runs]),
                   runs_cpu_s=tuple(r.cpu_s for r in runs),
                   runs_wall_s=tuple(r.search_time_s for r in runs))


def run_isolated(path: Path, timeout_s: float) -> ScenarioResult:
    """Run one scenario in a child process, so a search that overruns is stopped and
    reported instead of holding up the whole benchmark."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, __file__, "--one", str(path), "--json", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return _failed(path, f"did not finish within {timeout_s:.0f} s (--timeout)")
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return _failed(path, last)
        return _from_dict(json.loads(out.read_text()))


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
    out = ["| scenario | GPUs | stages | tp | schedule | micro-batch | search s (wall) "
           "| search s (CPU) | plan s/iter | limit s/iter | above limit |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in ok:
        out.append(f"| {r.scenario} | {r.gpus} | {r.stages} | {_degrees(r)} | {_kind(r)} | "
                   f"{r.micro_batch_size} | "
                   f"{r.search_time_s:.3f} | {r.cpu_s:.3f} | {r.iteration_s:.3f} | "
                   f"{r.physical_limit_s:.3f} | {100 * r.limit_distance:.1f}% |")
    out += ["", "Speed-up of the plan over each baseline (baseline's simulated s/iteration):", "",
            "| scenario | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names)]
    for r in ok:
        out.append(f"| {r.scenario} | " + " | ".join(_speedup(r, n) for n in names) + " |")
    dp = [r for r in ok if r.pipeline_s is not None]
    if dp:
        out += ["", "Data-parallel plans (one stage on every GPU, shares by speed) beside the best "
                "pipeline (planned with `allow_uneven_dp=False`) and equal-share DDP:", "",
                "| scenario | plan s/iter | best pipeline | equal-share DDP |",
                "|---|---:|---:|---:|"]
        out += [f"| {r.scenario} | {r.iteration_s:.3f} | {r.pipeline_s / r.iteration_s:.3f}x "
                f"({r.pipeline_s:.3f} s) | {_speedup(r, 'ddp')} |" for r in dp]
    weighed = [r for r in ok if r.kinds]
    if weighed:
        names_k = [n for n in dict.fromkeys(k for r in weighed for k, _ in r.kinds)]
        out += ["", "Schedule kinds replayed on each search's best pipeline (s/iteration; the "
                "plan keeps the fastest that fits; scenarios whose pipeline has no idle time "
                "to fill weigh none):", "",
                "| scenario | " + " | ".join(names_k) + " | kept |",
                "|---|" + "---:|" * len(names_k) + "---|"]
        for r in weighed:
            got = dict(r.kinds)
            cells = [("-" if n not in got else "does not fit" if got[n] is None
                      else f"{got[n]:.3f}") for n in names_k]
            out.append(f"| {r.scenario} | " + " | ".join(cells) + f" | {_kind(r)} |")
    tp = [r for r in ok if r.tp and max(r.tp) > 1]
    if tp:
        out += ["", "Plans with tensor-parallel stages beside the best plan without tensor "
                "parallelism (planned with `max_tp=1`):", "",
                "| scenario | plan s/iter | stages at each degree | without tensor parallelism "
                "| speed-up |", "|---|---:|---|---:|---:|"]
        for r in tp:
            counts = ", ".join(f"{r.tp.count(t)} at {t}" for t in sorted(set(r.tp)))
            if r.no_tp_s is None:
                out.append(f"| {r.scenario} | {r.iteration_s:.3f} | {counts} | no plan fits | "
                           "only tensor parallelism fits |")
            else:
                out.append(f"| {r.scenario} | {r.iteration_s:.3f} | {counts} | "
                           f"{r.no_tp_s:.3f} | {r.no_tp_s / r.iteration_s:.2f}x |")
        out += [f"- {r.scenario} without tensor parallelism: {r.no_tp_reason}"
                for r in tp if r.no_tp_reason]
    reasons = [(r.scenario, b) for r in ok for b in r.baselines if b.iteration_s is None]
    if reasons:
        out += ["", "Infeasible baselines:", ""]
        out += [f"- {s}, {b.name}: {b.reason}" for s, b in reasons]
    rep = [r for r in ok if r.runs_cpu_s]
    if rep:
        out += ["", f"Search times are the medians of {len(rep[0].runs_cpu_s)} runs, each in a "
                "process of its own; every run's (wall / CPU seconds):", ""]
        out += [f"- {r.scenario}: " + ", ".join(f"{w:.3f} / {c:.3f}" for w, c in
                                               zip(r.runs_wall_s, r.runs_cpu_s)) for r in rep]
    failed = [r for r in results if r.error]
    if failed:
        out += ["", "Scenarios the planner failed on:", ""]
        out += [f"- {r.scenario}: {r.error}" for r in failed]
    return out


def _kind(r: ScenarioResult) -> str:
    if r.schedule == "interleaved":
        return f"interleaved v={r.virtual_stages}"
    if r.schedule == "zero_bubble" and r.deferrals:
        return f"zero_bubble (deferrals {min(r.deferrals)}-{max(r.deferrals)})"
    return r.schedule


def _degrees(r: ScenarioResult) -> str:
    return "/".join(str(t) for t in sorted(set(r.tp))) if r.tp else "-"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**not met**")


def _worst(rows: list[ScenarioResult], key, fmt) -> tuple[str, float | None]:
    """The worst figure over ``rows``; a scenario that failed counts as a miss."""
    failed = [r.scenario for r in rows if r.error]
    done = [r for r in rows if not r.error]
    if not done:
        return "no result", None
    w = max(done, key=key)
    text = f"worst: {w.scenario} {fmt(key(w))}"
    if failed:
        return text + f"; failed: {', '.join(failed)}", float("inf")
    return text, key(w)


def _targets(results: list[ScenarioResult]) -> list[str]:
    by = {r.scenario: r for r in results}
    flag = by.get(FLAGSHIP)
    uni = None
    if flag is not None and not flag.error:
        uni = next((b for b in flag.baselines if b.name == "uniform"), None)
    uni_ok = None if uni is None or uni.speedup is None else uni.speedup >= 1.4
    uni_txt = "no result" if uni is None else (
        "uniform infeasible" if uni.speedup is None else f"{uni.speedup:.2f}x")
    hapt = [r for r in results if r.scenario.startswith(HAPT_LIKE)]
    lim_txt, lim = _worst(hapt, lambda r: r.limit_distance, lambda v: f"{100 * v:.1f}%")
    wall_txt, wall = _worst(hapt, lambda r: r.search_time_s, lambda v: f"{v:.3f} s")
    cpu_txt, cpu = _worst(hapt, lambda r: r.cpu_s, lambda v: f"{v:.3f} s")
    scale = by.get(SCALE)
    sc_ok = scale is not None and not scale.error
    sc_wall = scale.search_time_s if sc_ok else None
    sc_cpu = scale.cpu_s if sc_ok else None
    sc_txt = "no result" if scale is None else (scale.error or "")
    sc_lim = scale.limit_distance if sc_ok else None
    return [
        "| target | measured | verdict |", "|---|---|---|",
        f"| >= 1.4x over uniform on {FLAGSHIP} | {uni_txt} | {_verdict(uni_ok)} |",
        f"| within 5% of the physical limit on every HAPT-like scenario | {lim_txt} | "
        f"{_verdict(None if lim is None else lim <= 0.05)} |",
        f"| search < 1 s on every HAPT-like scenario (wall) | {wall_txt} | "
        f"{_verdict(None if wall is None else wall < 1.0)} |",
        f"| search < 1 s on every HAPT-like scenario (CPU) | {cpu_txt} | "
        f"{_verdict(None if cpu is None else cpu < 1.0)} |",
        f"| search < 30 s on {SCALE} (wall) | "
        f"{sc_txt or f'{sc_wall:.2f} s'} | "
        f"{_verdict(None if scale is None else (sc_ok and sc_wall < 30.0))} |",
        f"| search < 30 s on {SCALE} (CPU) | "
        f"{sc_txt or f'{sc_cpu:.2f} s'} | "
        f"{_verdict(None if scale is None else (sc_ok and sc_cpu < 30.0))} |",
        f"| within 20% of the physical limit on {SCALE} | "
        f"{sc_txt or f'{100 * sc_lim:.1f}%'} | "
        f"{_verdict(None if scale is None else (sc_ok and sc_lim <= 0.20))} |",
        f"| within 10% of the physical limit on {SCALE} | "
        f"{sc_txt or f'{100 * sc_lim:.1f}%'} | "
        f"{_verdict(None if scale is None else (sc_ok and sc_lim <= 0.10))} |",
        _tp_fit_target(by.get(TP_FIT)),
    ]


def _tp_fit_target(r: ScenarioResult | None) -> str:
    what = f"| {TP_FIT}: a plan only with tensor parallelism | "
    if r is None:
        return what + "no result | not measured |"
    if r.error:
        return what + f"{r.error} | **not met** |"
    ok = bool(r.tp) and max(r.tp) > 1 and r.no_tp_s is None
    got = f"degrees {_degrees(r)}, " + ("no plan without" if r.no_tp_s is None
                                       else f"{r.no_tp_s:.3f} s without")
    return what + got + f" | {_verdict(ok)} |"


def render(results: list[ScenarioResult], command: str, load: float | None = None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    shared = "" if load is None else f" (1-minute load average {load:.1f} when it started)"
    lines = [
        SECTION, "",
        "Every scenario in `benchmarks/scenarios` planned by `plan_job` with default options; "
        "every figure is the event simulator's iteration time for the same cluster, model and "
        "layer times (measured profiles where the scenario names them, catalogue figures "
        "otherwise). *above limit* is (plan - limit) / limit, where the limit is the total work "
        "divided by the sum of every GPU's speed. HAPT-like scenarios: `harp_*` and "
        "`consumer_*`.", "",
        "Search time is given twice: wall-clock (what `PlanResult.search_time_s` measured) and "
        "the CPU time of the planning process. The search runs in one thread, so on a machine "
        "busy with other work the CPU time is the closer measure of what it costs on an idle "
        "one; the load average below says how busy this one was.", "",
        f"Command (from the repository root): `{command}`", "",
        f"Measured {when} on {platform.machine()} Python {platform.python_version()}, "
        f"{_cpus()} CPU cores{shared}.", "",
    ]
    lines += _tables(results) + ["", "Targets:", ""] + _targets(results)
    return "\n".join(lines) + "\n"


def _cpus() -> int:
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
    ap.add_argument("--scenarios", type=Path, default=SCENARIOS_DIR,
                    help="folder of scenario YAML files (default benchmarks/scenarios)")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--update-doc", type=Path, help="rewrite the Planner section of this file")
    ap.add_argument("--only", nargs="*", help="scenario names (file stems) to run")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds one scenario may take before it is stopped (default 900)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="plan each scenario this many times (each in a process of its own) "
                         "and report the median search times and every run's (default 1)")
    ap.add_argument("--from-json", nargs="+", type=Path,
                    help="render the report from these --json files instead of planning")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args(argv)
    if args.one:
        args.json.write_text(json.dumps(asdict(run_scenario(args.one))))
        return 0
    if args.from_json:
        results = [_from_dict(d) for f in args.from_json for d in json.loads(f.read_text())]
        results.sort(key=lambda r: r.scenario)
        command = "python3 benchmarks/planner.py " + " ".join(argv or sys.argv[1:])
        text = render(results, command, None)
        print(text)
        if args.update_doc:
            update_doc(args.update_doc, text)
        return 1 if any(r.error for r in results) else 0
    try:
        files = scenario_paths(args.scenarios)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if args.only:
        files = [f for f in files if f.stem in args.only]
    if not files:
        print(f"no scenario named {args.only} in {args.scenarios}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = []
    for f in files:
        r = run_repeated(f, args.timeout, max(1, args.repeat))
        print(f"{f.stem}: " + (r.error or f"{r.iteration_s:.3f} s/iter, "
                                f"search {r.search_time_s:.3f} s"), file=sys.stderr)
        results.append(r)
    command = "python3 benchmarks/planner.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    text = render(results, command, load)
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if args.update_doc:
        update_doc(args.update_doc, text)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
