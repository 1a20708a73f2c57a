"""When nothing fits, the message gives the need against the capacity and a remedy that plans."""
from __future__ import annotations

import re

import pytest

from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.search import PlannerOptions, PlanningError, SearchProblem, plan_job
from hapt_hf.planner.search.infeasible import fit_advice

from .test_search import make_group, synth_model


def _one_group(mem_gb: float, gpus: int) -> Cluster:
    return Cluster("tiny", (make_group("a", 100.0, mem_gb, gpus),), ())


def _refusal(model, cluster, gbs, options=PlannerOptions()) -> str:
    with pytest.raises(PlanningError) as e:
        plan_job(model, cluster, gbs, options=options)
    return str(e.value)


def test_more_gpus_as_advised_then_plan():
    model = synth_model(8, 512)  # a block's weights and Adam state: 50 MB
    msg = _refusal(model, _one_group(0.1, 2), 4)
    # the need and the capacity, in GB, from the cost model
    assert "needs 0.0527 GB against 0.09 GB usable on the largest GPU (G100-0.1" in msg
    assert "optimizer state take 0.412 GB against 0.18 GB usable on all 2 GPUs" in msg
    assert "allow_recompute" not in msg  # recompute is on already: not a remedy
    more = int(re.search(r"(\d+) more G100-0.1 GPU", msg).group(1))
    plan = plan_job(model, _one_group(0.1, 2 + more), 4).plan
    assert plan.num_stages >= 2
    # and no fewer would do: the count is the least that plans
    with pytest.raises(PlanningError):
        plan_job(model, _one_group(0.1, 1 + more), 4)


def test_recompute_off_is_named_when_on_would_fit():
    model = synth_model(4, 256, seq=1024)
    cluster = _one_group(0.08, 2)
    off = PlannerOptions(allow_recompute=False)
    msg = _refusal(model, cluster, 8, off)
    assert "allow_recompute=True (recompute activations in the backward) fits it" in msg
    assert plan_job(model, cluster, 8).plan.stages


def test_a_smaller_micro_batch_is_named_when_it_would_fit():
    model = synth_model(4, 256, seq=1024)
    cluster = _one_group(0.1, 2)
    msg = _refusal(model, cluster, 8, PlannerOptions(micro_batch_sizes=(8,)))
    mbs = int(re.search(r"micro-batch size (\d+) \(--micro-batch", msg).group(1))
    assert mbs < 8
    plan = plan_job(model, cluster, 8, options=PlannerOptions(micro_batch_sizes=(mbs,))).plan
    assert plan.micro_batch_size == mbs


def test_a_layer_bigger_than_any_gpu_names_the_gpu_size_and_the_replicas_zero1_needs():
    model = synth_model(2, 1024)  # one block: 0.2 GB of weights and Adam state
    msg = _refusal(model, _one_group(0.15, 2), 4)
    d = int(re.search(r"sharding its optimizer state \(ZeRO-1\) over (\d+) replicas", msg
                      ).group(1))
    assert d > 2 and "but the largest group has 2 GPUs" in msg
    size, count = re.search(r"GPUs with at least ([0-9.]+) GB of memory \((\d+) of them", msg
                            ).groups()
    assert plan_job(model, _one_group(float(size), int(count)), 4).plan.stages
    # with the switch off the message says to turn it on
    off = PlannerOptions(allow_sharded_optimizer=False)
    assert "allow_sharded_optimizer=True" in _refusal(model, _one_group(0.15, 12), 8, off)
    # where weights and gradients alone are too big, sharding the optimizer would not help
    msg = _refusal(synth_model(2, 2048), _one_group(0.1, 2), 4)
    assert "even sharding its optimizer state" in msg and "allow_sharded" not in msg


def test_advice_is_empty_where_the_job_fits():
    model = synth_model(4, 256)
    cm = CostModel(model, _one_group(16.0, 2))
    assert fit_advice(SearchProblem(cm, 8, PlannerOptions())) == []
    tiny = CostModel(model, _one_group(0.01, 2))
    assert fit_advice(SearchProblem(tiny, 8, PlannerOptions()))
