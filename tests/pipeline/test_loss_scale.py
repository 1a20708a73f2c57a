"""DynamicLossScaler's rules and state, and the runtime settings of precision (no processes)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hapt_hf.pipeline.loss_scale import DynamicLossScaler
from hapt_hf.pipeline.precision import autocast_mismatch
from hapt_hf.pipeline.runtime import RuntimeConfig, RuntimeSetupError
from hapt_hf.planner.plan import Plan, Stage


def test_backoff_growth_and_state_round_trip():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for found in (False, False, True, False, False, False, False):
        s.update(found)
    # clean, clean, overflow (8 -> 4, count reset), three clean (4 -> 8), one more clean
    assert (s.scale, s.growth_tracker, s.skipped_steps) == (8.0, 1, 1)
    t = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.skipped_steps) == (8.0, 1, 1)
    t.update(False)
    t.update(False)
    assert t.scale == 16.0  # the restored count carries on towards the next growth


def test_defaults_are_gradscalers():
    s, g = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert (s.scale, s.growth_interval, s.growth_factor, s.backoff_factor) == (
        g.get_scale(), g.get_growth_interval(), g.get_growth_factor(), g.get_backoff_factor())


def _plan(dtype: str) -> Plan:
    plan = Plan("t", 3, 8, 2, 2, 1, "1f1b", (Stage.even(0, (0, 3), "g", "cpu", (0,), 1, micro_batch_size=2),))
    return replace(plan, dtype=dtype, loss_scaling="dynamic" if dtype == "fp16" else None)


def test_loss_scale_settings_follow_the_plan():
    assert RuntimeConfig().loss_scaler(_plan("bf16")) is None
    scaler = RuntimeConfig(loss_scale_growth_interval=5).loss_scaler(_plan("fp16"))
    assert (scaler.scale, scaler.growth_interval) == (2.0 ** 16, 5)
    with pytest.raises(RuntimeSetupError, match="loss_scale_init=1024.0 but the plan computes "
                                                "in bf16 without loss scaling"):
        RuntimeConfig(loss_scale_init=1024.0).loss_scaler(_plan("bf16"))
    with pytest.raises(RuntimeSetupError, match="RuntimeConfig.loss_scale_growth_interval"):
        RuntimeConfig(loss_scale_growth_interval=0)


def test_an_autocast_override_must_be_the_plans_dtype():
    assert autocast_mismatch("bf16", None) is None
    assert autocast_mismatch("bf16", torch.bfloat16) is None
    msg = autocast_mismatch("fp32", torch.float16)
    assert "autocast_dtype=torch.float16" in msg and "computes in fp32" in msg
