"""The public surface: every exported name resolves, and imports run one way.

Import checks run in a fresh interpreter so that modules other tests loaded do not hide an
import this package makes by itself.
"""
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hapt_hf

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("hapt_hf.planner", "hapt_hf.pipeline", "hapt_hf.integration")


def _modules_after_import(module: str) -> list[str]:
    """Names in sys.modules after importing ``module`` alone in a new interpreter."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_exported_name_resolves(package):
    mod = importlib.import_module(package)
    names = mod.__all__
    assert names, f"{package}.__all__ is empty"
    assert len(names) == len(set(names)), f"{package}.__all__ lists a name twice"
    missing = [n for n in names if getattr(mod, n, None) is None]
    assert not missing, f"{package}.__all__ names {missing} that do not resolve"


def test_planner_exports_the_user_api():
    import hapt_hf.planner as planner
    from hapt_hf.planner import plan, schedule, search, simulate

    # the re-exports are the defining modules' objects, not copies
    assert planner.Plan is plan.Plan and planner.StagePlan is plan.StagePlan
    assert planner.build_schedule is schedule.build_schedule
    assert planner.plan_job is search.plan_job and planner.simulate_plan is simulate.simulate_plan
    for name in planner.__all__:
        if name.endswith("Error"):
            assert issubclass(getattr(planner, name), ValueError), name


def test_planner_imports_neither_pipeline_torch_nor_integration():
    loaded = _modules_after_import("hapt_hf.planner")
    assert "hapt_hf.planner.plan" in loaded  # the probe did import the planner
    for forbidden in ("hapt_hf.pipeline", "hapt_hf.integration", "torch", "transformers"):
        hits = [m for m in loaded if m == forbidden or m.startswith(forbidden + ".")]
        assert not hits, f"import hapt_hf.planner loaded {hits[:5]}"


def test_top_level_package_is_light_and_versioned():
    loaded = _modules_after_import("hapt_hf")
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "accelerate")
             or m.startswith("hapt_hf.")]
    assert not heavy, f"import hapt_hf loaded {heavy[:5]}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert hapt_hf.__version__ == project["version"]
