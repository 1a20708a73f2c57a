"""An elastic run under ``accelerate launch``: two ``accelerate launch`` processes as two machines
on 127.0.0.1 (``--num_machines 2 --machine_rank R --max_restarts 2 --rdzv_backend c10d``), each
of 2 processes, a HaptAccelerator loop (elastic_loop_job.py) whose cluster file maps each
machine's hostname (``HAPT_HOSTNAME``) to its group. After the state saved at step 2, machine 1
stops after step 5 and is killed (its ``accelerate launch`` process, which runs torchrun's agent,
and its workers, SIGKILL), then started again with the same command. accelerate fixes the node
count (``--nnodes 2``): machine 0's agent restarts its workers once machine 1 is back, rank 0
plans again on the 4 processes and every rank resumes ``checkpoint_0`` with no hand step. The
steps run again (3 to 5) equal the first start's exactly (the same plan), and the run finishes.

accelerate passes torchrun no ``--rdzv-id``: the run's id comes from ``PET_RDZV_ID`` in its
environment (torchrun reads its flags' defaults from ``PET_*``). It is what tells the start a
restart: machine 0's agent restarts its workers when machine 1 waits to join, which counts no
failure, and machine 1's agent is a fresh one.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ranks import free_port

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JOB = HERE / "elastic_loop_job.py"
PAUSE_AT, STEPS, SAVED = 5, 6, 2
CLUSTER = """name: two-machines
groups:
  - {name: big, gpu: cpu-big, tflops: 0.1, memory_gb: 16, nodes: 1, gpus_per_node: 2,
     hosts: [cpu-big-*]}
  - {name: small, gpu: cpu-small, tflops: 0.05, memory_gb: 16, nodes: 1, gpus_per_node: 2,
     hosts: [cpu-small-*]}
links:
  - {between: [small, big], bandwidth_gbps: 10, latency_us: 50}
"""
# accelerate_cpu.yaml's settings (MULTI_GPU with use_cpu: torchrun on CPUs) for two machines,
# without same_network (with it accelerate gives torchrun no rendezvous endpoint)
ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
use_cpu: true
num_machines: 2
num_processes: 4
mixed_precision: 'no'
gpu_ids: all
"""
HOSTS = {0: "cpu-big-0", 1: "cpu-small-0"}


def _machine(rank: int, port: int, root: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HAPT_HOSTNAME": HOSTS[rank], "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ID": "accelerate-test",
           "PYTHONPATH": str(REPO)}
    conf = ("join_timeout=90,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,"
            "close_timeout=5,read_timeout=30")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "accelerate.yaml"), "--num_machines", "2", "--num_processes", "4",
           "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
           str(port), "--rdzv_backend", "c10d", "--rdzv_conf", conf, "--max_restarts", "2",
           "--monitor_interval", "0.1", str(JOB), str(root / "out"), str(root / "cluster.yaml"),
           str(PAUSE_AT)]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_accelerate")
    out = root / "out"
    (root / "cluster.yaml").write_text(CLUSTER)
    (root / "accelerate.yaml").write_text(ACCELERATE)
    port = free_port()
    started = time.monotonic()
    machines = {0: _machine(0, port, root, root / "machine0.log")}
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # machine 0's agent hosts the rendezvous: it must stay
            assert time.monotonic() < deadline and machines[0].poll() is None, _logs(root)
            time.sleep(0.05)
        machines[1] = _machine(1, port, root, root / "machine1.log")
        deadline = time.monotonic() + 120
        while len(list(out.glob("paused-*"))) < 2:
            assert time.monotonic() < deadline, _logs(root)
            assert all(m.poll() is None for m in machines.values()), _logs(root)
            time.sleep(0.05)
        paused = [tuple(map(int, p.read_text().split())) for p in out.glob("paused-*")]
        assert {agent for _, agent in paused} == {machines[1].pid}, (paused, _logs(root))
        paused_s, killed_wall = time.monotonic() - started, time.time()
        os.killpg(machines[1].pid, signal.SIGKILL)  # the machine: its agent and its workers
        for worker, _ in paused:
            os.kill(worker, signal.SIGKILL)
        machines[1].wait()
        back = time.monotonic()
        machines[1] = _machine(1, port, root, root / "machine1.log")  # the same command again
        rcs = {r: m.wait(timeout=150) for r, m in machines.items()}
        finished = time.monotonic() - back
    finally:
        for m in machines.values():
            if m.poll() is None:
                os.killpg(m.pid, signal.SIGKILL)
        _end_workers(out)
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    resumed = [x for x in lines if x["resumed"]]
    first_resumed = min((x["t"] for x in resumed), default=float("nan")) - killed_wall
    print(f"paused after {paused_s:.1f} s; after the kill and the start again: first resumed "
          f"step logged at {first_resumed:.1f} s, both machines done at {finished:.1f} s")
    return {"rcs": rcs, "lines": lines, "machine_logs": [(root / f"machine{i}.log").read_text() for i in (0, 1)],
            "logs": _logs(root)}


def _end_workers(out: Path) -> None:
    """Kill the workers still running (torchrun starts each in a session of its own)."""
    for mark in out.glob("worker-*"):
        pid = int(mark.name.split("-")[1])
        try:
            if "elastic_loop_job.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in root.glob("*.log"))


def test_the_machine_started_again_rejoins_and_the_run_resumes_with_no_hand_step(launched):
    run = launched
    assert run["rcs"] == {0: 0, 1: 0}, run["logs"]
    # rank 0 says it, on whichever machine the rendezvous gave rank 0 after the restart (the
    # groups in the order of the ranks): torch orders the nodes of a rendezvous, not this test
    said = re.compile(r"restart 1: world 4 \(groups (big x2, small x2|small x2, big x2)\), re-planned, "
                      r"resuming from checkpoint_0")
    assert sum(len(said.findall(log)) for log in run["machine_logs"]) == 1, run["logs"]
    first = {x["step"]: x for x in run["lines"] if x["resumed"] is None}
    again = {x["step"]: x for x in run["lines"] if x["resumed"]}
    assert sorted(first) == list(range(1, PAUSE_AT + 1)), run["lines"]
    assert sorted(again) == list(range(SAVED + 1, STEPS + 1)), run["lines"]
    assert {x["world"] for x in run["lines"]} == {4}
    assert {x["resumed"].rsplit("/", 1)[1] for x in again.values()} == {"checkpoint_0"}
    # the same plan on the same processes: the steps run again are the first start's, exactly
    assert {s: again[s]["loss"] for s in range(SAVED + 1, PAUSE_AT + 1)} == \
        {s: first[s]["loss"] for s in range(SAVED + 1, PAUSE_AT + 1)}
