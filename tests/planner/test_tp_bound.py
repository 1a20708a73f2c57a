"""The lower bound over every plan of a job (benchmarks/tp_bound.py) is never above a replay."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

from hapt_hf.core.schedules import warmups_from_steps, zero_bubble_deferrals
from hapt_hf.planner.cluster import Cluster, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.search import (Layout, SearchProblem, compositions, divisors,
                                    physical_limit_s, plan_job, recompute_flags,
                                    simulate_layout)
from hapt_hf.planner.search.kinds import replay_kind
from hapt_hf.planner.simulate import backward_split

from benchmarks.bound import sequence_replicas, stage_sequences
import numpy as np

from benchmarks.tp_bound import (_need, beta_floor, one_path, replica_menu, replica_use,
                                 rho_floor, tp_lower_bound_s)
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
    # one path with every group's GPUs counted rules out more, never a replay
    one = tp_lower_bound_s(model, cluster, gbs, min(times), grid=16, steps=8, exact=True)
    assert got.bound_s <= one.bound_s < min(times)


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
    one = tp_lower_bound_s(model, cluster, gbs, min(times), grid=16, steps=8, exact=True)
    assert got.bound_s <= one.bound_s < min(times)


def test_one_path_counts_each_groups_gpus():
    """The one-path search returns a path over every layer within each group's GPUs, and
    none where the cluster has no GPU to give."""
    model = synth_model(4, 512)
    cluster = _cluster(16.0, 16.0)
    gbs, mbs, grid = 8, 2, 16
    cm = CostModel(model, cluster)
    rho, beta = rho_floor(cm, gbs), beta_floor(cm, gbs)
    sizes = np.array([g.size for g in cluster.groups], dtype=float)
    speed = np.array([1.0 / cm.sample_time_s(g, 1) for g in cluster.groups])
    target = 3.0 * physical_limit_s(SearchProblem.build(model, cluster, gbs))
    menu = replica_menu(cm, gbs, mbs, target, 25, grid)
    out, _, _ = _need(menu, sizes, speed, rho, beta, grid, 24.0, mbs / gbs, 25)
    assert not out  # the prices do not rule this target out
    prices = [speed / (speed @ sizes)]
    found, path, made = one_path(menu, prices, sizes, rho, grid, 24.0, mbs / gbs, beta)
    assert found and made > 0
    edges = [(a, b) for _, _, a, b, _, _, _ in path]
    assert edges[0][0] == 0 and edges[-1][1] == cm.model.num_layers
    assert all(x[1] == y[0] for x, y in zip(edges, edges[1:]))
    assert np.all(replica_use(menu, path) <= sizes)
    # a cluster with no GPU to give fits no path
    none = np.zeros_like(sizes)
    found, path, _ = one_path(menu, prices, none, rho, grid, 24.0, mbs / gbs, beta)
    assert found is False and path == []


def test_chain_rule_holds_on_every_replay():
    """Rule 5 (the warm-up chain) on replays of deep pipelines of unlike stages: where the
    replay runs, each stage's warm-up ``w_s`` and the next one's obey, with
    ``delta = w_s - w_{s+1} + 1`` and the replay's own time ``T``, ``T >= floor((M - w_{s+1})
    / delta) ((f + i)_s + (f + i)_{s+1})``; under 1F1B's shape also with the whole compute of
    both stages, under zero_bubble with the stage's own weight gradient counted over
    ``M - w_{s+1} - d_s``."""
    rng = random.Random(5)
    model = synth_model(10, 512)
    groups = (make_group("a", 125.0, 80.0, 4), make_group("b", 50.0, 80.0, 4))
    cluster = Cluster("c", groups, (GroupLink("a", "b", LinkSpec(100.0, 10.0)),))
    cm = CostModel(model, cluster)
    M = 32
    checked = 0
    for trial in range(120):
        n = rng.randint(3, 8)
        if trial % 2:   # unlike stages, any cuts, recompute here and there
            gpus = rng.sample(range(8), n)
            cuts = sorted(rng.sample(range(1, model.num_layers), n - 1))
            rc = tuple(rng.random() < 0.3 for _ in range(n))
        else:           # alike stages of even compute: shares near 1, the rule near binding
            gpus = list(range(4, 4 + min(n, 4))) + list(range(max(0, n - 4)))
            n = len(gpus)
            cuts = sorted(rng.sample(range(2, model.num_layers - 1), n - 1)) if n > 4 else \
                [1 + (model.num_layers - 2) * j // n for j in range(1, n)]
            rc = (False,) * n
        shapes = tuple(cm.replicas_at(groups[g // 4], g % 4, 1, 1, 1) for g in gpus)
        edges = [0] + cuts + [model.num_layers]
        bounds = tuple(zip(edges, edges[1:]))
        warm = warmups_from_steps([rng.choice((0, 1, 1, 2, 3)) for _ in range(n - 1)], M)
        kind = rng.choice(("h1f1b", "zero_bubble"))
        lay = Layout.build(shapes, bounds, rc, 1, warm, kind)
        if kind == "zero_bubble" and rng.random() < 0.5:
            lay = Layout(tuple(replace(s, deferral=rng.randint(0, 4)) for s in lay.stages), 1, kind)
        r = replay_kind(cm, lay, M)
        if not r.feasible:
            continue
        T = r.iteration_s
        costs = cm.stage_costs(lay.stages, 1).stages
        defer = zero_bubble_deferrals(lay.warmups, M, [s.deferral for s in lay.stages])
        for s in range(n - 1):
            w, w2 = lay.warmups[s], lay.warmups[s + 1]
            delta = w - w2 + 1
            assert delta >= 1
            fi = [c.forward_s + backward_split(c)[0] for c in (costs[s], costs[s + 1])]
            c_all = [c.forward_s + c.backward_s for c in (costs[s], costs[s + 1])]
            assert T >= (M - w2) // delta * (fi[0] + fi[1]) * (1 - 1e-9)
            if kind == "h1f1b":
                assert T >= (M - w2) // delta * (c_all[0] + c_all[1]) * (1 - 1e-9)
            else:
                span = max(M - w2 - defer[s], 0)
                assert T >= span // delta * (c_all[0] + fi[1]) * (1 - 1e-9)
            checked += 1
    assert checked > 100
