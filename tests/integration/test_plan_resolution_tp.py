"""The launch's table of the plan names a tensor-parallel stage's replicas and degree (a list of
its ranks alone would read as that many replicas of one rank)."""
from __future__ import annotations

from pathlib import Path

from hapt_hf.integration.plan_resolution import format_plan
from hapt_hf.planner.plan import Plan

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_the_plan_table_shows_a_tensor_parallel_replica():
    table = format_plan(Plan.load(RECIPES / "configs" / "plan_cpu_demo_tp.json"))
    assert "ranks [[0, 1]] tp 2 group pair" in table and "ranks [2, 3] group slow" in table
