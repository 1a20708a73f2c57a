"""Links between groups: network namespaces joined by a bridge, shaped with htb, or a shim.

netns (preferred; needs root and iproute2): one namespace per group; every rank of a group runs in
it (``ip netns exec``), so ranks of one group talk over that namespace's own addresses, unshaped,
while traffic to another group leaves through the namespace's veth ``tb0`` into a bridge. On each
``tb0`` an htb qdisc sends traffic for each other group's address through a class of that link's
rate. Gloo binds to ``tb0`` through ``GLOO_SOCKET_IFNAME``. This kernel has no ``netem``, so
latency is added by the shim on top (see sitecustomize.py).

shim (fallback): every rank on loopback; the sitecustomize shim delivers sends to other groups
after latency + bytes / bandwidth from a background thread (transfers on one link queue behind
each other), so the sender's compute overlaps the transfer as on a real link.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from .spec import TestbedSpec

__all__ = ["netns_available", "NetnsLinks", "shim_env"]

INNER_IF = "tb0"


def netns_available() -> tuple[bool, str]:
    """Whether namespaces, veth, bridges and htb can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces need root)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return False, "iproute2 (ip, tc) is not installed"
    probe = f"hhprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, "network namespaces + veth + bridge + htb"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> None:
    cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc"] + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


@dataclass
class NetnsLinks:
    """The namespaces, bridge and veths of one testbed; ``tag`` keeps their names unique."""

    spec: TestbedSpec
    tag: str
    subnet: int = field(default=0)
    """Third octet in 10.213.x.0/24 (from the tag, so two testbeds at once do not collide)."""
    made: list[tuple[str, str]] = field(default_factory=list)
    """('netns'|'link', name) in creation order, for cleanup."""

    def __post_init__(self) -> None:
        self.subnet = self.subnet or (int(self.tag, 16) % 250 + 1)

    @property
    def bridge(self) -> str:
        return f"hbr{self.tag}"[:15]

    def namespace(self, gi: int) -> str:
        return f"hapt_tb_{self.tag}_{gi}"

    def address(self, gi: int) -> str:
        return f"10.213.{self.subnet}.{gi + 1}"

    def setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for gi, _ in enumerate(self.spec.groups):
            ns, host_if = self.namespace(gi), f"hv{self.tag}{gi}"[:15]
            _ip("netns", "add", ns)
            self.made.append(("netns", ns))
            _ip("link", "add", host_if, "type", "veth", "peer", "name", INNER_IF, "netns", ns)
            self.made.append(("link", host_if))
            _ip("link", "set", host_if, "master", self.bridge)
            _ip("link", "set", host_if, "up")
            _ip("addr", "add", f"{self.address(gi)}/24", "dev", INNER_IF, ns=ns)
            _ip("link", "set", INNER_IF, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self._shape(gi)

    def _shape(self, gi: int) -> None:
        """htb on the group's egress: one class per linked group, default class unshaped."""
        ns, me = self.namespace(gi), self.spec.groups[gi].name
        _tc(ns, "qdisc", "add", "dev", INNER_IF, "root", "handle", "1:", "htb", "default", "999")
        _tc(ns, "class", "add", "dev", INNER_IF, "parent", "1:", "classid", "1:999", "htb",
            "rate", "10gbit", "quantum", "60000")
        for gj, other in enumerate(self.spec.groups):
            link = self.spec.link(me, other.name) if gj != gi else None
            if link is None:
                continue
            cls = f"1:{10 + gj}"
            _tc(ns, "class", "add", "dev", INNER_IF, "parent", "1:", "classid", cls, "htb",
                "rate", f"{link.bandwidth_mbps:g}mbit", "quantum", "60000")
            _tc(ns, "filter", "add", "dev", INNER_IF, "parent", "1:", "protocol", "ip", "prio",
                "1", "u32", "match", "ip", "dst", f"{self.address(gj)}/32", "flowid", cls)

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` inside the rank's group namespace."""
        group = self.spec.group_of_rank(rank)
        gi = [g.name for g in self.spec.groups].index(group.name)
        return ["ip", "netns", "exec", self.namespace(gi)] + argv

    def env(self) -> dict[str, str]:
        # the TCP store lives on rank 0, in group 0's namespace
        return {"GLOO_SOCKET_IFNAME": INNER_IF, "MASTER_ADDR": self.address(0)}

    def cleanup(self) -> None:
        """Delete what setup made, newest first; deleting a namespace removes its veth end."""
        for kind, name in reversed(self.made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.made.clear()


def shim_env(spec: TestbedSpec, bandwidth: bool) -> dict[str, str]:
    """Environment for the sitecustomize p2p shim: latency always, bandwidth if ``bandwidth``."""
    group_of_rank = [spec.group_of_rank(r).name for r in range(spec.world_size)]
    links = {f"{l.a}|{l.b}": [l.bandwidth_mbps if bandwidth else 0.0, l.latency_ms]
             for l in spec.links}
    if not bandwidth and not any(l.latency_ms for l in spec.links):
        return {}
    return {"HAPT_TESTBED_SHIM": json.dumps({"group_of_rank": group_of_rank, "links": links})}
