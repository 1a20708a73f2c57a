"""``python3 -m benchmarks.testbed cleanup``: remove what a killed testbed left behind.

A testbed removes its namespaces, links and cgroups itself, even on failure; only a driver killed
with SIGKILL leaves them. This removes every ``hapt_tb_*`` namespace and cgroup and every
``hbr*`` / ``hv*`` link whose name a testbed would have made. Run it only when no testbed is
running: it does not know which are still in use.
"""
from __future__ import annotations

import re
import subprocess
import sys

from .cpu import CPU_CGROUP_ROOT, CgroupQuotas

_LINK = re.compile(r"^\d+: ((?:hbr|hv)[0-9a-f]{4}\d*)[@:]")


def cleanup() -> list[str]:
    removed = []
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                               text=True).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("hapt_tb_"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(f"netns {name}")
    for line in subprocess.run(["ip", "-o", "link"], capture_output=True,
                               text=True).stdout.splitlines():
        m = _LINK.match(line)
        if m:
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)
            removed.append(f"link {m.group(1)}")
    if CPU_CGROUP_ROOT.exists():
        for d in CPU_CGROUP_ROOT.glob("hapt_tb_*"):
            CgroupQuotas(d.name[len("hapt_tb_"):]).cleanup()
            removed.append(f"cgroup {d}")
    return removed


def main(argv: list[str]) -> int:
    if argv != ["cleanup"]:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for item in cleanup():
        print(f"removed {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
