"""Refusals at the runtime's boundary that need no process group (one process)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hapt_hf.pipeline import RuntimeConfig, init_distributed
from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeSetupError
from hapt_hf.planner.plan import Plan, Stage

needs_no_group = pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                                    reason="a process group is already set up in this process")


@needs_no_group
def test_init_distributed_names_the_missing_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeSetupError, match=r"RANK.*torchrun.*accelerate launch"):
        init_distributed()


@needs_no_group
def test_runtime_needs_a_process_group():
    from transformers import GPT2Config
    plan = Plan("t", 3, 8, 2, 2, 1, "1f1b", (Stage.even(0, (0, 3), "g", "cpu", (0,), 1, micro_batch_size=2),))
    with pytest.raises(RuntimeSetupError, match="init_distributed"):
        PipelineRuntime(plan, GPT2Config(n_layer=1, n_embd=8, n_head=2))


@pytest.mark.parametrize("kwargs,field", [({"timeout_s": 0}, "timeout_s"),
                                          ({"autocast_dtype": torch.float64}, "autocast_dtype")])
def test_runtime_config_refuses_bad_values(kwargs, field):
    with pytest.raises(RuntimeSetupError, match=f"RuntimeConfig.{field}"):
        RuntimeConfig(**kwargs)
