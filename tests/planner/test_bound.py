"""Schedule-free lower bounds: never above a replay, tight where the simulator has no choice."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings

from hapt_hf.core.schedules import warmups_from_steps
from benchmarks.bound import (best_warmup_replay, layouts_below, lower_bound_s,
                                   sequence_replicas, stage_sequences)
from hapt_hf.planner.cluster import Cluster, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from benchmarks.exhaustive import exhaustive_plan
from hapt_hf.planner.job import load_job
from hapt_hf.planner.search import (Layout, PlanningError, SearchProblem, compositions, divisors,
                                    layout_of_plan, plan_job, recompute_flags, simulate_layout)

from benchmarks.inputs import scenario_path
from tests.planner.test_search import jobs, make_group, synth_model


def _replays(cm: CostModel, gbs: int):
    """Every layout of a tiny job under every warm-up with steps 1..3, replayed in full."""
    L = cm.model.num_layers
    for seq in stage_sequences(cm.cluster, interleave=True):
        n = len(seq)
        if n > L:
            continue
        for mbs in divisors(gbs):
            if mbs % math.lcm(*(w for _, w, _ in seq)):
                continue
            shapes = sequence_replicas(cm, seq, mbs)
            m = gbs // mbs
            for sizes in compositions(L, n):
                edges = list(itertools.accumulate(sizes, initial=0))
                bounds = tuple(zip(edges, edges[1:]))
                for steps in itertools.product((1, 2, 3), repeat=n - 1):
                    warm = warmups_from_steps(steps, m)
                    for rc in {recompute_flags(cm, shapes, bounds, mbs, warm, True),
                               (True,) * n, (False,) * n} - {None}:
                        lay = Layout.build(shapes, bounds, rc, mbs, warm, "h1f1b")
                        yield lay, m, simulate_layout(cm, lay, m, exact=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(max_groups=2, max_gpus=2, max_blocks=3))
def test_no_replay_is_faster_than_its_layouts_bound(job):
    model, cluster, gbs = job
    cm = CostModel(model, cluster)
    for lay, m, r in _replays(cm, min(gbs, 4)):
        if r.feasible:
            lb = lower_bound_s(cm, lay.stages, lay.micro_batch_size, m)
            assert lb <= r.iteration_s * (1 + 1e-9), (lay, lb, r.iteration_s)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(max_groups=2, max_gpus=2, max_blocks=3))
def test_the_optimum_is_among_the_layouts_below_any_higher_target(job):
    model, cluster, gbs = job
    gbs = min(gbs, 4)
    try:
        best = exhaustive_plan(model, cluster, gbs)
    except PlanningError:
        return
    cm = CostModel(model, cluster)
    problem = SearchProblem(cm, gbs)
    below, _ = layouts_below(problem, best.sim.iteration_s * 1.001)
    want = layout_of_plan(cm, best.plan)
    assert (want.shapes, want.bounds, want.micro_batch_size) in \
        {(tuple(s.replicas for s in b.stages), tuple(s.layers for s in b.stages),
          b.micro_batch_size) for b in below}
    # and none of them replays faster than the exhaustive search's best
    for bl in below:
        got = best_warmup_replay(problem, bl)
        assert got is None or got[1].iteration_s >= best.sim.iteration_s * (1 - 1e-9)


def test_one_gpu_bound_is_the_whole_iteration():
    model = synth_model(3, 256)
    cluster = Cluster("one", (make_group("a", 50.0, 16.0, 1),), ())
    cm = CostModel(model, cluster)
    shapes = sequence_replicas(cm, next(stage_sequences(cluster)), 2)
    bounds = ((0, model.num_layers),)
    lay = Layout.build(shapes, bounds, (False,), 2, (4,), "h1f1b")
    r = simulate_layout(cm, lay, 4, exact=True)
    assert lower_bound_s(cm, lay.stages, 2, 4) == pytest.approx(r.iteration_s, rel=1e-12)


def test_memory_slots_raise_the_bound():
    """A stage that holds one micro-batch at a time waits a whole round trip for each."""
    model = synth_model(4, 512)
    roomy = (make_group("a", 50.0, 16.0, 1), make_group("b", 50.0, 16.0, 1))
    link = (GroupLink("a", "b", LinkSpec(100.0, 10.0)),)
    cm = CostModel(model, Cluster("c", roomy, link))
    bounds = ((0, 3), (3, model.num_layers))

    def stages(cm: CostModel):
        reps = sequence_replicas(cm, next(stage_sequences(cm.cluster)), 1)
        return Layout.build(reps, bounds, (False, False), 1, (1, 1), "h1f1b").stages

    free = lower_bound_s(cm, stages(cm), 1, 8, allow_recompute=False)
    need = cm.memory_bytes(1, 0, 3, 1) / (cm.memory_headroom * 1e9)
    tight = (make_group("a", 50.0, need * 1.01, 1), roomy[1])
    cm_t = CostModel(model, Cluster("c", tight, link))
    capped = lower_bound_s(cm_t, stages(cm_t), 1, 8, allow_recompute=False)
    assert capped > free * 1.2
    r = simulate_layout(cm_t, Layout(stages(cm_t), 1, "h1f1b"), 8, exact=True)
    assert r.feasible and capped <= r.iteration_s * (1 + 1e-9)


def test_interleaved_sequences_visit_a_group_twice():
    cluster = Cluster("c", (make_group("a", 50.0, 16.0, 2), make_group("b", 50.0, 16.0, 1)),
                      (GroupLink("a", "b", LinkSpec(100.0, 10.0)),))
    plain = {tuple((g.name, w, off) for g, w, off in sq) for sq in stage_sequences(cluster)}
    mixed = {tuple((g.name, w, off) for g, w, off in sq)
             for sq in stage_sequences(cluster, interleave=True)}
    assert (("a", 1, 0), ("b", 1, 0), ("a", 1, 1)) in mixed - plain
    assert plain == {(("a", 2, 0), ("b", 1, 0)), (("b", 1, 0), ("a", 2, 0)),
                     (("a", 1, 0), ("a", 1, 1), ("b", 1, 0)),
                     (("b", 1, 0), ("a", 1, 0), ("a", 1, 1))}


def test_consumer_plan_meets_its_own_bound():
    """The planner's consumer plan replays exactly at its layout's bound: last stage's fill,
    its compute and its exposed all-reduce (docs/planner.md); no warm-up can do better."""
    job = load_job(scenario_path("consumer_rtx4080x4_rtx4090x4"))
    res = plan_job(job.model, job.cluster, job.global_batch_size)
    model = job.model.with_layer_unit(res.plan.layer_unit)
    cm = CostModel(model, job.cluster)
    lay = layout_of_plan(cm, res.plan)
    lb = lower_bound_s(cm, lay.stages, lay.micro_batch_size, res.plan.num_microbatches)
    assert lb == pytest.approx(res.sim.iteration_s, rel=1e-9)
