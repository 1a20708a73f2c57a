"""LoRA on a plan with a tensor-parallel stage is refused from the plan alone (every rank reads
the same plan, so every rank refuses alike), naming the stages and the way out; a plan of one
rank per replica passes."""
from __future__ import annotations

import pytest

from hapt_hf.integration.lora import LoraSetupError, check_lora_plan
from hapt_hf.planner.plan import Plan, Replica, Stage


def _plan(tp: int) -> Plan:
    first = Stage(0, (0, 4), (Replica("cpu", "cpu", 2, tuple(range(tp))),), 2)
    last = Stage.even(1, (4, 8), "cpu", "cpu", (tp,), 1, micro_batch_size=2)
    return Plan("llama-tiny", 8, 16, 8, 2, 4, "1f1b", (first, last)).validate(tp + 1)


def test_lora_is_refused_on_a_tensor_parallel_plan():
    with pytest.raises(LoraSetupError, match=r"stage\(s\) \[0\] are tensor-parallel.*max_tp: 1"):
        check_lora_plan(_plan(2))
    check_lora_plan(_plan(1))
