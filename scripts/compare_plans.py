"""Re-plan every scenario and compare with snapshots taken earlier: behaviour must not change.

    python3 scripts/compare_plans.py SNAPSHOT_DIR [--scenarios benchmarks/scenarios]

``SNAPSHOT_DIR`` holds, per scenario, ``<name>.json`` (written by ``hapt-hf plan --cluster
<scenario> -o <name>.json``) and optionally ``<name>.txt`` (that command's output). Each
scenario is planned again with the same command; the plan files must be identical, and so must
the printed report apart from the search's wall time and the path of the file written. Exit 0
when every snapshot matches, 1 with a diff of each mismatch otherwise, 2 on bad input.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import SCENARIOS_DIR  # noqa: E402

TIMING_LINES = ("search time", "wrote ")
"""Report lines that differ between two runs of the same plan: wall time, output path."""


def _report(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(TIMING_LINES)]


def _plan(scenario: Path, out: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hapt_hf.cli", "plan", "--cluster",
                           str(scenario), "-o", str(out)], capture_output=True, text=True,
                          cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hapt-hf plan failed on {scenario}: {proc.stderr.strip()}")
    return proc.stdout


def compare(name: str, snapshots: Path, scenarios: Path) -> list[str]:
    """Differences between the snapshot of ``name`` and a fresh plan ([] when identical)."""
    scenario = scenarios / f"{name}.yaml"
    if not scenario.is_file():
        return [f"{name}: no scenario file {scenario}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        text = _plan(scenario, out)
        new, old = json.loads(out.read_text()), json.loads((snapshots / f"{name}.json").read_text())
    problems = []
    if new != old:
        diff = difflib.unified_diff(json.dumps(old, indent=1).splitlines(),
                                    json.dumps(new, indent=1).splitlines(), "before", "now",
                                    lineterm="", n=2)
        problems.append(f"{name}: plan.json differs\n" + "\n".join(diff))
    txt = snapshots / f"{name}.txt"
    if txt.is_file() and _report(txt.read_text()) != _report(text):
        diff = difflib.unified_diff(_report(txt.read_text()), _report(text), "before", "now",
                                    lineterm="", n=1)
        problems.append(f"{name}: report differs\n" + "\n".join(diff))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshots", type=Path, help="folder of <scenario>.json (and .txt) files")
    ap.add_argument("--scenarios", type=Path, default=SCENARIOS_DIR,
                    help="folder of scenario YAML files (default benchmarks/scenarios)")
    args = ap.parse_args(argv)
    names = sorted(p.stem for p in args.snapshots.glob("*.json"))
    if not names:
        print(f"no snapshots (*.json) in {args.snapshots}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        problems = compare(name, args.snapshots, args.scenarios)
        print(f"{name}: " + ("identical" if not problems else "DIFFERS"))
        for p in problems:
            print(p)
        failed += bool(problems)
    print(f"{len(names) - failed} of {len(names)} scenarios identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
