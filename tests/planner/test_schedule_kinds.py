"""The search weighs zero_bubble and interleaved on its best pipeline (search/kinds.py), the
replay prices an interleaved plan's extra transfers on each link, and the CLI's flags."""
from __future__ import annotations

import pytest

from benchmarks.inputs import scenario_path
from hapt_hf.cli import main
from hapt_hf.planner.job import load_job
from hapt_hf.planner.search import PlannerOptions, PlanningError, plan_job
from hapt_hf.planner.cost_model import CostModel, StageCost
from hapt_hf.planner.search import kinds
from hapt_hf.planner.search.kinds import (best_kind, interleaved_layout, replay_kind,
                                          zero_bubble_layout)
from hapt_hf.planner.search.plans import layout_of_plan

SCENARIO = "harp_3groups_1p3b"


@pytest.fixture(scope="module")
def job():
    return load_job(scenario_path(SCENARIO))


def _plan(job, **options):
    # 16 micro-batches of one sample over about 12 stages: the fill is most of the iteration
    return plan_job(job.model, job.cluster, 16, profile=job.profile,
                    options=PlannerOptions(micro_batch_sizes=(1,), **options))


@pytest.fixture(scope="module")
def h1f1b_search(job):
    """The search under h1f1b alone (kinds not weighed), and its pipeline replayed: (result,
    cost model, layout, micro-batches, replay); the tests only read them."""
    res = _plan(job, weigh_kinds=False)
    cm = CostModel(job.model.with_layer_unit(res.plan.layer_unit),
                   job.cluster, job.profile)
    lay = layout_of_plan(cm, res.plan)
    m = res.plan.num_microbatches
    return res, cm, lay, m, replay_kind(cm, lay, m)


def test_zero_bubble_where_the_bubble_is_large_and_memory_allows(job, h1f1b_search):
    res = _plan(job)
    kinds = dict(res.schedule_kinds)
    assert res.plan.schedule == "zero_bubble"
    assert res.sim.feasible and res.sim.iteration_s == kinds["zero_bubble"]
    assert kinds["zero_bubble"] < kinds["h1f1b"] * 0.9
    assert any(d > 0 for d in res.plan.deferrals())
    # faster than the search under h1f1b alone (which may keep other groups)
    alone = h1f1b_search[0]
    assert alone.plan.schedule == "h1f1b" and alone.sim.iteration_s > res.sim.iteration_s


def test_h1f1b_where_no_deferral_fits(h1f1b_search, monkeypatch):
    res, cm, lay, m, sim = h1f1b_search
    got, _, weighed = best_kind(cm, lay, sim, m, "h1f1b")
    assert got.schedule == "zero_bubble"  # where memory allows
    # GPUs that hold no more than their warm-ups: no stage may defer a weight gradient
    ruled = res_zb_s(cm, lay, m)
    monkeypatch.setattr(StageCost, "most_held", lambda self, m: 0)
    zb = zero_bubble_layout(cm, lay, m)
    assert all(s.deferral == 0 for s in zb.stages)
    got, r, weighed = best_kind(cm, lay, sim, m, "h1f1b")
    # without deferrals zero_bubble gains only its input gradients sent a W earlier (less
    # than with the rule's); where that is under the bar, h1f1b stays
    gain = 1 - dict(weighed)["zero_bubble"] / sim.iteration_s
    assert gain < 1 - ruled / sim.iteration_s
    monkeypatch.setattr(kinds, "MIN_GAIN", gain + 0.01)
    got, r, weighed = best_kind(cm, lay, sim, m, "h1f1b")
    assert got is lay and r is sim and got.schedule == "h1f1b"


def res_zb_s(cm, lay, m) -> float:
    """zero_bubble's time with the rule's deferrals (memory as the cost model prices it)."""
    return replay_kind(cm, type(lay)(tuple(s for s in lay.stages), lay.micro_batch_size,
                                     "zero_bubble"), m).iteration_s


def test_interleaved_is_priced_with_its_extra_transfers():
    job = load_job(scenario_path("harp_v100x2_a100x1"))
    plan = plan_job(job.model, job.cluster, 16, profile=job.profile,
                    options=PlannerOptions(micro_batch_sizes=(1,), weigh_kinds=False)).plan
    cm = CostModel(job.model.with_layer_unit(plan.layer_unit),
                   job.cluster, job.profile)
    lay = layout_of_plan(cm, plan)
    m = plan.num_microbatches
    inter = interleaved_layout(lay, m, 2)
    assert inter is not None and inter.num_stages == 2 * lay.num_stages
    r = replay_kind(cm, inter, m, record_events=True)
    p = lay.num_stages
    # every chunk boundary is a transfer: v times the sends of the one-stage-per-rank plan
    sends = [e for e in r.events if e.kind == "SEND_F"]
    assert len(sends) == (2 * p - 1) * m
    # the sends of rank 0 to rank 1 (chunk 0's and chunk 1's) share one link: their busy
    # times never overlap
    costs = cm.stage_costs(inter.stages, inter.micro_batch_size).stages
    link = sorted((e.start, e.end - costs[e.stage].send_forward_latency_s) for e in sends
                  if e.stage in (0, p))
    assert len(link) == 2 * m
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(link, link[1:]))


def test_a_kind_asked_for_is_set_or_refused(job):
    res = _plan(job, schedule="interleaved", virtual_stages=2)
    assert res.plan.schedule == "interleaved" and res.plan.virtual_stages == 2 \
        or res.plan.num_stages < 2
    with pytest.raises(PlanningError, match="virtual_stages"):
        PlannerOptions(virtual_stages=1)


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(scenario_path("harp_v100x2_a100x1")),
                 "--schedule", "zero_bubble", "--max-tp", "1", "-o", str(out)]) == 0
    assert '"schedule": "zero_bubble"' in out.read_text()
    assert "schedule zero_bubble (deferrals " in capsys.readouterr().out
    assert main(["plan", "--cluster", str(scenario_path("harp_v100x2_a100x1")),
                 "--schedule", "gpipe", "--virtual-stages", "2"]) == 2
    assert "--virtual-stages" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(scenario_path("harp_v100x2_a100x1")),
                 "--max-tp", "3"]) == 2
    assert "max_tp 3" in capsys.readouterr().err


def test_cli_keeps_a_schedule_named_and_chooses_one_left_out(tmp_path, capsys):
    # the fill is most of harp_3groups_1p3b's iteration at 16 micro-batches of one sample
    base = ["plan", "--cluster", str(scenario_path(SCENARIO)), "--global-batch", "16",
            "--micro-batch", "1", "--json"]
    assert main(base) == 0
    assert '"schedule": "zero_bubble"' in capsys.readouterr().out
    assert main(base + ["--schedule", "h1f1b"]) == 0
    assert '"schedule": "h1f1b"' in capsys.readouterr().out


def test_kept_kind_s_is_the_time_at_the_kind_the_plan_keeps(h1f1b_search):
    # what the degree screens and the degrees per stage compare pipelines by
    res, cm, lay, m, sim = h1f1b_search
    kept = kinds.kept_kind_s(cm, lay, sim, m, "h1f1b", True)
    assert kept == best_kind(cm, lay, sim, m, "h1f1b")[1].iteration_s < sim.iteration_s
    # the kinds not weighed, or another kind asked for: the pipeline's own replay
    assert kinds.kept_kind_s(cm, lay, sim, m, "h1f1b", False) == sim.iteration_s
    assert kinds.kept_kind_s(cm, lay, sim, m, "gpipe", True) == sim.iteration_s


def test_an_interleaved_wrap_between_unlinked_groups_is_not_a_candidate():
    """An interleaved layout sends its last rank's output back to its first rank: where
    their groups have no link the kind cannot run that pipeline. The search weighs it as
    not buildable and plans the job (it raised the cost model's missing-link error); asked
    for interleaved on such a pipeline, it refuses naming the link."""
    from hapt_hf.core.schedules import warmups_from_steps
    from hapt_hf.planner.cluster import Cluster, GroupLink, LinkSpec
    from hapt_hf.planner.search import Layout
    from tests.planner.test_search import make_group, synth_model
    groups = (make_group("g0", 50.0, 0.05, 1), make_group("g1", 50.0, 0.05, 1),
              make_group("g2", 50.0, 0.05, 2))
    cluster = Cluster("chain", groups, (GroupLink("g0", "g1", LinkSpec(100.0, 10.0)),
                                        GroupLink("g1", "g2", LinkSpec(100.0, 10.0))))
    model = synth_model(4, 64)
    res = plan_job(model, cluster, 6)
    assert [l for s in res.plan.stages for l in range(*s.layers)] == list(range(6))
    # g0 -> g1 -> g2: each neighbour linked, the interleaved wrap g2 -> g0 not
    cm = CostModel(model, cluster)
    m = 6
    shapes = tuple(cm.replicas_at(g, 0, 1, 1, 1) for g in groups)
    lay = Layout.build(shapes, ((0, 2), (2, 4), (4, 6)), (False,) * 3, 1,
                       warmups_from_steps((1, 1), m), "h1f1b")
    sim = replay_kind(cm, lay, m)
    with pytest.raises(PlanningError, match="'g2' and 'g0' are neighbours .* no link"):
        best_kind(cm, lay, sim, m, "interleaved", virtual_stages=2)
