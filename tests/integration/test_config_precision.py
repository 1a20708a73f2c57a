"""The hapt config's precision and attention: validated, resolved on the cluster, recorded in
the plan rank 0 makes, and checked against a ready plan."""
from __future__ import annotations

from pathlib import Path

import pytest

from hapt_hf.integration.config import HaptConfigError, HaptPlugin
from hapt_hf.integration.launch import LaunchEnv
from hapt_hf.integration.plan_resolution import resolve_plan
from hapt_hf.planner.model_spec import model_config
from hapt_hf.planner.plan import PlanError

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "hapt_hf" / "data" / "clusters" / "cpu_demo_4.yaml"
FOUR = LaunchEnv(0, 4, 0, "single")


def _plan(plugin: HaptPlugin, monkeypatch):
    monkeypatch.setattr("torch.distributed.broadcast_object_list", lambda objs, src: None)
    return resolve_plan(plugin, model_config("gpt2-tiny"), 64, FOUR)


@pytest.mark.parametrize("fields, words", [
    ({"precision": "fp8"}, "'precision' is 'fp8'; use one of auto, bf16, fp16, fp32"),
    ({"precision": "bf16", "dtype": "fp16"}, "'precision' is 'bf16' but 'dtype' is 'fp16'"),
    ({"attn_implementation": "flash"}, "'attn_implementation' is 'flash'; use one of eager"),
])
def test_bad_settings_name_the_field(fields, words):
    with pytest.raises(HaptConfigError, match=words):
        HaptPlugin(cluster=CLUSTER, global_batch_size=8, **fields)


def test_rank0_plans_with_the_configured_precision_and_attention(monkeypatch):
    plan = _plan(HaptPlugin(cluster=CLUSTER, global_batch_size=8, attn_implementation="eager"), monkeypatch)
    assert (plan.dtype, plan.attn_implementation) == ("fp32", "eager")  # auto on CPUs: fp32
    plan = _plan(HaptPlugin(cluster=CLUSTER, global_batch_size=8, dtype="bf16"), monkeypatch)  # the older name
    assert plan.precision.to_dict() == {"compute": "bf16", "loss_scaling": None}
    assert plan.attn_implementation == "sdpa"


def test_ready_plan_with_other_settings_is_refused(tmp_path, monkeypatch):
    made = _plan(HaptPlugin(cluster=CLUSTER, global_batch_size=8), monkeypatch)
    path = made.save(tmp_path / "plan.json")
    for fields, words in (({"attn_implementation": "eager"}, "budgets memory for 'sdpa'"),
                          ({"precision": "bf16"}, "was made for fp32")):
        with pytest.raises(PlanError, match=words):
            _plan(HaptPlugin(plan=path, **fields), monkeypatch)
    assert _plan(HaptPlugin(plan=path, precision="auto"), monkeypatch) == made
