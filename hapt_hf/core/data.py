"""Where the data files shipped inside the package live (installed with it as package data)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["DATA_DIR", "CLUSTERS_DIR", "PROFILES_DIR", "BUILTIN_PROFILES"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CLUSTERS_DIR = DATA_DIR / "clusters"
"""Built-in cluster files, loadable by name (``v100x8_a100x4``)."""
PROFILES_DIR = DATA_DIR / "profiles"
"""Sailor's published per-layer measurements (see its README and LICENSE)."""
BUILTIN_PROFILES = {"sailor": PROFILES_DIR}
"""Names a cluster file's ``profiles:`` may give instead of a directory."""
