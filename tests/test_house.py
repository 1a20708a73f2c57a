"""House rules of the repository, checked on every test run.

* imports run one way (``lint-imports``, the contracts in pyproject.toml; it sees imports made
  inside functions too), and ``ruff check`` finds nothing;
* no module of hapt_hf imports a private name (leading underscore) of another hapt_hf module;
* no class of hapt_hf borrows its subclass's attributes: no ``*Mixin`` class, and no hapt_hf class
  that another one derives from reads a ``self.`` attribute it neither defines nor inherits
  (a base that only declares ``stage: nn.Module`` and uses it is a mixin; give the class what
  it needs instead);
* the benchmarks never import the command line, and nothing reads files from outside the
  repository (the ``shared`` folder beside a checkout): tests and benchmarks read ``benchmarks/inputs.py``;
* private torch / transformers / Trainer APIs are reached only through ``hapt_hf/compat/``.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hapt_hf"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
                          check=False)


def _python_files(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def test_imports_follow_the_layers():
    # lint-imports is the console script of import-linter (a test extra)
    proc = _run([sys.executable, "-c", "import sys; from importlinter.cli import "
                 "lint_imports_command; sys.exit(lint_imports_command())"])
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}\n{proc.stderr}"


def test_ruff_finds_nothing():
    proc = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "."])
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}\n{proc.stderr}"


# -- private names -----------------------------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from."""
    if not node.level:
        return node.module or ""
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return ".".join(p for p in (base, node.module or "") if p)


def private_imports(path: Path, text: str | None = None) -> list[str]:
    """``module.name`` for every private name of another hapt_hf module ``path`` imports or
    reaches as an attribute of an imported hapt_hf module (``text``: its source, if not read)."""
    tree = ast.parse(path.read_text() if text is None else text)
    me = _module_name(path)
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(path, node)
            if not source.startswith("hapt_hf") or source == me:
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{source}.{alias.name}")
                modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hapt_hf") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in modules and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_module_imports_another_modules_private_names():
    bad = {str(p.relative_to(ROOT)): hits for p in _python_files(PACKAGE)
           if (hits := private_imports(p))}
    assert not bad, f"private names imported across hapt_hf modules: {bad}"


def test_private_name_check_finds_them():
    # the check itself: a relative import of a private helper and a private attribute
    probe = PACKAGE / "planner" / "search" / "probe.py"
    text = "from .shapes import _split\nfrom hapt_hf.pipeline import stage\nx = stage._attach\n"
    assert private_imports(probe, text) == ["hapt_hf.pipeline.stage._attach",
                                            "hapt_hf.planner.search.shapes._split"]
    assert private_imports(probe, "from .shapes import shapes_for\n") == []


# -- classes that borrow their subclass's attributes -------------------------------------------

BORROWING_BASES = {
    "TrainerHooks": "compat/trainer_api.py: Trainer's private checkpoint hooks, handed on to the "
                    "HaptTrainer methods that replace them",
}
"""Bases allowed to call what their subclass defines, and why."""
_OPEN_BASES = {"object", "ABC", "Generic", "Protocol"}
"""Bases that define no attributes of their own (any other base outside hapt_hf may)."""


def _defined(cls: ast.ClassDef) -> set[str]:
    """Attributes a class gives itself: its methods and class attributes (dataclass fields:
    annotated names of a ``@dataclass``; a bare annotation elsewhere only declares), and every
    ``self.x`` one of its methods assigns."""
    dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                (node.value is not None or dataclass):
            names.add(node.target.id)
    for node in ast.walk(cls):
        target = node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                        n.value.id == "self" and isinstance(n.ctx, ast.Store):
                    names.add(n.attr)
    return names


def _read(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Load) and not n.attr.startswith("__")}


def borrowing_classes(sources: dict[str, str]) -> list[str]:
    """``module:Class ...`` for every ``*Mixin`` class, and every class other classes derive
    from whose methods read ``self.`` attributes that neither it nor its bases define
    (``sources``: module name -> its text). A base outside hapt_hf may define anything: a
    class deriving from one is not checked."""
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((module, node))

    def base_names(cls: ast.ClassDef) -> list[str]:
        return [ast.unparse(b).rpartition(".")[2] for b in cls.bases]

    def inherited(cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str] | None:
        """What ``cls`` and its bases define; None where a base outside hapt_hf may add more."""
        names = _defined(cls)
        for base in base_names(cls):
            if base in _OPEN_BASES:
                continue
            if base not in classes or base in seen:
                return None
            for _, b in classes[base]:
                more = inherited(b, seen | {base})
                if more is None:
                    return None
                names |= more
        return names

    used_as_base = {b for defs in classes.values() for _, c in defs for b in base_names(c)}
    found = []
    for name, defs in classes.items():
        for module, cls in defs:
            if name.endswith("Mixin"):
                found.append(f"{module}:{name} is a mixin")
            if name not in used_as_base or name in BORROWING_BASES:
                continue
            own = inherited(cls)
            if own is not None and (borrowed := sorted(_read(cls) - own)):
                found.append(f"{module}:{name} reads {borrowed} it does not define")
    return sorted(found)


def test_no_class_borrows_its_subclass_attributes():
    sources = {_module_name(p): p.read_text() for p in _python_files(PACKAGE)}
    bad = borrowing_classes(sources)
    assert not bad, ("hapt_hf base classes that use attributes their subclasses define: "
                     f"{bad}; give the class what it needs (a constructor argument) and hold it")


def test_borrowing_check_finds_them():
    mixin = ("class StepMixin:\n    stage: object\n"
             "    def step(self):\n        return self.stage, self.group\n"
             "class Runtime(StepMixin):\n    def __init__(self):\n"
             "        self.stage, self.group = 1, 2\n")
    assert borrowing_classes({"probe": mixin}) == [
        "probe:StepMixin is a mixin", "probe:StepMixin reads ['group', 'stage'] it does not define"]
    held = ("class Steps:\n    def __init__(self, stage):\n        self.stage = stage\n"
            "    def step(self):\n        return self.stage\n"
            "class Fast(Steps):\n    pass\n"
            "class Mode(TorchMode):\n    def go(self):\n        return self.torch_field\n"
            "class Fancy(Mode):\n    pass\n")
    assert borrowing_classes({"probe": held}) == []


# -- what the benchmarks and tests read --------------------------------------------------------

def _imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_benchmarks_do_not_import_the_command_line():
    bad = {str(p.relative_to(ROOT)): sorted(n for n in _imports_of(p)
                                            if n == "hapt_hf.cli" or n.startswith("hapt_hf.cli."))
           for p in _python_files(ROOT / "benchmarks")}
    assert not {k: v for k, v in bad.items() if v}


# a path built towards a folder named shared: up one level to it, joined with / to the name,
# or the name as a path part
_OUTSIDE = re.compile(r"""["']\.\./shared|/\s*["']shared["']|["']shared["']\s*[,)/]""")


@pytest.mark.parametrize("folder", ["hapt_hf", "benchmarks", "tests", "scripts", "recipes"])
def test_nothing_reads_files_from_outside_the_repository(folder):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _python_files(ROOT / folder)
            if p != Path(__file__).resolve()
            for i, line in enumerate(p.read_text().splitlines(), 1) if _OUTSIDE.search(line)]
    assert not hits, f"paths into the shared folder beside the checkout: {hits}; read benchmarks/inputs.py instead"


# -- private APIs of torch, transformers and Trainer -------------------------------------------

PRIVATE_APIS = re.compile("|".join([
    r"torch\.utils\._", r"_python_dispatch", r"_device_constructors", r"\._schema\b",
    r"\._cdata\b", r"torch\._C\b", r"distributed_c10d\._", r"_get_default_store",
    r"_attn_implementation", r"masking_utils", r"loss_utils", r"(?<![A-Za-z0-9])_name_or_path",
    r"init_training_references", r"_get_learning_rate", r"_load_callback_state",
    r"_determine_best_metric", r"_get_output_dir", r"\._train_batch_size\b", r"_save_checkpoint",
    r"_load_best_model", r"\._modules\b", r"\._parameters\b", r"\._buffers\b",
]))
"""Names of private torch / transformers / Trainer APIs. (OPT's ``_remove_final_layer_norm``,
read by the planner, is not one: it is a field of OPTConfig and of its config.json.)"""
COMPAT = "hapt_hf/compat/"
TESTBED_SITE = ROOT / "benchmarks" / "testbed" / "site"
"""Loaded into the testbed's processes to slow torch's process groups down on purpose: it
patches torch itself and is no part of the package."""


def private_api_uses(path: Path, text: str | None = None) -> list[str]:
    """``line: text`` of every private torch / transformers / Trainer name in a file."""
    lines = (path.read_text() if text is None else text).splitlines()
    return [f"{i}: {line.strip()}" for i, line in enumerate(lines, 1) if PRIVATE_APIS.search(line)]


def test_private_apis_only_in_compat():
    files = [p for p in _python_files(PACKAGE, ROOT / "recipes", ROOT / "benchmarks",
                                      ROOT / "scripts") if TESTBED_SITE not in p.parents]
    bad = {rel: hits for p in files
           if not (rel := str(p.relative_to(ROOT))).startswith(COMPAT)
           and (hits := private_api_uses(p))}
    assert not bad, f"private torch/transformers/Trainer APIs outside {COMPAT}: {bad}"


def test_private_api_check_finds_them():
    probe = PACKAGE / "pipeline" / "probe.py"
    text = ("from transformers.masking_utils import create_causal_mask\n"
            "config._attn_implementation = 'eager'\n"
            "node._modules[name]\n"
            "p = args.model_name_or_path\n")
    assert [h.split(":")[0] for h in private_api_uses(probe, text)] == ["1", "2", "3"]
