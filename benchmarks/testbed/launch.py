"""Start a testbed (slow-downs and links), run one command per rank on it, and tear it down.

```python
with Testbed(load_testbed("two_speed.yaml")) as tb:
    results = tb.run([sys.executable, "train.py"], timeout_s=300)
```

Every namespace, link and cgroup it makes carries a random tag and is removed on exit, on an
exception, on SIGTERM and at interpreter exit (atexit), whichever comes first.
"""
from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cpu import SITE_DIR, CgroupQuotas, cgroup_available, hook_env
from .net import NetnsLinks, netns_available, shim_env
from .spec import TestbedError, TestbedSpec

__all__ = ["Mechanisms", "RankResult", "Testbed", "free_port"]


@dataclass(frozen=True)
class Mechanisms:
    slowdown: str
    """'cgroup' | 'hook' | 'none' (every group at slowdown 1.0)."""
    network: str
    """'netns' | 'shim' | 'none' (no links)."""
    notes: tuple[str, ...]
    """Why a fallback was taken, and what is not emulated; printed by benchmarks."""


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int
    output: str
    """stdout and stderr together."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Testbed:
    """An emulated cluster of CPU processes. Use as a context manager."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, spec: TestbedSpec, tag: str | None = None) -> None:
        self.spec = spec
        self.tag = tag or secrets.token_hex(2)
        self.mechanisms = Mechanisms("none", "none", ())
        self._quotas: CgroupQuotas | None = None
        self._links: NetnsLinks | None = None
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    # -- set-up and tear-down -------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        atexit.register(self.cleanup)
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self.mechanisms = self._setup()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
        atexit.unregister(self.cleanup)
        if hasattr(self, "_old_term"):
            signal.signal(signal.SIGTERM, self._old_term)

    def _on_term(self, signum, frame) -> None:
        self.cleanup()
        raise SystemExit(128 + signum)

    def _setup(self) -> Mechanisms:
        notes: list[str] = []
        slowdown = self._setup_slowdown(notes)
        network = self._setup_network(notes)
        return Mechanisms(slowdown, network, tuple(notes))

    def _setup_slowdown(self, notes: list[str]) -> str:
        want = self.spec.slowdown_mechanism
        ok, why = cgroup_available()
        if want == "cgroup" and not ok:
            raise TestbedError(f"slowdown: cgroup was asked for but {why}; use 'hook' or 'auto'")
        if want == "hook" or not ok:
            if want == "auto":
                notes.append(f"compute slow-down by delay hook ({why})")
            self._setup_cap(ok, why, notes)
            return "hook" if any(g.slowdown > 1 for g in self.spec.groups) else "none"
        self._make_quotas(lambda r: self.spec.cpu_quota(self.spec.group_of_rank(r)))
        return "cgroup"

    def _make_quotas(self, cores_of_rank) -> None:
        self._quotas = CgroupQuotas(self.tag)
        for r in range(self.spec.world_size):
            self._quotas.create(r, cores_of_rank(r))

    def _setup_cap(self, ok: bool, why: str, notes: list[str]) -> None:
        """The equal per-rank quota of ``cpu_cap`` under the hook slow-down, where possible."""
        cap = self.spec.cpu_cap
        if cap is None:
            return
        if not ok:
            notes.append(f"no per-rank CPU cap ({why}): a rank runs faster while its peers wait")
            return
        self._make_quotas(lambda r: cap)
        notes.append(f"every rank capped at {cap:g} cores (cgroup quota)")

    def _setup_network(self, notes: list[str]) -> str:
        if not self.spec.links:
            return "none"
        want = self.spec.network_mechanism
        ok, why = netns_available()
        if want == "netns" and not ok:
            raise TestbedError(f"network: netns was asked for but {why}; use 'shim' or 'auto'")
        if want == "shim" or not ok:
            notes.append(f"links shaped by the p2p shim on loopback ({why if not ok else 'asked'})")
            return "shim"
        self._links = NetnsLinks(self.spec, self.tag)
        self._links.setup()
        if any(l.latency_ms for l in self.spec.links):
            notes.append("latency added by the p2p shim (no netem in this kernel)")
        return "netns"

    def cleanup(self) -> None:
        """Stop our ranks, remove namespaces, links and cgroups. Safe to call twice."""
        with self._lock:
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self._procs.clear()
            if self._links is not None:
                self._links.cleanup()
                self._links = None
            if self._quotas is not None:
                self._quotas.cleanup()
                self._quotas = None

    # -- running ranks --------------------------------------------------------------------
    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """What one rank's process gets on top of the caller's environment."""
        group = self.spec.group_of_rank(rank)
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.spec.world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
               "OMP_NUM_THREADS": "1", "HAPT_TESTBED_GROUP": group.name}
        extra: dict[str, str] = {}
        if self.mechanisms.slowdown == "hook" and group.slowdown > 1:
            extra.update(hook_env(group.slowdown))
        if self.mechanisms.network == "netns":
            env.update(self._links.env())
        if self.mechanisms.network != "none":
            extra.update(shim_env(self.spec, bandwidth=self.mechanisms.network == "shim"))
        if extra:
            path = os.environ.get("PYTHONPATH", "")
            extra["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + path if path else "")
        env.update(extra)
        return env

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 600,
            cwd: str | Path | None = None) -> list[RankResult]:
        """Run ``argv`` once per rank; if one rank fails or time runs out, stop them all."""
        port = free_port()
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(self.spec.world_size)]
        try:
            procs = [self._start(r, argv, env, port, logs[r], cwd)
                     for r in range(self.spec.world_size)]
            self._wait(procs, timeout_s)
            results = []
            for r, (p, log) in enumerate(zip(procs, logs)):
                log.seek(0)
                results.append(RankResult(r, p.returncode, log.read()))
            return results
        finally:
            for log in logs:
                log.close()
            with self._lock:
                self._procs.clear()

    def _start(self, rank, argv, env, port, log, cwd) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.update(self.rank_env(rank, port))
        cmd = self._links.wrap(rank, argv) if self.mechanisms.network == "netns" else argv
        quotas, cpu = self._quotas, self._cpu_of(rank)

        def preexec() -> None:
            quotas.join(rank)
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
        preexec = preexec if quotas is not None else None
        p = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=preexec, cwd=cwd)
        with self._lock:
            self._procs.append(p)
        return p

    def _cpu_of(self, rank: int) -> int | None:
        """The core a capped rank is pinned to (round robin over the cores this process may
        use), or None: not pinned (no quotas, ``pin_cpus`` off, or a single core).

        A CPU quota is handed to a CPU's run queue in slices of 5 ms
        (``sched_cfs_bandwidth_slice_us``), more than a 0.45-core quota's 1 ms per 2.2 ms
        period: a rank whose main thread and communication threads run on two cores at once
        can find its quota on the other core and be throttled with quota left, which a profile
        (one thread computing) does not see and training (threads sending) does. Pinned, the
        rank's threads share one run queue. The race with and without it: docs/benchmarks.md."""
        cpus = sorted(os.sched_getaffinity(0))
        if self._quotas is None or not self.spec.pin_cpus or len(cpus) < 2:
            return None
        return cpus[rank % len(cpus)]

    @staticmethod
    def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                time.sleep(0.5 if failed else 0)  # let a failing rank's peers print why
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                return
            time.sleep(0.05)
