"""How fast one capped CPU rank computes a GPT-2 block of the race, with other processes beside it.

The race's ranks (benchmarks/e2e.py) are CPU processes under an equal cgroup quota (0.45 cores
by default), pinned round robin to this machine's cores. This script starts one *subject*
process under the same quota and pinning (rank 0: core 0) that times the forward + backward of
``--blocks`` consecutive GPT-2 blocks of the race's model (the runtime's own stage, built by
``build_stage``), per block, in windows; and beside it ``k`` *load* processes, each under its own
quota, pinned as race ranks 1, 2, 3 would be (core 1, core 0, core 1), running one of:

- ``block``: the same block's forward + backward in a loop (what a profiling peer runs);
- ``stage``: a stage of 7 blocks' forward + backward (what a rank of a plan runs);
- ``spin``: a spin on the clock (what the testbed's slow-down hook pays its debt with);
- ``burn``: small 96x96 matrix products (what an idle rank of the race runs).

    python3 benchmarks/contention.py                       # the default grid, about 4 minutes
    python3 benchmarks/contention.py --loads 0,1,3 --kinds block,spin --blocks 1,9

Prints one line per case and a JSON list on the last line: per case, the median per-block
forward + backward (ms) over the windows, and the subject's CPU share (CPU seconds / wall).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_OF_RANK = (0, 1, 0, 1)


def _stage(blocks: int):
    import torch
    from benchmarks.e2e import RaceConfig, _model_config
    from hapt_hf.pipeline.stage import build_stage
    cfg = RaceConfig()
    config = _model_config(cfg)
    stage = build_stage(config, (1, 1 + blocks), seed=0).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, generator=g).requires_grad_(True)
    dy = torch.randn(x.shape, generator=g)
    return stage, x, dy


def subject(blocks: int, seconds: float, window_s: float, gap_ms: float = 0.0) -> dict:
    """Per-block forward + backward seconds in windows; with ``gap_ms``, the process sleeps
    that long before each forward and each backward (a pipeline rank waiting for its
    neighbours), and only the compute is timed."""
    stage, x, dy = _stage(blocks)
    for _ in range(3):
        stage(x).backward(dy)
    windows, fwd, shares = [], [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        busy = f = 0.0
        c0, n = time.process_time(), 0
        while busy < window_s:
            if gap_ms:
                time.sleep(gap_ms / 1e3)
            t0 = time.perf_counter()
            out = stage(x)
            t1 = time.perf_counter()
            if gap_ms:
                time.sleep(gap_ms / 1e3)
                t1b = time.perf_counter()
            else:
                t1b = t1
            out.backward(dy)
            t2 = time.perf_counter()
            busy += (t1 - t0) + (t2 - t1b)
            f += t1 - t0
            n += 1
        windows.append(busy / n / blocks)
        fwd.append(f / n / blocks)
        shares.append((time.process_time() - c0) / busy)
    return {"block_ms": statistics.median(windows) * 1e3,
            "fwd_ms": statistics.median(fwd) * 1e3,
            "q1_ms": statistics.quantiles(windows, n=4)[0] * 1e3,
            "q3_ms": statistics.quantiles(windows, n=4)[2] * 1e3,
            "cpu_share": statistics.median(shares), "windows": len(windows)}


def load(kind: str) -> None:
    if kind in ("block", "stage"):
        stage, x, dy = _stage(1 if kind == "block" else 7)
        while True:
            stage(x).backward(dy)
    elif kind in ("burn", "spin"):  # the race's own idle loads, run back to back
        from benchmarks.e2e import IDLE_RUNS
        run = IDLE_RUNS[kind]
        while True:
            run()
    raise SystemExit(f"unknown load kind {kind!r}")


def _start(role: list[str], cgroups, rank: int, cap: float | None) -> subprocess.Popen:
    def pre() -> None:
        if cgroups is not None:
            cgroups.join(rank)
        os.sched_setaffinity(0, {CPU_OF_RANK[rank] % len(os.sched_getaffinity(0))})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *role], env=env,
                            stdout=subprocess.PIPE, text=True, preexec_fn=pre, cwd=ROOT)


def case(blocks: int, kind: str, k: int, cap: float | None, seconds: float,
         window_s: float, gap_ms: float = 0.0) -> dict:
    from benchmarks.testbed.cpu import CgroupQuotas
    cgroups = None
    if cap is not None:
        cgroups = CgroupQuotas("cont_" + secrets.token_hex(3))
        for r in range(4):
            cgroups.create(r, cap)
    loads = []
    try:
        loads = [_start(["--role", "load", "--kind", kind], cgroups, r, cap)
                 for r in range(1, 1 + k)]
        time.sleep(3.0 if k else 0.0)  # the loads' imports are done, their loops running
        p = _start(["--role", "subject", "--blocks", str(blocks), "--seconds", str(seconds),
                    "--window-s", str(window_s), "--gap-ms", str(gap_ms)], cgroups, 0, cap)
        out = p.communicate(timeout=seconds + 120)[0]
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        for q in loads:
            q.kill()
            q.wait()
        if cgroups is not None:
            cgroups.cleanup()
    return {"blocks": blocks, "load": kind if k else "none", "k": k, "cap": cap,
            "gap_ms": gap_ms, **got}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="block", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", default="1,4",
                    help="stage sizes the subject times (blocks, at most 7: the race's model has 8)")
    ap.add_argument("--kinds", default="block,spin,burn,stage", help="load kinds")
    ap.add_argument("--loads", default="0,1,3", help="numbers of load processes (0-3)")
    ap.add_argument("--cap", type=float, default=0.45, help="cores per process; 0: no quota")
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per case")
    ap.add_argument("--window-s", type=float, default=0.25)
    ap.add_argument("--gap-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=None,
                    help="explicit cases blocks:kind:k:gap_ms, comma separated (instead of "
                         "the grid of --blocks, --loads, --kinds)")
    args = ap.parse_args(argv)
    if args.role == "subject":
        print(json.dumps(subject(int(args.blocks), args.seconds, args.window_s, args.gap_ms)),
              flush=True)
        return []
    if args.role == "load":
        load(args.kind)
        return []
    cap = args.cap if args.cap > 0 else None
    if args.cases:
        cases = [(int(b), kind, int(k), float(g)) for b, kind, k, g in
                 (c.split(":") for c in args.cases.split(","))]
    else:
        cases = [(int(b), kind, int(k), 0.0) for b in args.blocks.split(",")
                 for k in args.loads.split(",")
                 for kind in (args.kinds.split(",") if int(k) else ["none"])]
    rows = []
    for blocks, kind, k, gap in cases:
        row = case(blocks, kind, k, cap, args.seconds, args.window_s, gap)
        rows.append(row)
        print(f"blocks {blocks} load {row['load']:5s} x{k} gap {gap:g} ms cap {cap}: "
              f"{row['block_ms']:.2f} ms/block (fwd {row['fwd_ms']:.2f}; q1 {row['q1_ms']:.2f}, "
              f"q3 {row['q3_ms']:.2f}), cpu share {row['cpu_share']:.2f}", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
