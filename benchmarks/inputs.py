"""The input files every benchmark and test reads, from this repository (never from outside it).

* the benchmark scenarios: cluster files with a ``job:`` section, in ``benchmarks/scenarios``;
* Sailor's published per-layer GPU measurements, shipped with the package as data
  (:data:`hapt_hf.core.data.PROFILES_DIR`, named ``sailor`` in a cluster file's ``profiles:``).
"""
from __future__ import annotations

from pathlib import Path

from hapt_hf.core.data import PROFILES_DIR

__all__ = ["SCENARIOS_DIR", "SAILOR_PROFILES_DIR", "scenario_paths", "scenario_path"]

SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"
SAILOR_PROFILES_DIR = PROFILES_DIR


def scenario_paths(directory: Path = SCENARIOS_DIR) -> list[Path]:
    """Every scenario file of ``directory``, sorted by name; an error if there is none."""
    paths = sorted(Path(directory).glob("*.yaml"))
    if not paths:
        raise FileNotFoundError(f"no scenario files (*.yaml) in {directory}")
    return paths


def scenario_path(name: str) -> Path:
    """The scenario called ``name`` (file name without ``.yaml``); an error if it is missing."""
    path = SCENARIOS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no scenario {name!r} in {SCENARIOS_DIR}")
    return path
