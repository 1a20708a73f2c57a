"""Test tiers: every test is exactly one of ``unit``, ``multiproc`` or ``e2e``.

* ``multiproc``: starts Gloo ranks (``benchmarks.ranks.run_ranks``) or testbed ranks;
* ``e2e``: runs a recipe or the ``hapt-hf`` command as a user would (``accelerate launch``,
  a fresh ``python -m hapt_hf.cli``, a recipe's ``main``);
* ``unit``: everything else, in this process (the house rules also run ruff and lint-imports,
  and the public-API checks a fresh interpreter importing the package).

A test marked neither ``multiproc`` nor ``e2e`` is marked ``unit`` here, and a unit test that
starts a rank process or a hapt-hf / recipe / accelerate process fails, naming the marker it
needs, so the tiers stay what they say.
"""
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Multi-process tests run Gloo ranks on one machine; one thread each keeps 2 cores from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# benchmarks/ is not an installed package: its input helpers are read from the checkout
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TIERS = ("unit", "multiproc", "e2e")
_E2E_COMMANDS = ("hapt_hf.cli", "hapt-hf", "accelerate", "torchrun", "recipes/")
"""Words in a command line that make it an end-to-end run."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {tiers}; give it one tier of {TIERS}")
        if not tiers:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ranks(request, monkeypatch):
    if request.node.get_closest_marker("unit") is None:
        return

    def no_process(self, *args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process: mark it multiproc")

    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *rest, **kwargs):
        line = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if any(word in line for word in _E2E_COMMANDS):
            pytest.fail(f"{request.node.nodeid} runs {line!r}: mark it e2e")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_process)
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
