"""Test tiers: every test is exactly one of ``unit``, ``multiproc`` or ``e2e``.

* ``multiproc``: starts Gloo ranks (``benchmarks.ranks.run_ranks``) or testbed ranks;
* ``e2e``: runs a recipe or the ``hapt-hf`` command as a user would (``accelerate launch``,
  a fresh ``python -m hapt_hf.cli``, a recipe's ``main``);
* ``unit``: everything else, in this process (the house rules also run ruff and lint-imports,
  and the public-API checks a fresh interpreter importing the package).

A test marked neither ``multiproc`` nor ``e2e`` is marked ``unit`` here, and a unit test that
starts a rank process or a hapt-hf / recipe / accelerate process fails, naming the marker it
needs, so the tiers stay what they say.

How the suite starts processes, and in what order it runs its files:

* rank processes (``benchmarks.ranks.run_ranks``) fork from one fork server per pytest process,
  which imports ``ranks.PRELOAD`` once; :data:`TEST_PRELOAD` adds what the tests' rank functions
  import on top (the integration layer: HaptTrainer, HaptAccelerator, transformers' Trainer), so
  no rank pays for those imports again. Each rank is still a process of its own, with its own
  process group, and dies (killed, ``os._exit``) alone;
* the two xdist workers take whole files (``--dist loadfile``), longest first by the seconds in
  ``tests/data/file_seconds.json`` (``--no-loadscope-reorder`` keeps that order), so the workers
  start on the long multi-process files and end on short ones together. A file not listed there
  counts a few seconds per multi-process test. ``--record-file-seconds PATH`` writes a run's
  seconds per file, in that file's form.
"""
import json
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

from benchmarks import ranks  # noqa: E402

TEST_PRELOAD = ("pytest", "hapt_hf.integration", "hapt_hf.integration.accelerate_plugin",
                "hapt_hf.profiling")
"""Modules the fork server imports once beyond ``ranks.PRELOAD``: what the tests' rank functions
import (``hapt_hf.integration`` alone costs about a second of CPU a process), and pytest, which
every rank imports with the test module its function is found in."""
ranks.PRELOAD = tuple(dict.fromkeys(ranks.PRELOAD + TEST_PRELOAD))

FILE_SECONDS = Path(__file__).resolve().parent / "data" / "file_seconds.json"
"""Seconds each test file took in a whole run (setup, call and teardown of all its tests)."""
UNLISTED_PROCESS_TEST_S = 5.0
"""What a multiproc or e2e test of a file not in FILE_SECONDS is taken to last (others: 0.05 s)."""

TIERS = ("unit", "multiproc", "e2e")
_E2E_COMMANDS = ("hapt_hf.cli", "hapt-hf", "accelerate", "torchrun", "recipes/")
"""Words in a command line that make it an end-to-end run."""


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="write the seconds each test file took (the form of "
                          "tests/data/file_seconds.json, which orders the files)")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _longest_files_first(items: list) -> None:
    """Reorder ``items`` in place: whole files, longest first (stable: ties keep their order)."""
    known = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    guess: dict[str, float] = {}
    for item in items:
        heavy = item.get_closest_marker("multiproc") or item.get_closest_marker("e2e")
        f = _file_of(item.nodeid)
        guess[f] = guess.get(f, 0.0) + (UNLISTED_PROCESS_TEST_S if heavy else 0.05)
    first_seen = {f: i for i, f in reversed(list(enumerate(_file_of(it.nodeid) for it in items)))}
    items.sort(key=lambda it: (-known.get(_file_of(it.nodeid), guess[_file_of(it.nodeid)]),
                               first_seen[_file_of(it.nodeid)]))


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {tiers}; give it one tier of {TIERS}")
        if not tiers:
            item.add_marker(pytest.mark.unit)
    _longest_files_first(items)


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # on the controller under xdist (it sees every worker's reports), or in the one process
    _file_seconds[_file_of(report.nodeid)] = _file_seconds.get(_file_of(report.nodeid), 0.0) + \
        report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-file-seconds")
    if path is None or hasattr(session.config, "workerinput"):
        return
    ordered = sorted(_file_seconds.items(), key=lambda kv: (-kv[1], kv[0]))
    Path(path).write_text(json.dumps({f: round(s, 1) for f, s in ordered}, indent=0) + "\n")


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
