"""The tensor-parallel CPU demo end to end, as docs/usage.md runs it: ``accelerate launch`` of
``finetune_llama.py`` with ``recipes/configs/hapt_cpu_demo_tp.yaml`` on 4 CPU processes (Gloo).
Its plan holds a stage on a replica of two ranks together (the blocks' projections split between
them, sequence parallel) and a stage of two replicas with sharded optimizer state; the loss falls, and the saved
model, gathered whole, gives ``from_pretrained`` the pipeline's logits (``--verify_checkpoint``).
Kept short (10 steps, seq 64 as the plan says), as the other recipe tests."""
from __future__ import annotations

import pytest

from hapt_hf.planner.plan import Plan
from tests.integration.test_recipes_e2e import RECIPES, _check_checkpoint, _falls, _launch, _losses

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 10


def test_tp_demo_four_processes_trains_and_saves_a_whole_model(tmp_path):
    out = tmp_path / "out"
    log = _launch(4, "finetune_llama.py", RECIPES / "configs" / "hapt_cpu_demo_tp.yaml", out,
                  "--max_steps", str(STEPS), "--verify_checkpoint")
    plan = Plan.load(out / "plan.json")
    assert plan.world_size == 4 and f"{plan.num_stages} stages on 4 ranks" in log
    assert [s.tp for s in plan.stages] == [2, 1] and plan.stages[1].width == 2, plan.to_dict()
    assert [s.sequence_parallel for s in plan.stages] == [True, False], plan.to_dict()
    assert "verify_checkpoint" in log and "(OK)" in log
    losses = _losses(out)
    assert len(losses) == STEPS and _falls(losses), losses
    model = _check_checkpoint(out)
    assert model.config.num_hidden_layers == 6
