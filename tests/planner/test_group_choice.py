"""Choosing which groups to use: one group needs no link, and a plan may leave groups idle."""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from hapt_hf.errors import ClusterError, PlanError
from hapt_hf.planner.cluster import Cluster, GroupLink, LinkSpec
from hapt_hf.planner.job import load_job
from hapt_hf.planner.plan import Plan
from hapt_hf.planner.report import build_report, format_report
from hapt_hf.planner.search import PlannerOptions, PlanningError, plan_job
from hapt_hf.planner.simulate import simulate_plan

from benchmarks.inputs import scenario_path
from tests.planner.test_search import jobs, make_group, synth_model

ALL = PlannerOptions(all_groups=True)
TWO_SITE = "twosite_a100x8_v100x4_200mbps"


def _group(name: str, n: int = 8) -> dict:
    return {"name": name, "gpu": "A100-80", "gpus_per_node": n}


def test_one_group_needs_no_link():
    c = Cluster.from_dict({"groups": [_group("a100")], "links": []})
    assert c.links == () and c.world_size == 8
    res = plan_job(synth_model(4, 256), c, 8)
    assert res.plan.world_size == 8 and res.plan.idle_groups == () and res.group_choices == ()


def test_a_group_of_several_without_its_link_is_still_refused():
    d = {"groups": [_group("a"), _group("b"), _group("c")],
         "links": [{"between": ["a", "b"], "bandwidth_gbps": 10, "latency_us": 10}]}
    with pytest.raises(ClusterError, match=r"group 'c' has no link to any other group.*"
                                           r"between: \[c, a\]"):
        Cluster.from_dict(d)


def _best_on_subsets(model, cluster: Cluster, gbs: int) -> float:
    """The best plan found on any non-empty set of groups, each planned with all its groups."""
    best = float("inf")
    names = cluster.group_names
    for k in range(1, len(names) + 1):
        for kept in itertools.combinations(names, k):
            try:
                best = min(best, plan_job(model, cluster.subset(kept), gbs, options=ALL)
                           .sim.iteration_s)
            except PlanningError:
                pass
    return best


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(max_groups=3, max_gpus=2, max_blocks=4))
def test_the_plan_is_never_slower_than_the_best_plan_on_any_set_of_groups(job):
    model, cluster, gbs = job
    best = _best_on_subsets(model, cluster, gbs)
    try:
        res = plan_job(model, cluster, gbs)
    except PlanningError:
        assert best == float("inf")
        return
    assert res.sim.iteration_s <= best * (1 + 1e-9)
    # the figure comes from the same simulator: replaying the plan gives it again
    assert simulate_plan(res.plan, model, cluster).iteration_s == \
        pytest.approx(res.sim.iteration_s)


def test_two_sites_behind_a_slow_link_use_the_fast_group_alone():
    job = load_job(scenario_path(TWO_SITE))
    res = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile)
    alone = plan_job(job.model, job.cluster.subset(["a100"]), job.global_batch_size,
                     profile=job.profile, options=ALL)
    assert res.plan.idle_groups == ("v100",) and res.plan.world_size == 8
    assert {s.group for s in res.plan.stages} == {"a100"}
    assert res.sim.iteration_s <= alone.sim.iteration_s * 1.03
    assert res.all_groups_s is not None and res.all_groups_s > 5 * res.sim.iteration_s
    # asked to use every group, the planner does (and is far slower)
    every = plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile,
                     options=ALL)
    assert every.plan.idle_groups == () and every.plan.world_size == 12
    assert every.sim.iteration_s == pytest.approx(res.all_groups_s)


def test_groups_that_help_are_all_kept():
    model = synth_model(8, 1024, seq=512)
    cluster = Cluster("c", (make_group("a", 125.0, 16.0, 2), make_group("b", 312.0, 16.0, 2)),
                      (GroupLink("a", "b", LinkSpec(100.0, 10.0)),))
    res = plan_job(model, cluster, 8)
    assert res.plan.idle_groups == () and res.plan.world_size == 4
    assert [c.kept for c in res.group_choices] == [("a", "b"), ("b",), ("a",)]
    for kept in (["a"], ["b"]):
        alone = plan_job(model, cluster.subset(kept), 8, options=ALL)
        assert res.sim.iteration_s < alone.sim.iteration_s


@pytest.fixture(scope="module")
def two_site():
    job = load_job(scenario_path(TWO_SITE))
    return job, plan_job(job.model, job.cluster, job.global_batch_size, profile=job.profile)


def test_a_plan_with_idle_groups_round_trips_and_replays(two_site, tmp_path):
    job, res = two_site
    path = res.plan.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["idle_groups"] == ["v100"]
    back = Plan.load(path)
    assert back == res.plan
    # the ranks are numbered over the groups it uses; the replay on the whole cluster agrees
    model = job.model.with_layer_unit(back.layer_unit)
    assert simulate_plan(back, model, job.cluster).iteration_s == \
        pytest.approx(res.sim.iteration_s)
    rep = build_report(back, res.sim, all_groups_s=res.all_groups_s)
    assert "idle groups      v100 (faster without them" in format_report(rep)


def test_plans_without_idle_groups_write_and_read_as_before(two_site):
    _, res = two_site
    d = res.plan.to_dict()
    d.pop("idle_groups")
    old = Plan.from_dict(d)  # a file written before the field existed
    assert old.idle_groups == () and "idle_groups" not in old.to_dict()


def test_launching_every_group_for_a_plan_that_leaves_some_idle_names_the_fix(two_site):
    _, res = two_site
    with pytest.raises(PlanError, match=r"leaves group\(s\) v100 idle .* needs 8 processes, "
                                        r"but 12 were started; launch only the 8 processes "
                                        r"of group\(s\) a100"):
        res.plan.validate(world_size=12)
    res.plan.validate(world_size=8)


def test_idle_group_that_holds_a_stage_is_refused(two_site):
    _, res = two_site
    d = res.plan.to_dict()
    d["idle_groups"] = ["a100"]
    with pytest.raises(PlanError, match=r"idle_groups lists \['a100'\], which hold stages"):
        Plan.from_dict(d).validate()


def test_hapt_hf_plan_prints_the_idle_groups_and_both_times(capsys):
    from hapt_hf.cli import main
    assert main(["plan", "--cluster", str(scenario_path(TWO_SITE))]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("idle groups"))
    assert "v100 (faster without them" in line and "with every group" in line
    assert "launch only the 8 ranks" in line


def test_plan_and_simulate_print_the_limit_of_the_groups_the_plan_uses(two_site, tmp_path, capsys):
    """A plan that idles groups is also measured against what its own GPUs could do: the
    physical limit over the groups it uses, in both commands' reports and their JSON."""
    from hapt_hf.cli import main
    from hapt_hf.planner.cost_model import CostModel
    from hapt_hf.planner.search import SearchProblem, physical_limit_s
    job, res = two_site
    used = physical_limit_s(SearchProblem(CostModel(job.model, job.cluster.subset(["a100"])),
                                          job.global_batch_size))
    whole = res.physical_limit_s
    assert used > whole  # fewer GPUs, a later limit
    distance = (res.sim.iteration_s - used) / used
    cluster = str(scenario_path(TWO_SITE))
    out_plan = tmp_path / "plan.json"
    assert main(["plan", "--cluster", cluster, "-o", str(out_plan)]) == 0
    assert main(["simulate", str(out_plan), "--cluster", cluster]) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if "on the groups it uses" in l]
    assert len(lines) == 2, out
    for line in lines:
        assert f"{used:.3f} s on the groups it uses (plan is {100 * distance:.1f}% above it)" \
            in line
    assert main(["simulate", str(out_plan), "--cluster", cluster, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["report"]
    assert got["used_limit_s"] == pytest.approx(used)
    assert got["used_limit_distance"] == pytest.approx(distance)
    # a plan using every group prints no such line
    rep = build_report(res.plan, res.sim, physical_limit_s=whole)
    assert "on the groups it uses" not in format_report(rep)


def test_launch_accepts_a_plan_that_leaves_groups_idle_beside_its_cluster(two_site, tmp_path):
    from types import SimpleNamespace

    from hapt_hf.integration.plan_resolution import _check_plan_against_cluster
    _, res = two_site
    from hapt_hf.planner.cluster import Cluster
    path = scenario_path(TWO_SITE)
    cfg = SimpleNamespace(cluster=str(path), plan="plan.json", source="hapt.yaml",
                          load_cluster=lambda: Cluster.load(path))
    _check_plan_against_cluster(res.plan, cfg)  # 8 ranks: the cluster without its V100s
    every = replace(res.plan, idle_groups=())
    with pytest.raises(PlanError, match=r"uses 8 ranks but the cluster .* has 12"):
        _check_plan_against_cluster(every, cfg)
