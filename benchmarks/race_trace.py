"""The race's contender (a) traced action by action, against the simulator's replay of the same
plan with the same profile.

``python3 benchmarks/e2e.py --quick --contenders bc --trace-dir DIR ...`` writes, beside the
race, the profile and the plan (``profile.json``, ``plan.json``, rank 0) and, from every rank
that runs (a), one ``trace_rank<r>.json``: each call of (a)'s step, and inside it every compute
action (``F``, ``B``, ``I``, ``W``: its wall time, with the waits inside it for a received
activation or gradient), every wait, the gradient all-reduce, the loss all-reduce and the
optimizer step. Then

    python3 benchmarks/race_trace.py DIR

prints, stage by stage, the measured mean of each kind of action (its waits left out) beside
the cost model's, the time the stage waited, its optimizer step, and where the measured
iteration went against the replay's. It tells a compute term that is off from a wait that is
not priced.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPUTE = ("F", "B", "I", "W")


class Recorder:
    """Events of one rank's calls of a step: (kind, stage, micro-batch, start, end), times
    relative to the call's start."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._t0 = 0.0
        self.tag = "a"
        """The contender the next call belongs to (``benchmarks/e2e.py``'s (i), (j), (k) run
        (a)'s step with the idle ranks on another load)."""

    def call(self, fn):
        def wrapped(*args, **kwargs):
            self._t0 = time.perf_counter()
            self.calls.append({"events": [], "tag": self.tag})
            out = fn(*args, **kwargs)
            self.calls[-1]["total_s"] = time.perf_counter() - self._t0
            return out
        return wrapped

    def timed(self, kind: str, fn, stage_of=None):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.calls:
                s, k = stage_of(*args) if stage_of else (-1, -1)
                self.calls[-1]["events"].append((kind, s, k, t0 - self._t0,
                                                 time.perf_counter() - self._t0))
            return out
        return wrapped

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.calls))


def instrument(rt, optimizer, rec: Recorder) -> None:
    """Wrap the runtime's compute actions, waits, collectives and ``optimizer.step`` of one
    :class:`~hapt_hf.pipeline.PipelineRuntime` (instance attributes: nothing else changes)."""
    for kind, name in (("F", "_forward"), ("B", "_backward"), ("I", "_backward_input"),
                       ("W", "_backward_weight")):
        setattr(rt, name, rec.timed(kind, getattr(rt, name), lambda m, s, k, *a: (s, k)))
    rt.channel.wait = rec.timed("WAIT", rt.channel.wait, lambda transfers, s, *a: (s, -1))
    rt._sync_grads = rec.timed("SYNC", rt._sync_grads)
    rt._global_loss = rec.timed("LOSS", rt._global_loss)
    optimizer.step = rec.timed("OPT", optimizer.step)


# -- analysis -------------------------------------------------------------------------------

def _inside(ev, waits):
    """Seconds of ``waits`` inside event ``ev``."""
    return sum(max(0.0, min(w[4], ev[4]) - max(w[3], ev[3])) for w in waits)


def _calls(path: Path, skip: int, tag: str = "a") -> list[dict]:
    """The calls of contender ``tag`` in one rank's trace, the first ``skip`` left out."""
    return [c for c in json.loads(path.read_text()) if c.get("tag", "a") == tag][skip:]


def measured(trace_dir: Path, skip: int) -> dict:
    """Per stage: the median over timed calls of each kind's mean compute seconds (waits
    inside left out), its waits, and per call the step's total."""
    out: dict = {"stages": defaultdict(lambda: defaultdict(list)), "totals": []}
    for path in sorted(trace_dir.glob("trace_rank*.json")):
        calls = _calls(path, skip)
        rank = int(path.stem.removeprefix("trace_rank"))
        for c in calls:
            ev = c["events"]
            waits = [e for e in ev if e[0] == "WAIT"]
            per = defaultdict(list)
            stages = set()
            for e in ev:
                if e[0] in COMPUTE:
                    per[(e[1], e[0])].append(e[4] - e[3] - _inside(e, waits))
                    per[(e[1], e[0] + " wait")].append(_inside(e, waits))
                    stages.add(e[1])
            for (s, kind), xs in per.items():
                out["stages"][s][kind].append(statistics.fmean(xs))
                out["stages"][s][kind + " sum"].append(sum(xs))
            for kind in ("SYNC", "LOSS", "OPT"):
                d = sum(e[4] - e[3] for e in ev if e[0] == kind)
                for s in stages:
                    out["stages"][s][kind].append(d)
            last = max((e[4] for e in ev if e[0] in COMPUTE), default=0.0)
            for s in stages:
                out["stages"][s]["compute end"].append(last)
                out["stages"][s]["rank"] = rank
            if rank == 0:
                out["totals"].append(c["total_s"])
    return out


def _outside(waits, ev):
    """The waits that lie inside no compute action (the step's last wait for its sends)."""
    comp = [e for e in ev if e[0] in COMPUTE]
    return [w for w in waits if not any(c[3] <= w[3] and w[4] <= c[4] for c in comp)]


def rank_breakdown(trace_dir: Path, skip: int) -> dict[int, dict[str, float]]:
    """Per rank, medians over timed calls, in seconds: the call's total, compute (waits inside
    left out), waits (inside actions and after the last), the optimizer step, the loss
    all-reduce, the gradient sync, and the rest: what runs between the actions (posting
    sends and receives, the loop) and before the first one."""
    out = {}
    for path in sorted(trace_dir.glob("trace_rank*.json")):
        rank = int(path.stem.removeprefix("trace_rank"))
        rows = defaultdict(list)
        for c in _calls(path, skip):
            ev = c["events"]
            waits = [e for e in ev if e[0] == "WAIT"]
            comp = [e for e in ev if e[0] in COMPUTE]
            inner = sum(_inside(e, waits) for e in comp)
            row = {"total": c["total_s"],
                   "compute": sum(e[4] - e[3] for e in comp) - inner,
                   "waits": inner + sum(w[4] - w[3] for w in _outside(waits, ev)),
                   **{k.lower(): sum(e[4] - e[3] for e in ev if e[0] == k)
                      for k in ("OPT", "LOSS", "SYNC")},
                   "actions": len(comp)}
            row["between actions"] = row["total"] - sum(
                row[k] for k in ("compute", "waits", "opt", "loss", "sync"))
            for k, v in row.items():
                rows[k].append(v)
        out[rank] = {k: statistics.median(v) for k, v in rows.items()}
    return out


def simulated(trace_dir: Path) -> tuple[dict, float]:
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.profile import Profile, cluster_with_links
    from hapt_hf.planner.simulate import simulate_plan
    meta = json.loads((trace_dir / "race.json").read_text())
    from benchmarks.e2e import RaceConfig, _model_config, _nominal_cluster
    cfg = RaceConfig.from_dict(meta["cfg"])
    profile = Profile.load(trace_dir / "profile.json")
    plan = Plan.from_dict(json.loads((trace_dir / "plan.json").read_text()))
    spec = ModelSpec.from_config(_model_config(cfg), cfg.seq, "fp32", name="gpt2-race")
    model = spec.with_layer_unit(plan.layer_unit)
    cluster = cluster_with_links(_nominal_cluster(cfg), profile)
    res = simulate_plan(plan, model, cluster, profile)
    per: dict = defaultdict(lambda: defaultdict(list))
    ranks: dict = defaultdict(lambda: defaultdict(float))
    for e in res.events:
        r = e.rank if e.rank >= 0 else e.stage
        if e.kind in COMPUTE:
            ranks[r]["compute"] += e.end - e.start
            ranks[r]["actions"] += 1
        elif e.kind in ("UPDATE", "ALLREDUCE", "ALLGATHER"):
            ranks[r][e.kind.lower()] += e.end - e.start
    for row in ranks.values():
        row["total"] = res.iteration_s
        row["waits"] = res.iteration_s - sum(v for k, v in row.items()
                                             if k not in ("total", "actions"))
    per["ranks"] = ranks
    for e in res.events:
        per[e.stage][e.kind].append(e.end - e.start)
        if e.kind in COMPUTE:
            per[e.stage]["compute end"].append(e.end)
    return per, res.iteration_s


def report(trace_dir: Path, skip: int) -> str:
    meas = measured(trace_dir, skip)
    sim, predicted = simulated(trace_dir)
    med = statistics.median
    lines = [f"iteration: measured {med(meas['totals']):.4f} s (median of "
             f"{len(meas['totals'])} calls on rank 0), predicted {predicted:.4f} s"]
    lines.append("stage | kind | measured ms (median of calls' means) | predicted ms | "
                 "measured/predicted | measured sum per step ms | waits inside ms")
    for s in sorted(k for k in meas["stages"] if k != "ranks"):
        m, p = meas["stages"][s], sim.get(s, {})
        for kind in COMPUTE:
            if kind not in m:
                continue
            mm = med(m[kind]) * 1e3
            pp = statistics.fmean(p[kind]) * 1e3 if p.get(kind) else float("nan")
            lines.append(f"{s} | {kind} | {mm:.2f} | {pp:.2f} | {mm / pp:.3f} | "
                         f"{med(m[kind + ' sum']) * 1e3:.1f} | "
                         f"{med(m[kind + ' wait sum']) * 1e3:.1f}")
        upd = sum(p.get("UPDATE", [])) * 1e3
        lines.append(f"{s} | OPT | {med(m['OPT']) * 1e3:.2f} | {upd:.2f} | "
                     f"{med(m['OPT']) * 1e3 / upd if upd else float('nan'):.3f} | | ")
        lines.append(f"{s} | last compute ends | {med(m['compute end']) * 1e3:.1f} | "
                     f"{max(p.get('compute end', [0])) * 1e3:.1f} | | | ")
        lines.append(f"{s} | gradient sync / loss all-reduce | {med(m['SYNC']) * 1e3:.2f} / "
                     f"{med(m['LOSS']) * 1e3:.2f} | | | | ")
    lines.append("rank | measured: total / compute / waits / between actions / optimizer / "
                 "loss all-reduce / gradient sync ms (actions) | predicted: compute / waits / "
                 "update ms (actions)")
    for r, m in rank_breakdown(trace_dir, skip).items():
        p = sim["ranks"].get(r, {})
        lines.append(f"{r} | {m['total'] * 1e3:.1f} / {m['compute'] * 1e3:.1f} / "
                     f"{m['waits'] * 1e3:.1f} / {m['between actions'] * 1e3:.1f} / "
                     f"{m['opt'] * 1e3:.1f} / {m['loss'] * 1e3:.1f} / {m['sync'] * 1e3:.1f} "
                     f"({m['actions']:.0f}) | {p.get('compute', 0) * 1e3:.1f} / "
                     f"{p.get('waits', 0) * 1e3:.1f} / {p.get('update', 0) * 1e3:.1f} "
                     f"({p.get('actions', 0):.0f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--skip", type=int, default=None,
                    help="calls not counted (default: the race's untimed repetitions)")
    args = ap.parse_args(argv)
    meta = json.loads((args.trace_dir / "race.json").read_text())
    skip = meta["cfg"]["warmup_reps"] if args.skip is None else args.skip
    print(report(args.trace_dir, skip))


if __name__ == "__main__":
    main()
