"""The lower bound over every plan of a job (benchmarks/tp_bound.py) is never above a replay."""
from __future__ import annotations

import itertools
import math

from hapt_hf.core.schedules import warmups_from_steps
from hapt_hf.planner.cluster import Cluster, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.search import (Layout, SearchProblem, compositions, divisors,
                                    physical_limit_s, plan_job, recompute_flags,
                                    simulate_layout)

from benchmarks.bound import sequence_replicas, stage_sequences
from benchmarks.tp_bound import tp_lower_bound_s
from tests.planner.test_search import make_group, synth_model


def _cluster(mem_a: float, mem_b: float) -> Cluster:
    return Cluster("c", (make_group("a", 125.0, mem_a, 2), make_group("b", 50.0, mem_b, 2)),
                   (GroupLink("a", "b", LinkSpec(100.0, 10.0)),))


def _replays(cm: CostModel, gbs: int):
    """Every layout of the job (one group after the other, any widths) under warm-up steps
    1..2, an even-ish layer split and recompute where needed, all off and all on."""
    L = cm.model.num_layers
    for seq in stage_sequences(cm.cluster):
        n = len(seq)
        for mbs in divisors(gbs):
            if mbs % math.lcm(*(w for _, w, _ in seq)):
                continue
            shapes = sequence_replicas(cm, seq, mbs)
            for sizes in compositions(L, n):
                edges = list(itertools.accumulate(sizes, initial=0))
                bounds = tuple(zip(edges, edges[1:]))
                for steps in itertools.product((1, 2), repeat=n - 1):
                    warm = warmups_from_steps(steps, gbs // mbs)
                    for rc in {recompute_flags(cm, shapes, bounds, mbs, warm, True),
                               (False,) * n, (True,) * n} - {None}:
                        for kind in ("h1f1b", "zero_bubble"):
                            lay = Layout.build(shapes, bounds, rc, mbs, warm, kind)
                            r = simulate_layout(cm, lay, gbs // mbs, exact=True)
                            if r.feasible:
                                yield r.iteration_s


def test_bound_is_below_the_plan_and_every_replay():
    model = synth_model(3, 512)
    cluster = _cluster(16.0, 16.0)
    gbs = 8
    res = plan_job(model, cluster, gbs)
    limit = physical_limit_s(SearchProblem.build(model, cluster, gbs))
    got = tp_lower_bound_s(model, cluster, gbs, res.sim.iteration_s, grid=16, steps=8)
    # the plan's own time is never ruled out: the bisection's lower end is below it
    assert limit * (1 - 1e-9) <= got.bound_s < res.sim.iteration_s
    times = list(_replays(CostModel(model, cluster), gbs))
    assert times
    got = tp_lower_bound_s(model, cluster, gbs, min(times), grid=16, steps=8)
    assert got.bound_s < min(times)  # nor the fastest replay's


def test_bound_stays_below_replays_where_memory_is_tight():
    """GPUs that hold about one block and one micro-batch of one sample: deep pipelines,
    recompute; memory slots lift the bound above the physical limit (about 6% here),
    and it is still no replay's better."""
    model = synth_model(4, 512)
    gbs = 8
    cm0 = CostModel(model, _cluster(16.0, 16.0))
    need = cm0.memory_bytes(1, 1, 3, 1) / (cm0.memory_headroom * 1e9) * 1.01
    cluster = _cluster(need, need)
    limit = physical_limit_s(SearchProblem.build(model, cluster, gbs))
    times = list(_replays(CostModel(model, cluster), gbs))
    assert times
    got = tp_lower_bound_s(model, cluster, gbs, min(times), grid=16, steps=8)
    assert limit * 1.05 <= got.bound_s < min(times)
