"""Compute slow-down per rank: a cgroup v1 CPU quota, or a delay hook as the fallback.

cgroup (preferred): each rank runs in its own ``cpu`` cgroup with ``cfs_quota_us / cfs_period_us``
= cores allowed. It slows every instruction the process runs, whatever the framework. It needs
root and a writable cgroup v1 ``cpu`` controller (``/sys/fs/cgroup/cpu``). The period is the
shortest the kernel allows for the quota (a quota is at least 1 ms: 2.2 ms for 0.45 cores) so
that a layer of a few milliseconds sees the average speed, not a burst of full speed on quota
saved up while the rank waited (as a GPU does not compute faster after idling).

hook (fallback): ``benchmarks/testbed/site/sitecustomize.py`` is put first on ``PYTHONPATH``;
with ``HAPT_TESTBED_SLOWDOWN`` set, the process's main thread spends ``factor`` times the CPU time
of all its work (modules, functional ops, the loss, optimizer steps): the work is charged at the
end of each outermost forward, each backward, each optimizer step, send and wait, and paid by
keeping the core busy. It applies to any PyTorch framework alike.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_CGROUP_ROOT", "CgroupQuotas", "cgroup_available", "hook_env", "SITE_DIR"]

CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
SITE_DIR = Path(__file__).resolve().parent / "site"
MIN_QUOTA_US = 1_000
"""The kernel refuses a quota under 1 ms."""
MAX_PERIOD_US = 1_000_000


def period_us(cores: float) -> int:
    """The shortest quota period for ``cores`` whose quota the kernel accepts. With the 10 ms
    period used before, a 0.45-core rank that had waited ran its next 4.5 ms of work at full
    speed: on the testbed's shaped race the fast ranks, which wait most, computed a block's
    forward in 4.6 ms against 7.8 ms profiled (busy), and the race ran 14% faster than
    predicted."""
    return max(MIN_QUOTA_US, min(MAX_PERIOD_US, math.ceil(MIN_QUOTA_US / cores)))


def cgroup_available() -> tuple[bool, str]:
    """Whether per-rank CPU quotas can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "not root (cgroup quotas need root)"
    if not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        return False, f"no cgroup v1 cpu controller at {CPU_CGROUP_ROOT}"
    if not os.access(CPU_CGROUP_ROOT, os.W_OK):
        return False, f"{CPU_CGROUP_ROOT} is not writable"
    return True, "cgroup v1 cpu quota"


@dataclass
class CgroupQuotas:
    """One parent cgroup per testbed (unique ``tag``), one child per rank."""

    tag: str

    @property
    def parent(self) -> Path:
        return CPU_CGROUP_ROOT / f"hapt_tb_{self.tag}"

    def rank_dir(self, rank: int) -> Path:
        return self.parent / f"rank{rank}"

    def create(self, rank: int, cores: float, shares: int = 16384) -> Path:
        """A rank's cgroup of ``cores`` CPU quota. Its ``shares`` (16x a plain process's) make
        the quota, not other busy processes of the machine, what limits the rank."""
        d = self.rank_dir(rank)
        d.mkdir(parents=True, exist_ok=True)
        # shares weigh siblings: the parent competes with the machine's other processes, so
        # it carries the weight of all its ranks
        ranks = sum(1 for c in self.parent.iterdir() if c.is_dir())
        (self.parent / "cpu.shares").write_text(str(min(262144, shares * ranks)))
        (d / "cpu.shares").write_text(str(shares))
        period = period_us(cores)
        (d / "cpu.cfs_period_us").write_text(str(period))
        (d / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US, round(cores * period))))
        return d

    def join(self, rank: int, pid: int | None = None) -> None:
        """Move ``pid`` (default: the calling process, as a Popen preexec_fn does) in."""
        (self.rank_dir(rank) / "cgroup.procs").write_text(str(pid or os.getpid()))

    def cleanup(self) -> None:
        """Move any process still inside back to the root cgroup, then remove the cgroups."""
        if not self.parent.exists():
            return
        children = sorted(p for p in self.parent.iterdir() if p.is_dir())
        for d in children + [self.parent]:
            for pid in _read_pids(d):
                try:
                    (CPU_CGROUP_ROOT / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # the process ended in between
            try:
                d.rmdir()
            except OSError:
                pass


def _read_pids(d: Path) -> list[str]:
    try:
        return (d / "cgroup.procs").read_text().split()
    except OSError:
        return []


def hook_env(factor: float) -> dict[str, str]:
    """Environment that makes the sitecustomize delay hook slow a process by ``factor``."""
    path = os.environ.get("PYTHONPATH", "")
    return {"HAPT_TESTBED_SLOWDOWN": f"{factor:g}",
            "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else "")}
