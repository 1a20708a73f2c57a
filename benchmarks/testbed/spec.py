"""The testbed file: groups of CPU ranks made unlike on purpose, and the links between groups.

```yaml
name: two-speed
cpu_per_rank: 0.45          # CPU cores of quota a rank with slowdown 1.0 gets
cpu_cap: 0.45               # optional, with the hook: every rank's quota (see TestbedSpec)
pin_cpus: true              # ranks under a quota get one core each, round robin
slowdown: auto              # auto | cgroup | hook  (how compute is slowed)
network: auto               # auto | netns | shim   (how links are shaped)
groups:
  - {name: fast, ranks: 2, slowdown: 1.0}
  - {name: slow, ranks: 2, slowdown: 2.5}
links:
  - {between: [fast, slow], bandwidth_mbps: 100, latency_ms: 2}
```

Ranks are numbered group by group in file order. The planner never reads this file: it learns the
speeds and links by profiling the processes the testbed starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TestbedError", "GroupSpec", "LinkShape", "TestbedSpec", "load_testbed"]

SLOWDOWN_MECHANISMS = ("auto", "cgroup", "hook")
NETWORK_MECHANISMS = ("auto", "netns", "shim")


class TestbedError(ValueError):
    """A testbed file that is wrong, or a machine that cannot build it; the message says the fix."""

    __test__ = False  # not a pytest test class despite the name


@dataclass(frozen=True)
class GroupSpec:
    name: str
    """Group name; ranks of one group share a network namespace (fast local links)."""
    ranks: int
    """Number of processes in the group."""
    slowdown: float = 1.0
    """Compute slow-down factor (>= 1): 2.5 means each layer takes 2.5x as long."""


@dataclass(frozen=True)
class LinkShape:
    a: str
    b: str
    bandwidth_mbps: float
    """Megabits per second, each direction."""
    latency_ms: float = 0.0
    """One-way latency; shaped only by the shim (this kernel has no netem), see docs/testbed.md."""


@dataclass(frozen=True)
class TestbedSpec:
    __test__ = False

    name: str
    groups: tuple[GroupSpec, ...]
    links: tuple[LinkShape, ...]
    cpu_per_rank: float = 0.45
    """CPU cores of quota for a rank of slowdown 1.0 (cgroup mechanism); keep the sum under the
    machine's cores so that ranks do not also slow each other down."""
    slowdown_mechanism: str = "auto"
    network_mechanism: str = "auto"
    cpu_cap: float | None = None
    """With the hook slow-down: every rank, fast or slow, also gets a cgroup quota of this many
    cores. Ranks that share a machine's cores otherwise run faster whenever their peers wait
    (a pipeline's ranks often do) than when all are busy, so a speed measured by profiling
    would not be the speed of training; under an equal cap each rank has its own share, as
    each GPU is its own device. Keep ``cap * world_size`` under the machine's free cores.
    Ignored (with a note) where cgroups cannot be made."""
    pin_cpus: bool = True
    """Ranks under a CPU quota are pinned to one core each, round robin (see
    ``Testbed._cpu_of``)."""

    @property
    def world_size(self) -> int:
        return sum(g.ranks for g in self.groups)

    def ranks_of(self, group: str) -> list[int]:
        start = 0
        for g in self.groups:
            if g.name == group:
                return list(range(start, start + g.ranks))
            start += g.ranks
        raise TestbedError(f"no group named {group!r}; groups are {[g.name for g in self.groups]}")

    def group_of_rank(self, rank: int) -> GroupSpec:
        for g in self.groups:
            if rank in self.ranks_of(g.name):
                return g
        raise TestbedError(f"rank {rank} is outside the testbed's {self.world_size} ranks")

    def link(self, a: str, b: str) -> LinkShape | None:
        for l in self.links:
            if {l.a, l.b} == {a, b}:
                return l
        return None

    def cpu_quota(self, group: GroupSpec) -> float:
        """Cores of quota for one rank of ``group``."""
        return self.cpu_per_rank / group.slowdown

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TestbedSpec":
        if not isinstance(d, dict):
            raise TestbedError("the testbed file must be a mapping with 'groups' and 'links'")
        groups = tuple(_group(i, g) for i, g in enumerate(_list(d, "groups")))
        if not groups:
            raise TestbedError("'groups' is empty; list at least one group {name, ranks}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise TestbedError(f"group names repeat in {names}; give each group its own name")
        links = tuple(_link(i, l, set(names)) for i, l in enumerate(d.get("links") or []))
        spec = cls(name=str(d.get("name", "testbed")), groups=groups, links=links,
                   cpu_per_rank=_positive(d, "cpu_per_rank", 0.45, "cpu_per_rank"),
                   slowdown_mechanism=str(d.get("slowdown", "auto")),
                   network_mechanism=str(d.get("network", "auto")),
                   cpu_cap=(_positive(d, "cpu_cap", 1.0, "cpu_cap")
                            if d.get("cpu_cap") is not None else None),
                   pin_cpus=_flag(d, "pin_cpus", True))
        if spec.slowdown_mechanism not in SLOWDOWN_MECHANISMS:
            raise TestbedError(f"slowdown: {spec.slowdown_mechanism!r} is not one of "
                               f"{SLOWDOWN_MECHANISMS}")
        if spec.network_mechanism not in NETWORK_MECHANISMS:
            raise TestbedError(f"network: {spec.network_mechanism!r} is not one of "
                               f"{NETWORK_MECHANISMS}")
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cpu_per_rank": self.cpu_per_rank,
                "slowdown": self.slowdown_mechanism, "network": self.network_mechanism,
                **({"cpu_cap": self.cpu_cap} if self.cpu_cap is not None else {}),
                "pin_cpus": self.pin_cpus,
                "groups": [{"name": g.name, "ranks": g.ranks, "slowdown": g.slowdown}
                           for g in self.groups],
                "links": [{"between": [l.a, l.b], "bandwidth_mbps": l.bandwidth_mbps,
                           "latency_ms": l.latency_ms} for l in self.links]}


def load_testbed(path: str | Path) -> TestbedSpec:
    p = Path(path)
    if not p.is_file():
        raise TestbedError(f"testbed file {p} does not exist; pass the path of a YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TestbedError(f"{p} is not valid YAML ({e}); fix the syntax") from None
    return TestbedSpec.from_dict(data)


def _list(d: dict, key: str) -> list:
    v = d.get(key)
    if not isinstance(v, list):
        raise TestbedError(f"'{key}' must be a list; got {type(v).__name__}")
    return v


def _flag(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise TestbedError(f"{key} must be true or false; got {v!r}")
    return v


def _positive(d: dict, key: str, default: float, where: str) -> float:
    try:
        v = float(d.get(key, default))
    except (TypeError, ValueError):
        raise TestbedError(f"{where} must be a number; got {d.get(key)!r}") from None
    if not v > 0:
        raise TestbedError(f"{where} must be positive; got {v}")
    return v


def _group(i: int, g: Any) -> GroupSpec:
    where = f"groups[{i}]"
    if not isinstance(g, dict) or "name" not in g:
        raise TestbedError(f"{where} must be a mapping with 'name' and 'ranks'")
    ranks = g.get("ranks", 1)
    if not isinstance(ranks, int) or ranks < 1:
        raise TestbedError(f"{where}.ranks must be a positive integer; got {ranks!r}")
    slowdown = _positive(g, "slowdown", 1.0, f"{where}.slowdown")
    if slowdown < 1.0:
        raise TestbedError(f"{where}.slowdown is {slowdown}; it must be >= 1.0 (a factor by "
                           "which the group is slower than cpu_per_rank allows)")
    return GroupSpec(name=str(g["name"]), ranks=ranks, slowdown=slowdown)


def _link(i: int, l: Any, names: set[str]) -> LinkShape:
    where = f"links[{i}]"
    if not isinstance(l, dict) or not isinstance(l.get("between"), list) or len(l["between"]) != 2:
        raise TestbedError(f"{where} needs 'between: [group_a, group_b]'")
    a, b = (str(x) for x in l["between"])
    for n in (a, b):
        if n not in names:
            raise TestbedError(f"{where}.between names {n!r}, not a group; groups are "
                               f"{sorted(names)}")
    if a == b:
        raise TestbedError(f"{where} joins {a!r} to itself; links are between two groups")
    latency = float(l.get("latency_ms", 0.0))
    if latency < 0:
        raise TestbedError(f"{where}.latency_ms must be >= 0; got {latency}")
    return LinkShape(a=a, b=b, bandwidth_mbps=_positive(l, "bandwidth_mbps", 0, f"{where}.bandwidth_mbps"),
                     latency_ms=latency)
