"""An elastic run under real torchrun elastic agents: two agents ("nodes") of 2 ranks each, one
of each group of a cluster file (``HAPT_GROUP``), ``--nnodes 1:2``, c10d rendezvous on a store
this test hosts (as a rendezvous host that outlives the nodes would). After the checkpoint of
step 2, node 1 stops after step 3 and is killed (SIGKILL to its agent and its workers); the
other node's workers fail, its agent restarts them on 2 ranks, rank 0 re-plans on the group
present and every rank resumes from checkpoint-2 with no hand step, and the run finishes
max_steps. The steps after the resume equal, exactly, a run that resumes the same checkpoint
on 2 ranks by hand under the same plan; the step lost with the node (3) is run again with the
loss the 4-rank run had (fp32, rtol 1e-5)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from benchmarks.ranks import free_port, run_ranks

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JOB = HERE / "elastic_job.py"
PAUSE_AT, STEPS, SAVED = 3, 6, 2
CLUSTER = """name: two-nodes
groups:
  - {name: small, gpu: cpu-small, tflops: 0.05, memory_gb: 16, nodes: 1, gpus_per_node: 2}
  - {name: big, gpu: cpu-big, tflops: 0.1, memory_gb: 16, nodes: 1, gpus_per_node: 2}
links:
  - {between: [small, big], bandwidth_gbps: 10, latency_us: 50}
"""


def _agent(port: int, group: str, out: Path, config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HAPT_GROUP": group, "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(REPO)}
    conf = ("is_host=false,join_timeout=60,last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=3,close_timeout=5,read_timeout=30")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", conf,
           "--max-restarts", "2", "--monitor-interval", "0.1", str(JOB), str(out), str(config),
           str(PAUSE_AT)]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _reference(rank: int, world_size: int, root: str) -> dict:
    """Resume checkpoint-2 by hand on 2 ranks under the plan the restarted run chose."""
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import elastic_job

    if rank == 0:
        shutil.copytree(f"{root}/out/checkpoint-{SAVED}", f"{root}/ref/checkpoint-{SAVED}")
        Path(f"{root}/ref.yaml").write_text(f"plan: {root}/out/plan.json\ntimeout_s: 60\n")
    dist.barrier()
    return elastic_job.main(f"{root}/ref", f"{root}/ref.yaml", 0, f"{root}/ref/checkpoint-{SAVED}",
                            accumulation=4)


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory):
    from torch.distributed import TCPStore

    root = tmp_path_factory.mktemp("elastic")
    out = root / "out"
    (root / "cluster.yaml").write_text(CLUSTER)
    (root / "hapt.yaml").write_text("cluster: cluster.yaml\nglobal_batch_size: 8\ntimeout_s: 20\n")
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,  # noqa: F841
                     wait_for_workers=False, timeout=timedelta(seconds=60))
    started = time.monotonic()
    agents = {g: _agent(port, g, out, root / "hapt.yaml", root / f"{g}.log") for g in ("big", "small")}
    try:
        deadline = time.monotonic() + 90
        while len(list(out.glob("paused-*"))) < 2:
            assert time.monotonic() < deadline, _logs(root)
            assert all(a.poll() is None for a in agents.values()), _logs(root)
            time.sleep(0.05)
        paused = [tuple(map(int, p.read_text().split())) for p in out.glob("paused-*")]
        lost = next(g for g, a in agents.items() if a.pid == paused[0][1])
        killed_at, killed_wall = time.monotonic(), time.time()
        paused_s = killed_at - started
        os.killpg(agents[lost].pid, signal.SIGKILL)  # the node: its agent and its workers
        for worker, _ in paused:
            os.kill(worker, signal.SIGKILL)
        survivor = next(g for g in agents if g != lost)
        rc = agents[survivor].wait(timeout=120)
        finished = time.monotonic() - killed_at
    finally:
        for a in agents.values():
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        _end_workers(out)
    before = time.monotonic()
    reference = run_ranks(_reference, 2, str(root), timeout_s=120)
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    resumed = min(x["t"] for x in lines if x["start"] > 0) - killed_wall
    print(f"paused after {paused_s:.1f} s; after the kill: first resumed step logged at "
          f"{resumed:.1f} s, survivor done at {finished:.1f} s; reference {time.monotonic() - before:.1f} s")
    return {"rc": rc, "survivor": survivor, "log": (root / f"{survivor}.log").read_text(),
            "lines": lines, "reference": reference[0].value, "finished_s": finished,
            "logs": _logs(root)}


def _end_workers(out: Path) -> None:
    """Kill the workers still running (torchrun starts each in a session of its own, so they
    outlive their agent), after a failed run."""
    for mark in out.glob("worker-*"):
        pid = int(mark.name.split("-")[1])
        try:
            if "elastic_job.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in root.glob("*.log"))


def test_the_surviving_node_re_plans_and_resumes_with_no_hand_step(elastic_run):
    run = elastic_run
    assert run["rc"] == 0, run["logs"]
    said = (f"restart 1: world 2 (groups {run['survivor']} x2), re-planned, resuming from "
            f"checkpoint-{SAVED}")
    assert said in run["log"], run["logs"]
    first = {x["step"]: x for x in run["lines"] if x["start"] == 0}
    again = {x["step"]: x for x in run["lines"] if x["start"] == 1}
    assert sorted(first) == list(range(1, PAUSE_AT + 1)) and {x["world"] for x in first.values()} == {4}
    # resumed at the checkpoint: contiguous steps to max_steps, on the 2 ranks left
    assert sorted(again) == list(range(SAVED + 1, STEPS + 1)), run["lines"]
    assert {x["world"] for x in again.values()} == {2}
    assert again[PAUSE_AT]["loss"] == pytest.approx(first[PAUSE_AT]["loss"], rel=1e-5)


def test_the_resumed_steps_equal_a_resume_by_hand_on_the_same_plan(elastic_run):
    run = elastic_run
    assert run["rc"] == 0, run["logs"]
    again = {x["step"]: x["loss"] for x in run["lines"] if x["start"] == 1}
    ref = run["reference"]["losses"]
    assert {s: ref[s] for s in again} == again
