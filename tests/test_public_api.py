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
SUBPACKAGES = ("hapt_hf.planner", "hapt_hf.pipeline", "hapt_hf.profiling", "hapt_hf.integration")


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
    assert planner.Plan is plan.Plan and planner.Stage is plan.Stage
    assert planner.Replica is plan.Replica
    assert planner.build_schedule is schedule.build_schedule
    assert planner.plan_job is search.plan_job and planner.simulate_plan is simulate.simulate_plan
    from hapt_hf.errors import HaptError
    for name in planner.__all__:
        if name.endswith("Error"):
            assert issubclass(getattr(planner, name), HaptError), name


def test_planner_imports_neither_pipeline_torch_nor_integration():
    loaded = _modules_after_import("hapt_hf.planner")
    assert "hapt_hf.planner.plan" in loaded  # the probe did import the planner
    for forbidden in ("hapt_hf.pipeline", "hapt_hf.profiling", "hapt_hf.integration", "torch",
                      "transformers"):
        hits = [m for m in loaded if m == forbidden or m.startswith(forbidden + ".")]
        assert not hits, f"import hapt_hf.planner loaded {hits[:5]}"



def _module_level_imports(path: Path) -> set[str]:
    """Absolute names a file imports when it is loaded (imports inside functions are lazy)."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)  # annotations only: never executed
            continue
        todo.extend(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.stmt, ast.excepthandler)))
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names.add(".".join(p for p in (base, node.module or "") if p))
    return names


@pytest.mark.parametrize("package, forbidden", [
    ("planner", ("hapt_hf.pipeline", "hapt_hf.profiling", "hapt_hf.integration", "torch")),
    ("pipeline", ("hapt_hf.integration",)),
])
def test_imports_run_one_way_in_every_module(package, forbidden):
    bad = {}
    for path in sorted((ROOT / "hapt_hf" / package).rglob("*.py")):
        hits = [n for n in _module_level_imports(path)
                if any(n == f or n.startswith(f + ".") for f in forbidden)]
        if hits:
            bad[path.name] = hits
    assert not bad, f"hapt_hf.{package} modules import {bad} at load time"


def test_top_level_package_is_light_and_versioned():
    loaded = _modules_after_import("hapt_hf")
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "accelerate")
             or m.startswith("hapt_hf.")]
    assert not heavy, f"import hapt_hf loaded {heavy[:5]}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert hapt_hf.__version__ == project["version"]


def test_top_level_names_are_the_integration_objects():
    from hapt_hf import HaptAccelerator, HaptConfig, HaptTrainer
    from hapt_hf.integration.accelerate_plugin import HaptAccelerator as accelerator
    from hapt_hf.integration.config import HaptConfig as config
    from hapt_hf.integration.trainer import HaptTrainer as trainer

    assert (HaptAccelerator, HaptTrainer, HaptConfig) == (accelerator, trainer, config)
    assert hapt_hf.__all__ == ["HaptAccelerator", "HaptTrainer", "HaptConfig", "model_spec",
                               "__version__"]
    from hapt_hf.profiling.model_figures import model_spec
    assert hapt_hf.model_spec is model_spec
    assert all(getattr(hapt_hf, name) is not None for name in hapt_hf.__all__)
    assert set(hapt_hf.__all__) <= set(dir(hapt_hf))
    with pytest.raises(AttributeError, match="has no attribute 'HaptPlugin'"):
        hapt_hf.HaptPlugin  # noqa: B018  (only the names of __all__ are re-exported)


@pytest.mark.parametrize("name, names, module", [
    ("HaptTrainer", "HaptAccelerator, HaptTrainer, HaptConfig", "hapt_hf.integration.trainer"),
    ("model_spec", "model_spec", "hapt_hf.profiling.model_figures"),
])
def test_top_level_names_load_their_layer_only_when_asked_for(name, names, module):
    """``import hapt_hf`` loads no torch; a top-level name loads its layer when imported."""
    code = ("import sys, hapt_hf; assert 'torch' not in sys.modules; "
            f"assert {name!r} in dir(hapt_hf) and 'torch' not in sys.modules; "
            f"from hapt_hf import {names}; "
            f"assert {module!r} in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# -- the docs describe what the code does ----------------------------------------------------

def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def test_cluster_doc_catalogue_table_matches_the_catalogue():
    from hapt_hf.planner.catalogue import CATALOGUE

    text = _doc("cluster-file.md").split("## GPU catalogue", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (float(cells[1]), float(cells[2]))
    expected = {n: (g.tflops, g.memory_gb) for n, g in CATALOGUE.items()}
    assert rows == expected


def test_architecture_doc_plan_example_has_the_fields_plan_writes():
    from hapt_hf.planner import Plan, Stage

    text = _doc("architecture.md").split("## plan.json", 1)[1]
    example = json.loads(text.split("```json", 1)[1].split("```", 1)[0])
    plan = Plan(model_name="m", num_layers=3, seq_len=8, global_batch_size=2,
                micro_batch_size=1, num_microbatches=2, schedule="1f1b",
                stages=(Stage.even(0, (0, 3), "g", "cpu", (0,), warmup=1, micro_batch_size=1),))
    written = plan.to_dict()
    assert list(example) == list(written)
    assert list(example["stages"][0]) == list(written["stages"][0])
    assert list(example["predicted"]) == list(written["predicted"])
    # the example's stages read back as the stages they describe
    stages = [Stage.from_dict(s, example["micro_batch_size"]) for s in example["stages"]]
    assert [s.layers for s in stages] == [tuple(s["layers"]) for s in example["stages"]]


def test_every_pipeline_and_integration_error_is_a_user_error_under_the_root():
    import importlib
    import pkgutil

    import hapt_hf.integration
    import hapt_hf.pipeline
    from hapt_hf import errors
    from hapt_hf.pipeline.failure import PipelineFailure
    from hapt_hf.pipeline.init_replay import ReplayUnsupported

    # not user errors: a rank that failed, and a signal the stage builder catches itself
    # (the model's initialisation cannot be replayed: the full model is built instead)
    not_user_errors = {PipelineFailure, ReplayUnsupported}
    found = {}
    for package in (hapt_hf.pipeline, hapt_hf.integration):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name in getattr(module, "__all__", ()):
                obj = getattr(module, name)
                if isinstance(obj, type) and issubclass(obj, Exception):
                    found[f"{info.name}.{name}"] = obj
    assert "hapt_hf.pipeline.runtime.RuntimeSetupError" in found  # the walk saw the runtime
    outside = [n for n, cls in found.items()
               if cls not in not_user_errors and not issubclass(cls, errors.HaptError)]
    assert not outside, f"errors outside the HaptError root: {outside}"
    # handlers must tell these apart from user errors
    assert not any(issubclass(cls, errors.HaptError) for cls in not_user_errors)
    from hapt_hf.integration import trainer_checkpoint
    from hapt_hf.pipeline import checkpoint_io, runtime
    assert checkpoint_io.CheckpointError is trainer_checkpoint.CheckpointError is errors.CheckpointError
    assert issubclass(runtime.RuntimeSetupError, errors.ConfigError)
    assert issubclass(runtime.BatchError, errors.DataError)
