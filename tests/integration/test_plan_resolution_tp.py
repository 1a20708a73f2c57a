"""The launch plans with the tensor-parallel degrees the runtime can run for the model: none
above 1 for a model without a tensor-parallel plan (GPT-2), up to what the heads, key/value
heads and MLP width allow for one with a plan (the recipes' LLaMA: 2 key/value heads), never
above the planner option ``max_tp``; and the launch's table names a tensor-parallel stage's
replicas and degree."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from hapt_hf.integration.plan_resolution import format_plan, runnable_max_tp
from hapt_hf.planner.plan import Plan

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize("kind, max_tp, expected", [("gpt2", 8, 1), ("llama", 8, 2), ("llama", 1, 1)])
def test_the_planner_is_offered_only_degrees_the_runtime_runs(kind, max_tp, expected):
    config = AutoConfig.from_pretrained(RECIPES / "models" / f"{kind}-tiny")
    assert runnable_max_tp(config, max_tp) == expected


def test_the_plan_table_shows_a_tensor_parallel_replica():
    table = format_plan(Plan.load(RECIPES / "configs" / "plan_cpu_demo_tp.json"))
    assert "ranks [[0, 1]] tp 2 group pair" in table and "ranks [2, 3] group slow" in table
