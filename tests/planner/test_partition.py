"""The min-max partition: reusing a greedy pass's answer across the bisection's caps is exact."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.search.partition import partition_layers

from tests.planner.test_search import jobs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(max_groups=3, max_gpus=4, max_blocks=8), st.data())
def test_reusing_passes_gives_the_partition_of_running_every_pass(job, data):
    """On random stages (each a slice of a group's GPUs, in the groups' order), micro-batches
    in flight and options, the partition found with reuse equals the one found running every
    greedy pass: the same layer ranges, recompute, states, sequence parallelism and cap."""
    model, cluster, gbs = job
    cm = CostModel(model, cluster)
    mbs = data.draw(st.sampled_from([d for d in (1, 2, 4) if gbs % d == 0]))
    shapes = []
    for g in cluster.groups:
        left = g.size
        while left:
            width = data.draw(st.integers(1, left))
            if mbs % width:
                width = 1
            shapes.append(cm.replicas_at(g, g.size - left, width, 1, mbs))
            left -= width
    shapes = shapes[:model.num_layers]
    in_flight = [data.draw(st.integers(1, 6)) for _ in shapes]
    opts = dict(allow_recompute=data.draw(st.booleans()),
                allow_sharded=data.draw(st.booleans()),
                lower_bound_s=data.draw(st.sampled_from([0.0, 1e-4, 1e-2])))
    got = partition_layers(cm, shapes, mbs, in_flight, **opts)
    want = partition_layers(cm, shapes, mbs, in_flight, reuse=False, **opts)
    assert got == want
    if want is not None:
        assert want.bounds[0][0] == 0 and want.bounds[-1][1] == model.num_layers
