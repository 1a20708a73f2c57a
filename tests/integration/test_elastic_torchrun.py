"""An elastic run under real torchrun elastic agents: two agents ("nodes") of 2 ranks each, one
of each group of a cluster file (``HAPT_GROUP``), ``--nnodes 1:2``, c10d rendezvous on a store
this test hosts (as a rendezvous host that outlives the nodes would).

A node is lost: after the checkpoint of step 2, node 1 stops after step 3 and is killed (SIGKILL
to its agent and its workers); the other node's workers fail, its agent restarts them on 2
ranks, rank 0 re-plans on the group present and every rank resumes from checkpoint-2 with no
hand step. The node comes back: once the 2 ranks have written checkpoint-4 and run step 5, the
lost node's agent is started again with the same command; the running agent restarts its
workers (a node joining counts no failure: ``hapt_elastic.json`` names the run), rank 0 re-plans
on both groups, every rank resumes from checkpoint-4, and the run finishes max_steps on 4 ranks.

The steps of each start equal, exactly, a run that resumes the same checkpoint by hand on the
same ranks under the same plan; a step run again on the other world has the loss it had there
(step 3 after the loss, step 5 after the return; fp32, rtol 1e-5)."""
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
PAUSE_AT, REJOIN_AT, STEPS, SAVED, SAVED_AGAIN = 3, 5, 8, 2, 4
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
    # keep-alives of 1 s, 5 missed before an agent is taken for dead: with 2 missed, on this busy
    # machine, a node that came back once took the running agent for dead and formed a job alone
    conf = ("is_host=false,join_timeout=60,last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=5,close_timeout=5,read_timeout=30")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", conf,
           "--max-restarts", "2", "--monitor-interval", "0.1", str(JOB), str(out), str(config),
           str(PAUSE_AT), str(REJOIN_AT)]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _reference(rank: int, world_size: int, root: str, step: int, plan: str) -> dict:
    """Resume checkpoint-``step`` by hand on ``world_size`` ranks under the plan ``plan`` (the
    one the elastic run chose for that start)."""
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import elastic_job

    ref = f"{root}/ref{world_size}"
    if rank == 0:
        shutil.copytree(f"{root}/out/checkpoint-{step}", f"{ref}/checkpoint-{step}")
        Path(f"{ref}.yaml").write_text(f"plan: {plan}\ntimeout_s: 60\n")
    dist.barrier()
    return elastic_job.main(ref, f"{ref}.yaml", 0, f"{ref}/checkpoint-{step}",
                            accumulation=8 // world_size)


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
        agents[lost].wait()
        deadline = time.monotonic() + 90
        while not (out / "waiting-0").exists():  # 2 ranks: checkpoint-4 written, step 5 run
            assert time.monotonic() < deadline, _logs(root)
            assert agents[survivor].poll() is None, _logs(root)
            time.sleep(0.05)
        back_at, back_wall = time.monotonic(), time.time()
        agents[lost] = _agent(port, lost, out, root / "hapt.yaml", root / f"{lost}.log")
        rcs = {g: a.wait(timeout=120) for g, a in agents.items()}
        finished = time.monotonic() - back_at
    finally:
        for a in agents.values():
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        _end_workers(out)
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    starts = list(dict.fromkeys(x["pid"] for x in lines))  # rank 0's pid: one per start
    assert len(starts) == 3, (lines, _logs(root))
    phases = [{x["step"]: x for x in lines if x["pid"] == pid} for pid in starts]
    before = time.monotonic()
    # each start's plan: the one it wrote its first checkpoint under
    ref2 = run_ranks(_reference, 2, str(root), SAVED, str(out / f"checkpoint-{SAVED_AGAIN}" / "plan.json"),
                     timeout_s=120)
    ref4 = run_ranks(_reference, 4, str(root), SAVED_AGAIN, str(out / f"checkpoint-{STEPS}" / "plan.json"),
                     timeout_s=120)
    resumed = min(phases[1][s]["t"] for s in phases[1]) - killed_wall
    rejoined = min(phases[2][s]["t"] for s in phases[2]) - back_wall
    print(f"paused after {paused_s:.1f} s; after the kill: first resumed step logged at "
          f"{resumed:.1f} s; after the start again: first step on 4 ranks logged at {rejoined:.1f} s, "
          f"both done at {finished:.1f} s; references {time.monotonic() - before:.1f} s")
    return {"rcs": rcs, "survivor": survivor, "lost": lost,
            "log": (root / f"{survivor}.log").read_text(),
            "both": "".join((root / f"{g}.log").read_text() for g in agents), "phases": phases,
            "reference": {2: ref2[0].value, 4: ref4[0].value}, "logs": _logs(root)}


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
    assert run["rcs"] == {"big": 0, "small": 0}, run["logs"]
    said = (f"restart 1: world 2 (groups {run['survivor']} x2), re-planned, resuming from "
            f"checkpoint-{SAVED}")
    assert said in run["log"], run["logs"]
    first, left, _ = run["phases"]
    assert sorted(first) == list(range(1, PAUSE_AT + 1)) and {x["world"] for x in first.values()} == {4}
    # resumed at the checkpoint: contiguous steps, on the 2 ranks left, until the node is back
    assert sorted(left) == list(range(SAVED + 1, REJOIN_AT + 1)), run["phases"]
    assert {x["world"] for x in left.values()} == {2}
    assert left[PAUSE_AT]["loss"] == pytest.approx(first[PAUSE_AT]["loss"], rel=1e-5)


def test_the_node_that_comes_back_rejoins_and_the_run_resumes_on_4_ranks(elastic_run):
    run = elastic_run
    assert run["rcs"] == {"big": 0, "small": 0}, run["logs"]
    said = ("restart 2: world 4 (groups big x2, small x2), re-planned, resuming from "
            f"checkpoint-{SAVED_AGAIN}")
    assert said in run["both"], run["logs"]  # rank 0's node says it
    _, left, back = run["phases"]
    assert sorted(back) == list(range(SAVED_AGAIN + 1, STEPS + 1)), run["phases"]
    assert {x["world"] for x in back.values()} == {4}
    assert back[REJOIN_AT]["loss"] == pytest.approx(left[REJOIN_AT]["loss"], rel=1e-5)


def test_each_starts_steps_equal_a_resume_by_hand_on_the_same_plan(elastic_run):
    run = elastic_run
    assert run["rcs"] == {"big": 0, "small": 0}, run["logs"]
    for phase, world in ((run["phases"][1], 2), (run["phases"][2], 4)):
        ref = run["reference"][world]["losses"]
        assert {s: ref[s] for s in phase} == {s: x["loss"] for s, x in phase.items()}, world
