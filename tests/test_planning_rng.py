"""Planning leaves the caller's random number generators as they were.

The model reader builds one layer of each kind with the stage builder, which draws weights from
torch's CPU generator: it must draw from its own state, never move the user's (a run seeded 1
would otherwise shuffle its data as if seeded 0), and never seed a CUDA generator (torch seeds
CUDA lazily, so a seed given before CUDA starts would still land there).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from benchmarks.chain_check import tiny_config
from hapt_hf.planner.cluster import Cluster, builtin_cluster_path
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.search import PlannerOptions, plan_job
from hapt_hf.profiling.model_figures import MeasuringReader
from hapt_hf.profiling.model_reader import read_model


def _states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _assert_same(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0]), "torch's CPU generator moved"
    assert before[1] == after[1], "Python's random moved"
    assert before[2][0] == after[2][0] and np.array_equal(before[2][1], after[2][1]) \
        and before[2][2:] == after[2][2:], "numpy's global generator moved"


@pytest.fixture
def no_cuda_seeding(monkeypatch):
    """Every CUDA seeding call, recorded (torch.manual_seed makes one even without a GPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(seed))
    return calls


@pytest.mark.parametrize(("model_type", "layer_unit"), [("gpt2", "half"), ("qwen3", "auto"),
                                                       ("gpt_neox", "auto")])
def test_reading_and_planning_leave_the_rng_as_it_was(model_type, layer_unit, no_cuda_seeding):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    no_cuda_seeding.clear()
    before = _states()
    spec = ModelSpec.from_config(tiny_config(model_type, blocks=2), 32, "fp32",
                                 reader=MeasuringReader())
    plan_job(spec, Cluster.load(builtin_cluster_path("cpu_demo_4")), 16,
             options=PlannerOptions(layer_unit=layer_unit))
    _assert_same(before, _states())
    assert no_cuda_seeding == []


def test_the_reader_reads_the_same_whatever_the_rng():
    config = tiny_config("llama", blocks=2)
    torch.manual_seed(0)
    first = read_model(config, 32, "fp32")
    torch.manual_seed(12345)
    torch.rand(100)
    assert read_model(config, 32, "fp32") == first
