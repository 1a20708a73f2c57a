"""The precision a job trains in: ``auto`` on each kind of cluster, what a GPU cannot honour,
and the precision recorded in plan.json (and read back from plans written before it)."""
from __future__ import annotations

import json

import pytest

from hapt_hf.cli import main
from hapt_hf.core.precision import Precision, resolve_precision
from hapt_hf.errors import ClusterError, PlanError, PrecisionError
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.search import PlannerOptions, plan_job


def _cluster(*gpus: str, job: dict | None = None, **group) -> Cluster:
    groups = [{"name": f"g{i}", "gpu": g, "gpus_per_node": 1, **group} for i, g in
              enumerate(gpus)]
    links = [{"between": ["g0", f"g{i}"], "bandwidth_gbps": 10, "latency_us": 10}
             for i in range(1, len(gpus))]
    return Cluster.from_dict({"name": "c", "groups": groups, "links": links,
                              **({"job": job} if job else {})})


@pytest.mark.parametrize("gpus, compute, scaling, why", [
    (("A100-40", "H100"), "bf16", None, "every GPU supports bf16"),
    (("A100-40", "V100-32"), "fp16", "dynamic", "V100-32 has no bf16"),
    (("RTX-4090", "T4"), "fp16", "dynamic", "T4 has no bf16"),
    (("cpu",), "fp32", None, "cpu is a CPU"),
])
def test_auto_follows_every_device(gpus, compute, scaling, why):
    p = _cluster(*gpus).precision("auto")
    assert (p.compute, p.loss_scaling, p.reason) == (compute, scaling, why)
    assert _cluster(*gpus).precision(None) == p


def test_bf16_a_gpu_cannot_run_is_refused_naming_it():
    with pytest.raises(PrecisionError, match=r"^precision bf16: V100-32 cannot compute in bf16; "
                                             r"use precision fp16"):
        _cluster("A100-40", "V100-32").precision("bf16")
    # fp16 runs anywhere; a GPU outside the catalogue is not assumed to have bf16
    assert _cluster("V100-32").precision("fp16") == Precision("fp16", "dynamic", "as asked")
    with pytest.raises(PrecisionError, match="set bf16: true in its group"):
        _cluster("X1", tflops=10, memory_gb=8).precision("bf16")
    assert _cluster("X1", tflops=10, memory_gb=8, bf16=True).precision().compute == "bf16"
    with pytest.raises(PrecisionError, match="'fp8' is not known"):
        resolve_precision("fp8", {})


def test_job_section_precision_and_its_older_name():
    assert _cluster("A100-40", job={"dtype": "fp16"}).job.precision == "fp16"
    assert _cluster("A100-40", job={"precision": "auto"}).job.dtype is None
    with pytest.raises(ClusterError, match="job.precision 'bf16' and job.dtype 'fp16' disagree"):
        _cluster("A100-40", job={"precision": "bf16", "dtype": "fp16"})
    with pytest.raises(ClusterError, match="job.attn_implementation 'flash'"):
        _cluster("A100-40", job={"attn_implementation": "flash"})


def _plan(**kw) -> Plan:
    return Plan(model_name="m", num_layers=3, seq_len=8, global_batch_size=2,
                micro_batch_size=1, num_microbatches=2, schedule="1f1b",
                stages=(Stage.even(0, (0, 3), "g", "cpu", (0,), warmup=1, micro_batch_size=1),),
                **kw)


def test_plan_json_round_trips_precision_and_attention(tmp_path):
    model = ModelSpec.from_name_or_path("gpt2-tiny", 64, "fp16", attn_implementation="eager")
    result = plan_job(model, _cluster("V100-32", "A100-40"), 8,
                      options=PlannerOptions(include_baselines=False))
    plan = result.plan
    assert plan.precision.to_dict() == {"compute": "fp16", "loss_scaling": "dynamic"}
    assert plan.attn_implementation == "eager"
    d = json.loads(plan.to_json())
    assert d["precision"] == {"compute": "fp16", "loss_scaling": "dynamic"}
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan


def test_old_plan_takes_precision_from_its_dtype():
    d = _plan(dtype="fp16", loss_scaling="dynamic").to_dict()
    del d["precision"], d["attn_implementation"]
    old = Plan.from_dict(d).validate()
    assert old.precision == Precision("fp16", "dynamic")
    assert old.attn_implementation == "sdpa"
    del d["dtype"]
    assert Plan.from_dict(d).validate().precision == Precision("fp32", None)


@pytest.mark.parametrize("change, words", [
    ({"precision": {"compute": "bf16", "loss_scaling": None}}, "dtype 'fp16' and precision"),
    ({"precision": {"compute": "fp16", "loss_scaling": None}}, "loss_scaling 'dynamic'"),
    ({"precision": "fp16"}, "precision must be a mapping"),
    ({"attn_implementation": "flash"}, "attn_implementation 'flash'"),
])
def test_inconsistent_precision_is_refused(change, words):
    d = {**_plan(dtype="fp16", loss_scaling="dynamic").to_dict(), **change}
    with pytest.raises(PlanError, match=words):
        Plan.from_dict(d).validate()


def test_cli_prints_precision_and_why(tmp_path, capsys):
    code = main(["plan", "--model", "gpt2-tiny", "--seq-len", "64", "--global-batch", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "precision: fp16 with dynamic loss scaling (V100-32 has no bf16); attention: sdpa" \
        in out
    code = main(["plan", "--model", "gpt2-tiny", "--seq-len", "64", "--global-batch", "8",
                 "--precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hapt-hf: error: precision bf16: V100-32 cannot")
    code = main(["plan", "--model", "gpt2-tiny", "--seq-len", "64", "--global-batch", "8",
                 "--precision", "fp32", "--dtype", "fp16"])
    assert code == 2 and "--precision fp32 and --dtype fp16 disagree" in capsys.readouterr().err
    out_json = tmp_path / "p.json"
    code = main(["plan", "--cluster", "cpu_demo_4", "--attn-implementation", "eager",
                 "-o", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0 and "precision: fp32 (as asked); attention: eager" in out
    saved = Plan.load(out_json)
    assert (saved.dtype, saved.attn_implementation) == ("fp32", "eager")
