"""Smoke probe run on every rank of a testbed: compute speed and a cross-group transfer.

Prints one JSON line: {"rank", "group", "compute_s" (wall), "compute_cpu_s" (main-thread CPU),
"send_s" (rank 0 only), "bytes"}.
Used by tests/test_testbed.py to check that the slow-downs and links take effect.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _compute_s(model: torch.nn.Module, x: torch.Tensor, reps: int, windows: int = 1
               ) -> tuple[float, float]:
    """Seconds per forward+backward, (wall, main-thread CPU): the fastest of ``windows`` windows
    of ``reps`` passes.

    A window of many short layers spans many quota periods, so it sees the average speed;
    the fastest window is the one least disturbed by the machine's other jobs. The CPU figure is
    what the delay hook scales (it spins the main thread for ``factor - 1`` times the CPU time of
    the work), so it shows the slow-down even where other jobs crowd the cores and stretch every
    rank's wall time alike.
    """
    best_wall = best_cpu = float("inf")
    for _ in range(windows):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            model(x).sum().backward()
        best_wall = min(best_wall, (time.perf_counter() - t0) / reps)
        best_cpu = min(best_cpu, (time.thread_time() - c0) / reps)
    return best_wall, best_cpu


def main() -> int:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 4_000_000
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(64, 256)
    _compute_s(model, x, 3)
    compute, compute_cpu = _compute_s(model, x, 10, windows=4)
    dist.barrier()
    out = {"rank": rank, "group": os.environ.get("HAPT_TESTBED_GROUP", ""),
           "compute_s": compute, "compute_cpu_s": compute_cpu, "bytes": nbytes}
    buf = torch.zeros(nbytes // 4)
    peer = world - 1  # the last rank sits in the last group
    if rank in (0, peer) and peer != 0:
        for _ in range(2):  # the first transfer also sets the connection up
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf[:1], peer)  # ack: the data has arrived
            else:
                dist.recv(buf, 0)
                dist.send(buf[:1], 0)
            out["send_s"] = time.perf_counter() - t0
    dist.barrier()
    hooks = sys.modules.get("testbed_hooks")  # loaded by the testbed's sitecustomize, if at all
    pacer = getattr(hooks, "_PACER", None)
    if pacer is not None:
        out["work_cpu_s"], out["added_cpu_s"] = pacer.charged, pacer.paid
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
