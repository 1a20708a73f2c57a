"""The emulated testbed: its file format, and a smoke run that shows slow-downs and links bite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.testbed import Testbed, TestbedError, TestbedSpec, load_testbed  # noqa: E402
from benchmarks.testbed.cpu import CPU_CGROUP_ROOT, cgroup_available  # noqa: E402
from benchmarks.testbed.net import netns_available  # noqa: E402

TWO_GROUPS = {"name": "smoke", "cpu_per_rank": 0.9,
              "groups": [{"name": "fast", "ranks": 1}, {"name": "slow", "ranks": 1,
                                                          "slowdown": 2.5}],
              "links": [{"between": ["fast", "slow"], "bandwidth_mbps": 100, "latency_ms": 40}]}


def test_file_format_and_rank_numbering(tmp_path):
    f = tmp_path / "tb.yaml"
    f.write_text("name: t\ngroups:\n  - {name: a, ranks: 2}\n  - {name: b, ranks: 3, slowdown: 2}\n"
                 "links:\n  - {between: [a, b], bandwidth_mbps: 50}\n")
    spec = load_testbed(f)
    assert spec.world_size == 5 and spec.ranks_of("b") == [2, 3, 4]
    assert spec.group_of_rank(1).name == "a" and spec.link("b", "a").bandwidth_mbps == 50
    assert spec.cpu_quota(spec.groups[1]) == pytest.approx(spec.cpu_per_rank / 2)
    assert TestbedSpec.from_dict(spec.to_dict()) == spec
    assert spec.cpu_cap is None
    capped = TestbedSpec.from_dict({**spec.to_dict(), "cpu_cap": 0.4})
    assert capped.cpu_cap == 0.4 and TestbedSpec.from_dict(capped.to_dict()) == capped
    assert spec.pin_cpus and not TestbedSpec.from_dict({**spec.to_dict(),
                                                         "pin_cpus": False}).pin_cpus


@pytest.mark.parametrize("change, field", [
    ({"cpu_cap": 0}, "cpu_cap"),
    ({"groups": [{"name": "a", "ranks": 0}]}, "groups[0].ranks"),
    ({"groups": [{"name": "a", "slowdown": 0.5}]}, "groups[0].slowdown"),
    ({"links": [{"between": ["fast", "nope"], "bandwidth_mbps": 1}]}, "links[0].between"),
    ({"links": [{"between": ["fast", "slow"], "bandwidth_mbps": -1}]}, "links[0].bandwidth_mbps"),
    ({"slowdown": "magic"}, "slowdown"),
    ({"pin_cpus": "yes"}, "pin_cpus"),
])
def test_bad_file_names_the_field(change, field):
    with pytest.raises(TestbedError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TestbedSpec.from_dict({**TWO_GROUPS, **change})


def _leftovers(tag: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line for line in netns.splitlines() if f"hapt_tb_{tag}" in line]
    return left + ([str(CPU_CGROUP_ROOT / f"hapt_tb_{tag}")]
                   if (CPU_CGROUP_ROOT / f"hapt_tb_{tag}").exists() else [])


@pytest.mark.multiproc
def test_smoke_slowdown_and_shaped_link():
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"this machine cannot make network namespaces: {why}")
    # the delay hook: a slow-down relative to the rank's own speed, steady on a busy machine
    spec = TestbedSpec.from_dict({**TWO_GROUPS, "slowdown": "hook", "network": "netns"})
    with Testbed(spec) as tb:
        tag = tb.tag
        assert tb.mechanisms.network == "netns" and tb.mechanisms.slowdown == "hook"
        results = tb.run([sys.executable, "-m", "benchmarks.testbed.probe", "4000000"],
                         timeout_s=240, cwd=ROOT)
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    out = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
    # the hook's slow-down in the CPU time it makes the slow rank spend (wall time on 2 shared
    # cores also carries whatever else the machine runs, and is reported by the probe only)
    assert out[1]["compute_cpu_s"] > 1.5 * out[0]["compute_cpu_s"], out
    # 4 MB at 100 Mbit/s is 0.32 s (loopback: milliseconds); + 40 ms each way for the reply
    assert 0.32 + 0.08 <= out[0]["send_s"] < 3.0
    assert _leftovers(tag) == []


@pytest.mark.multiproc
def test_cgroup_quota_applies_and_is_removed():
    ok, why = cgroup_available()
    if not ok:
        pytest.skip(f"no per-rank CPU quota here: {why}")
    spec = TestbedSpec.from_dict({"name": "q", "cpu_per_rank": 0.8, "slowdown": "cgroup",
                                  "groups": [{"name": "g", "ranks": 1, "slowdown": 2}]})
    with Testbed(spec) as tb:
        tag = tb.tag
        [r] = tb.run(["cat", "/proc/self/cgroup"], timeout_s=30)
        rank_dir = CPU_CGROUP_ROOT / f"hapt_tb_{tag}" / "rank0"
        quota = int((rank_dir / "cpu.cfs_quota_us").read_text())
        period = int((rank_dir / "cpu.cfs_period_us").read_text())
    assert r.returncode == 0 and f"hapt_tb_{tag}/rank0" in r.output
    assert quota / period == pytest.approx(0.4)
    assert _leftovers(tag) == []


@pytest.mark.multiproc
def test_cpu_cap_gives_every_rank_the_same_quota_under_the_hook():
    ok, why = cgroup_available()
    if not ok:
        pytest.skip(f"no per-rank CPU quota here: {why}")
    spec = TestbedSpec.from_dict({**TWO_GROUPS, "slowdown": "hook", "network": "shim",
                                  "cpu_cap": 0.3})
    with Testbed(spec) as tb:
        tag = tb.tag
        assert tb.mechanisms.slowdown == "hook"
        results = tb.run(["sh", "-c", "cat /proc/self/cgroup; grep Cpus_allowed_list "
                          "/proc/self/status"], timeout_s=30)
        read = lambda r, f: int((CPU_CGROUP_ROOT / f"hapt_tb_{tag}" / f"rank{r}" / f)  # noqa: E731
                                .read_text())
        quotas = [(read(r, "cpu.cfs_quota_us"), read(r, "cpu.cfs_period_us")) for r in range(2)]
    assert all(r.returncode == 0 and f"hapt_tb_{tag}/rank{r.rank}" in r.output
               for r in results), [r.output for r in results]
    # 0.3 cores, slow rank as fast one, over the shortest period whose quota the kernel takes
    # (1 ms at least): 1 ms of every 3.334 ms
    assert quotas == [(1000, 3334), (1000, 3334)]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:  # each capped rank on a core of its own, round robin
        assert [r.output.split("Cpus_allowed_list:")[1].strip() for r in results] == \
            [str(cpus[r % len(cpus)]) for r in range(2)]
    assert _leftovers(tag) == []


@pytest.mark.multiproc
def test_cleanup_when_the_run_fails():
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"this machine cannot make network namespaces: {why}")
    spec = TestbedSpec.from_dict({**TWO_GROUPS, "network": "netns"})
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(spec) as tb:
            tag = tb.tag
            assert any(f"hapt_tb_{tag}" in line for line in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines())
            results = tb.run(["sh", "-c", "exit 3"], timeout_s=30)
            assert [r.returncode for r in results] == [3, 3]
            raise RuntimeError("boom")
    assert _leftovers(tag) == []


def _hooks():
    """A fresh copy of the testbed's torch patches (benchmarks/testbed/site/testbed_hooks.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "testbed_hooks_under_test", ROOT / "benchmarks/testbed/site/testbed_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slowdown_charges_work_outside_modules_and_undoes_itself():
    import torch
    hooks = _hooks()
    orig_wait = torch._C._distributed_c10d.Work.wait
    orig_backward = torch.autograd._engine_run_backward
    [handle] = hooks.install_slowdown(3.0)
    pacer = hooks._PACER
    try:
        w = torch.randn(384, 384, requires_grad=True)
        x = torch.randn(384, 384)
        # functional ops and a loss outside any module: charged at the end of the backward
        (torch.tanh(x @ w) @ w).square().mean().backward()
        after_backward = pacer.charged
        opt = torch.optim.SGD([w], lr=0.1)
        opt.step()  # the optimizer step is a point too
    finally:
        handle.remove()
    assert after_backward > 0 and pacer.charged > after_backward
    # every charged CPU second was paid twice more (factor 3), up to what a last spin overshot
    assert pacer.paid == pytest.approx(2.0 * pacer.charged, abs=2e-3)
    assert hooks._PACER is None
    assert torch._C._distributed_c10d.Work.wait is orig_wait
    assert torch.autograd._engine_run_backward is orig_backward


def test_link_queues_transfers_at_its_rate():
    link = _hooks()._Link(mbps=8.0, latency_ms=50.0)
    first = link.arrival(1_000_000)   # 8 Mbit at 8 Mbit/s: 1 s on the wire
    second = link.arrival(500_000)    # waits for the first, then 0.5 s
    assert second - first == pytest.approx(0.5, abs=1e-9)
    assert link.free_at == pytest.approx(second - 0.05, abs=1e-9)


SHIM_SCRIPT = """
import json, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
buf = torch.zeros(250_000)  # 1 MB: 2 s at 4 Mbit/s
dist.barrier()
if dist.get_rank() == 0:
    work = dist.isend(buf, 1)
    returned = time.time()
    work.wait()
    print(json.dumps({"returned": returned}))
else:
    dist.recv(buf, 0)
    print(json.dumps({"received": time.time()}))
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_shim_send_leaves_the_sender_free_during_the_transfer(tmp_path):
    script = tmp_path / "shim_send.py"
    script.write_text(SHIM_SCRIPT)
    spec = TestbedSpec.from_dict({"name": "shim", "network": "shim",
                                  "groups": [{"name": "a", "ranks": 1}, {"name": "b", "ranks": 1}],
                                  "links": [{"between": ["a", "b"], "bandwidth_mbps": 4,
                                             "latency_ms": 0}]})
    with Testbed(spec) as tb:
        assert tb.mechanisms.network == "shim"
        results = tb.run([sys.executable, str(script)], timeout_s=120, cwd=ROOT)
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    out = {}
    for r in results:
        out.update(json.loads(r.output.strip().splitlines()[-1]))
    # the old shim held the caller for the whole 2 s transfer; isend now returns at once
    assert out["returned"] < out["received"] - 1.0
