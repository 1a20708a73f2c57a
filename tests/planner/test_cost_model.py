"""Cost model: analytic and profiled times, cuts, all-reduce and memory per GPU."""
from __future__ import annotations

import pytest

from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import (DEFAULT_EFFICIENCY, GRAD_BUCKET_BYTES,
                                        STATE_BYTES_PER_PARAM, CostModel, CostModelError,
                                        overlapped_allreduce)
from hapt_hf.planner.model_spec import LayerSpec, ModelSpec
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.profile import LayerTiming, Profile, ProfileKey


def toy_model(blocks: int = 4, dtype: str = "fp16") -> ModelSpec:
    """Round figures: block = 1e12 fwd FLOPs/sample, 1000 params, 10 MB kept, 1 MB sent."""
    layers = [LayerSpec(0, "embedding", "emb", 500, 1e10, 2e10, 1e6, 1e6, 0.0)]
    for i in range(blocks):
        layers.append(LayerSpec(i + 1, "block", "blk", 1000, 1e12, 2e12, 1e6, 10e6, 1e6))
    layers.append(LayerSpec(blocks + 1, "head", "head", 200, 2e11, 4e11, 0.0, 5e6, 1e6))
    return ModelSpec("toy", "gpt2", 64, blocks, 100, 128, dtype, True, tuple(layers))


def group(name, tflops=100.0, mem=16.0, nodes=1, gpn=2, intra=(100.0, 10.0), inter=(10.0, 50.0)):
    return GpuGroup(name, GpuType(f"T-{name}", tflops, mem), nodes, gpn, LinkSpec(*intra),
                    LinkSpec(*inter))


def two_groups() -> Cluster:
    return Cluster("two", (group("a", 100.0, gpn=2, nodes=2), group("b", 50.0, gpn=2)),
                   (GroupLink("a", "b", LinkSpec(8.0, 1000.0)),))


def test_analytic_compute_time_is_flops_over_effective_speed():
    cm = CostModel(toy_model(), two_groups())
    a = cm.group("a")
    f, b = cm.compute_s(a, 3, 1, 3)  # two blocks, three samples
    speed = 100e12 * DEFAULT_EFFICIENCY
    assert f == pytest.approx(3 * 2e12 / speed)
    assert b == pytest.approx(3 * 4e12 / speed)


def test_recompute_adds_one_forward_of_the_blocks_only():
    cm = CostModel(toy_model(), two_groups())
    a = cm.group("a")
    f, b = cm.compute_s(a, 1, 0, 3)
    _, b_rc = cm.compute_s(a, 1, 0, 3, recompute=True)
    block_fwd = 2 * 1e12 / (100e12 * DEFAULT_EFFICIENCY)
    assert b_rc - b == pytest.approx(block_fwd)


def test_profile_times_replace_the_analytic_ones_for_measured_devices():
    m = toy_model()
    prof = Profile({ProfileKey("T-a", sig, 2, m.seq_len, m.dtype): LayerTiming(0.5, 1.0, 0.01)
                    for sig in ("emb", "blk", "head")})
    cm = CostModel(m, two_groups(), prof)
    f, b = cm.compute_s(cm.group("a"), 2, 0, m.num_layers)
    assert (f, b) == (pytest.approx(0.5 * m.num_layers), pytest.approx(1.0 * m.num_layers))
    assert cm.update_s(cm.group("a"), 2, 0, 2) == pytest.approx(0.02)
    # group b's device has no entries: analytic
    f_b, _ = cm.compute_s(cm.group("b"), 2, 1, 2)
    assert f_b == pytest.approx(2 * 1e12 / (50e12 * DEFAULT_EFFICIENCY))


def test_cut_between_groups_moves_the_whole_micro_batch_over_the_group_link():
    cm = CostModel(toy_model(), two_groups())
    left, right = cm.slice_replicas(cm.group("a"), 2, 0, 4), cm.slice_replicas(cm.group("b"), 1, 0, 4)
    t = cm.cut_s(left, right, last_layer=2, mbs=4)
    assert t == pytest.approx(4 * 1e6 * 8 / 8e9 + 1e-3)


def test_cut_inside_a_group_is_set_by_the_busiest_rank():
    cm = CostModel(toy_model(), two_groups())
    a = cm.group("a")  # 2 nodes x 2 GPUs
    same_node = cm.cut_s(cm.slice_replicas(a, 1, 0, 4), cm.slice_replicas(a, 1, 1, 4), 1, mbs=4)
    assert same_node == pytest.approx(4 * 1e6 * 8 / 100e9 + 10e-6)
    # width 1 -> width 2 across nodes: the single sender carries all 4 samples
    cross = cm.cut_s(cm.slice_replicas(a, 1, 1, 4), cm.slice_replicas(a, 2, 2, 4), 1, mbs=4)
    assert cross == pytest.approx(4 * 1e6 * 8 / 10e9 + 50e-6)
    # width 2 -> width 2: each rank sends its 2 samples in parallel
    wide = cm.cut_s(cm.slice_replicas(a, 2, 0, 4), cm.slice_replicas(a, 2, 2, 4), 1, mbs=4)
    assert wide == pytest.approx(2 * 1e6 * 8 / 10e9 + 50e-6)
    assert cm.cut_latency_s(cm.slice_replicas(a, 1, 0, 4), cm.slice_replicas(a, 1, 1, 4),
                            4) == pytest.approx(10e-6)
    assert cm.cut_latency_s(cm.slice_replicas(a, 2, 0, 4), cm.slice_replicas(a, 2, 2, 4),
                            4) == pytest.approx(50e-6)


def test_ring_allreduce_uses_inter_node_link_when_the_stage_spans_nodes():
    m = toy_model()
    cm = CostModel(m, two_groups())
    a = cm.group("a")
    nbytes = 2 * 1000 * 4  # two blocks of 1000 gradients: fp32 in every precision
    inside = cm.allreduce_s(cm.slice_replicas(a, 2, 0, 2), 1, 3)
    assert inside == pytest.approx(2 * 1 / 2 * nbytes / (100e9 / 8) + 2 * 1 * 10e-6)
    spans = cm.allreduce_s(cm.slice_replicas(a, 4, 0, 4), 1, 3)
    assert spans == pytest.approx(2 * 3 / 4 * nbytes / (10e9 / 8) + 2 * 3 * 50e-6)
    assert cm.allreduce_s(cm.slice_replicas(a, 1, 0, 1), 1, 3) == 0.0


def test_memory_counts_state_in_flight_activations_and_one_working_set():
    m = toy_model()
    cm = CostModel(m, two_groups())
    static = (1000 + 1000) * STATE_BYTES_PER_PARAM
    mem = cm.memory_bytes(samples=2, a=1, b=3, in_flight=3)
    assert mem == pytest.approx(static + 3 * 2 * 20e6 + 2 * 10e6)
    rc = cm.memory_bytes(samples=2, a=1, b=3, in_flight=3, recompute=True)
    assert rc == pytest.approx(static + 3 * 2 * 2e6 + 2 * 10e6)
    assert rc < mem


def test_plan_costs_reads_shapes_from_ranks_and_checks_widths():
    m = toy_model()
    cl = two_groups()
    cm = CostModel(m, cl)
    stages = (Stage.even(0, (0, 3), "a", "T-a", (0, 1, 2, 3), 2, micro_batch_size=4),
              Stage.even(1, (3, 6), "b", "T-b", (4, 5), 1, micro_batch_size=4))
    plan = Plan("toy", m.num_layers, m.seq_len, 8, 4, 2, "1f1b", stages)
    costs = cm.plan_costs(plan)
    assert costs.num_stages == 2
    assert costs.stages[0].send_forward_s == costs.stages[1].send_backward_s > 0
    assert costs.stages[0].send_backward_s == 0 and costs.stages[1].send_forward_s == 0
    # the a-b link's 1000 us latency is the part of the cut the link is not held for
    assert costs.stages[0].send_forward_latency_s == pytest.approx(1e-3)
    assert costs.stages[1].send_backward_latency_s == pytest.approx(1e-3)
    assert costs.stages[0].send_forward_busy_s == pytest.approx(
        costs.stages[0].send_forward_s - 1e-3)
    # each of the 4 replicas of stage 0 computes one sample of the 4-sample micro-batch
    assert costs.stages[0].forward_s == pytest.approx(cm.compute_s(cm.group("a"), 1, 0, 3)[0])
    bad = Plan("toy", m.num_layers, m.seq_len, 6, 3, 2, "1f1b", stages)
    with pytest.raises(CostModelError, match="multiple of every stage's width"):
        cm.plan_costs(bad)


def test_stages_on_unlinked_groups_or_unknown_groups_are_refused():
    cl = Cluster("c", (group("a"), group("b"), group("c")),
                 (GroupLink("a", "b", LinkSpec(8, 10)), GroupLink("b", "c", LinkSpec(8, 10))))
    cm = CostModel(toy_model(), cl)
    with pytest.raises(CostModelError, match="no link between them"):
        cm.cut_s(cm.slice_replicas(cm.group("a"), 1, 0, 1),
                 cm.slice_replicas(cm.group("c"), 1, 0, 1), 1, 1)
    with pytest.raises(CostModelError, match="is not in cluster"):
        cm.group("zzz")
    with pytest.raises(CostModelError, match="memory_headroom"):
        CostModel(toy_model(), cl, memory_headroom=1.5)


# -- the gradient all-reduce overlapped with the last backward ------------------------------

CAP = GRAD_BUCKET_BYTES


def test_short_allreduce_hides_behind_the_last_backward_but_its_last_bucket():
    # ten layers of 1 s backward and one bucket each, 0.5 s per bucket on the link: every bucket
    # is done before the next is ready, so only the last one (ready as the backward ends) shows
    w = overlapped_allreduce([(1.0, CAP)] * 10, CAP, lambda n: 0.5 * n / CAP)
    assert w.link_s == pytest.approx(5.0)
    assert w.lead_s == pytest.approx(9.0)  # the first bucket starts after the first layer
    assert w.exposed_s == pytest.approx(0.5)


def test_long_allreduce_exposes_what_the_backward_cannot_hide():
    # four buckets of 3 s ready at 1, 2, 3, 4 s: the link is the bottleneck from 1 s on
    w = overlapped_allreduce([(1.0, CAP)] * 4, CAP, lambda n: 3.0 * n / CAP)
    assert w.link_s == pytest.approx(12.0)
    assert w.lead_s == pytest.approx(3.0)
    assert w.exposed_s == pytest.approx(1.0 + 12.0 - 4.0)


def test_buckets_cut_the_byte_stream_and_the_rest_goes_last():
    # 2.5 buckets of gradients in the first layer, none in the second: two full buckets at 1 s,
    # the half bucket when the first layer is done, then the rest after the second layer
    w = overlapped_allreduce([(1.0, 2.5 * CAP), (2.0, 0.0)], CAP, lambda n: n / CAP)
    assert w.link_s == pytest.approx(2.5)
    assert w.lead_s == pytest.approx(2.0)
    assert w.exposed_s == pytest.approx(0.5)  # the rest is ready only at 3 s
    # a stage smaller than one bucket all-reduces after its backward, as DDP does
    w = overlapped_allreduce([(1.0, 10.0), (1.0, 10.0)], CAP, lambda n: 0.25)
    assert (w.link_s, w.lead_s, w.exposed_s) == (0.25, 0.0, 0.25)
    assert overlapped_allreduce([(1.0, 0.0)], CAP, lambda n: 1.0).link_s == 0.0


def big_model(blocks: int = 8) -> ModelSpec:
    """Blocks of 2**23 fp32 gradients (32 MiB: 1.28 buckets each)."""
    p = 2**23
    layers = [LayerSpec(0, "embedding", "emb", p, 1e10, 2e10, 1e6, 1e6, 0.0)]
    for i in range(blocks):
        layers.append(LayerSpec(i + 1, "block", "blk", p, 1e12, 2e12, 1e6, 10e6, 1e6))
    layers.append(LayerSpec(blocks + 1, "head", "head", p, 2e11, 4e11, 0.0, 5e6, 1e6))
    return ModelSpec("big", "gpt2", 64, blocks, 100, 128, "fp16", False, tuple(layers))


@pytest.mark.parametrize("intra_gbps,hidden", [(1000.0, True), (2.0, False)])
def test_cost_model_prices_the_stage_all_reduce_against_its_last_backward(intra_gbps, hidden):
    cl = Cluster("one", (group("a", 100.0, gpn=4, intra=(intra_gbps, 10.0)),), ())
    cm = CostModel(big_model(), cl)
    a = cm.group("a")
    shape = cm.slice_replicas(a, 2, 0, 2)  # one sample each
    costs = cm.stage_costs([Stage(0, (0, 10), shape)], 2).stages[0]
    w = cm.allreduce_window(shape, 0, 10)
    assert (costs.allreduce_s, costs.allreduce_lead_s, costs.allreduce_exposed_s) == \
        (w.link_s, w.lead_s, w.exposed_s)
    # the same bytes as one all-reduce, paying the latency once per bucket
    buckets = -(-10 * 2**25 // CAP)
    whole = cm.allreduce_s(shape, 0, 10)
    assert w.link_s == pytest.approx(whole + (buckets - 1) * 2 * 10e-6)
    assert w.lead_s + w.exposed_s >= w.link_s - 1e-12  # the link never runs two buckets at once
    assert w.lead_s < costs.backward_s
    if hidden:  # the link is far faster than the backward: about one bucket is left over
        assert w.link_s < costs.backward_s
        assert w.exposed_s <= 2 * w.link_s / buckets
    else:  # the link is the bottleneck once the first bucket is ready
        assert w.link_s > costs.backward_s
        first_ready = costs.backward_s - w.lead_s
        assert w.exposed_s == pytest.approx(first_ready + w.link_s - costs.backward_s)
    assert costs.allreduce_after_s == w.exposed_s < w.link_s


def test_width_one_stage_has_no_allreduce():
    cm = CostModel(big_model(), Cluster("one", (group("a", gpn=4),), ()))
    one = cm.slice_replicas(cm.group("a"), 1, 0, 2)
    w = cm.allreduce_window(one, 0, 10)
    assert (w.link_s, w.lead_s, w.exposed_s) == (0.0, 0.0, 0.0)
    c = cm.stage_costs([Stage(0, (0, 10), one)], 2).stages[0]
    assert c.allreduce_s == c.allreduce_lead_s == c.allreduce_after_s == 0.0


def test_recompute_lengthens_the_backward_that_hides_the_all_reduce():
    cl = Cluster("one", (group("a", 100.0, gpn=4, intra=(2.0, 10.0)),), ())
    cm = CostModel(big_model(), cl)
    shape = cm.slice_replicas(cm.group("a"), 2, 0, 2)  # one sample each
    plain = cm.allreduce_window(shape, 0, 10)
    rc = cm.allreduce_window(shape, 0, 10, recompute=True)
    assert rc.link_s == plain.link_s
    # the link is the bottleneck: the longer backward hides its whole extra length
    _, b = cm.compute_s(cm.group("a"), 1, 0, 10)
    _, b_rc = cm.compute_s(cm.group("a"), 1, 0, 10, recompute=True)
    assert rc.exposed_s == pytest.approx(plain.exposed_s - (b_rc - b))


def _cpu_twin(g: GpuGroup) -> GpuGroup:
    return GpuGroup(g.name, GpuType(g.gpu.name, g.gpu.tflops, g.gpu.memory_gb, is_cpu=True),
                    g.nodes, g.gpus_per_node, g.intra_node, g.inter_node)


@pytest.mark.parametrize("mixed", [False, True])
def test_on_cpu_devices_the_all_reduce_runs_after_the_backward(mixed):
    """Gloo's copies and reductions run on the cores the backward runs on: nothing hides."""
    gpu = group("a", 100.0, gpn=4, intra=(1000.0, 10.0))
    cpu = _cpu_twin(gpu)
    windows = {}
    for g in (gpu, cpu):
        cm = CostModel(big_model(), Cluster("one", (g,), ()))
        a = cm.group("a")
        shape = (cm.gpu_replicas([(a, 0), (a, 1)], (2, 1)) if mixed
                 else cm.slice_replicas(a, 2, 0, 2))
        c = cm.stage_costs([Stage(0, (0, 10), shape)], 3 if mixed else 2).stages[0]
        windows[g.gpu.is_cpu] = c
    on_gpu, on_cpu = windows[False], windows[True]
    assert on_cpu.allreduce_s == pytest.approx(on_gpu.allreduce_s)  # the same buckets
    assert on_cpu.allreduce_lead_s == 0.0
    assert on_cpu.allreduce_after_s == pytest.approx(on_cpu.allreduce_s)
    assert on_gpu.allreduce_after_s < 0.5 * on_gpu.allreduce_s  # the fast link hides most
