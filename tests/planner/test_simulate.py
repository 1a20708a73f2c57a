"""Event simulator against closed forms, transfers, memory and deadlock."""
from __future__ import annotations

import pytest

from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import StageCost, StageCosts
from hapt_hf.planner.model_spec import LayerSpec, ModelSpec
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.schedule import build_schedule
from hapt_hf.planner.simulate import simulate_plan, simulate_schedule


def stage(f=1.0, b=2.0, send=0.0, ar=0.0, upd=0.0, static=0.0, act=1.0, cap=0.0):
    return StageCost(f, b, send, send, ar, upd, static, act, 0.0, cap)


def costs(n, **kw):
    st = [stage(**kw) for _ in range(n)]
    # no sends out of the ends
    st[0] = StageCost(**{**st[0].__dict__, "send_backward_s": 0.0})
    st[-1] = StageCost(**{**st[-1].__dict__, "send_forward_s": 0.0})
    return StageCosts(tuple(st))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "h1f1b"])
@pytest.mark.parametrize("n,m", [(1, 1), (1, 5), (2, 3), (4, 4), (4, 16), (6, 9)])
def test_uniform_stages_without_communication_match_the_closed_form(kind, n, m):
    sched = build_schedule(kind, n, m)
    r = simulate_schedule(sched, costs(n, f=1.0, b=2.0))
    assert r.feasible, r.reason
    assert r.iteration_s == pytest.approx((m + n - 1) * 3.0)
    assert r.bubble_fraction == pytest.approx(1 - m * 3.0 / r.iteration_s)
    assert r.stage_busy_s == pytest.approx((m * 3.0,) * n)


def test_one_microbatch_crosses_each_link_twice():
    sched = build_schedule("1f1b", 2, 1)
    st = StageCosts((StageCost(1.0, 2.0, 0.5, 0.0, 0.1, 0.2, 0, 0, 0, 0),
                     StageCost(3.0, 4.0, 0.0, 0.5, 0.0, 0.0, 0, 0, 0, 0)))
    r = simulate_schedule(sched, st)
    # F0 1 | send 0.5 | F1 3 + B1 4 | send 0.5 | B0 2 | all-reduce 0.1 + update 0.2
    assert r.iteration_s == pytest.approx(1 + 0.5 + 3 + 4 + 0.5 + 2 + 0.1 + 0.2)
    kinds = [e.kind for e in r.events if e.stage == 0]
    assert kinds == ["F", "SEND_F", "B", "ALLREDUCE", "UPDATE"]


def test_allreduce_overlapping_the_last_backward_shows_its_real_interval():
    sched = build_schedule("1f1b", 2, 1)
    base = dict(send_forward_s=0.5, send_backward_s=0.0, update_s=0.2, static_bytes=0,
                activation_bytes=0, working_bytes=0, capacity_bytes=0)
    # stage 0: 2 s of all-reduce link time, 1.5 s of it during its 2 s last backward
    st = StageCosts((StageCost(1.0, 2.0, allreduce_s=2.0, allreduce_lead_s=1.5,
                               allreduce_exposed_s=0.6, **base),
                     StageCost(3.0, 4.0, **{**base, "send_forward_s": 0.0,
                                            "send_backward_s": 0.5, "update_s": 0.0},
                               allreduce_s=0.0)))
    r = simulate_schedule(sched, st)
    last_b = 1 + 0.5 + 3 + 4 + 0.5 + 2
    ar = [e for e in r.events if e.kind == "ALLREDUCE" and e.stage == 0]
    assert len(ar) == 1 and (ar[0].start, ar[0].end) == (pytest.approx(last_b - 1.5),
                                                         pytest.approx(last_b + 0.6))
    upd = [e for e in r.events if e.kind == "UPDATE" and e.stage == 0][0]
    assert upd.start == pytest.approx(last_b + 0.6)
    assert r.iteration_s == pytest.approx(last_b + 0.6 + 0.2)
    # the same stage with nothing overlapped pays the whole link time after the backward
    plain = StageCosts((StageCost(1.0, 2.0, allreduce_s=2.0, **base), st.stages[1]))
    assert simulate_schedule(sched, plain).iteration_s == pytest.approx(last_b + 2.0 + 0.2)


def test_transfers_of_one_direction_are_serialised():
    # stage 0 produces every 1 s but the link needs 2 s per micro-batch: the link paces it
    n, m = 2, 6
    st = StageCosts((StageCost(1.0, 0.1, 2.0, 0.0, 0, 0, 0, 0, 0, 0),
                     StageCost(0.1, 0.1, 0.0, 0.0, 0, 0, 0, 0, 0, 0)))
    r = simulate_schedule(build_schedule("gpipe", n, m), st)
    sends = sorted((e.start, e.end) for e in r.events if e.kind == "SEND_F")
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(sends, sends[1:]))
    assert sends[-1][1] == pytest.approx(1.0 + 2.0 * m)


def test_the_latency_of_one_transfer_overlaps_the_next():
    # the link needs 2 s a micro-batch, 1.5 s of it latency: it holds the link 0.5 s and the
    # transfers pipeline (as on a real link), so the producer (1 s a forward) paces them
    n, m = 2, 6
    st = StageCosts((StageCost(1.0, 0.1, 2.0, 0.0, 0, 0, 0, 0, 0, 0,
                               send_forward_latency_s=1.5),
                     StageCost(0.1, 0.1, 0.0, 0.0, 0, 0, 0, 0, 0, 0)))
    r = simulate_schedule(build_schedule("gpipe", n, m), st)
    sends = sorted((e.start, e.end) for e in r.events if e.kind == "SEND_F")
    assert [a for a, _ in sends] == pytest.approx([1.0 + i for i in range(m)])
    assert all(b - a == pytest.approx(2.0) for a, b in sends)   # each arrives 2 s after
    # a transfer busier than the producer: the link paces, at its busy time, not its total
    st2 = StageCosts((StageCost(1.0, 0.1, 4.0, 0.0, 0, 0, 0, 0, 0, 0,
                                send_forward_latency_s=2.5), st.stages[1]))
    sends2 = sorted(e.start for e in simulate_schedule(build_schedule("gpipe", n, m), st2).events
                    if e.kind == "SEND_F")
    assert [b - a for a, b in zip(sends2, sends2[1:])] == pytest.approx([1.5] * (m - 1))


def test_deeper_warmup_hides_a_slow_link():
    n, m = 2, 12
    st = StageCosts((StageCost(1.0, 1.0, 1.5, 0.0, 0, 0, 0, 1, 0, 0),
                     StageCost(1.0, 1.0, 0.0, 1.5, 0, 0, 0, 1, 0, 0)))
    plain = simulate_schedule(build_schedule("1f1b", n, m), st)
    deep = simulate_schedule(build_schedule("h1f1b", n, m, [5, 1]), st)
    assert deep.iteration_s < plain.iteration_s
    assert deep.peak_in_flight[0] == 5 and plain.peak_in_flight[0] == 2


def test_bad_warmups_deadlock_and_say_where():
    sched = build_schedule("h1f1b", 3, 4, [1, 2, 1], validate=False)
    r = simulate_schedule(sched, costs(3))
    assert not r.feasible
    assert r.reason.startswith("deadlock") and "stage 0 waits at" in r.reason
    assert r.iteration_s == float("inf")


def test_peak_memory_follows_in_flight_microbatches():
    n, m = 3, 8
    st = costs(n, static=10.0, act=2.0)
    one = simulate_schedule(build_schedule("1f1b", n, m), st)
    assert one.peak_in_flight == (3, 2, 1)
    assert one.peak_memory_bytes == pytest.approx((16.0, 14.0, 12.0))
    gp = simulate_schedule(build_schedule("gpipe", n, m), st)
    assert gp.peak_in_flight == (m,) * n


def test_memory_over_capacity_makes_the_result_infeasible_with_the_reason():
    st = costs(2, static=10e9, act=1e9, cap=11.5e9)
    r = simulate_schedule(build_schedule("1f1b", 2, 4), st)
    assert not r.feasible
    assert "stage 0 needs 12.00 GB per GPU but 11.50 GB are usable" in r.reason
    assert "stage 1" not in r.reason


def test_cost_count_must_match_stages():
    with pytest.raises(ValueError, match="one per stage"):
        simulate_schedule(build_schedule("1f1b", 3, 3), costs(2))


def _model(blocks=4):
    layers = [LayerSpec(0, "embedding", "emb", 100, 1e9, 2e9, 1e5, 1e5)]
    layers += [LayerSpec(i + 1, "block", "blk", 1000, 1e11, 2e11, 1e5, 1e6, 1e5)
               for i in range(blocks)]
    layers.append(LayerSpec(blocks + 1, "head", "head", 10, 1e10, 2e10, 0, 1e6, 1e5))
    return ModelSpec("m", "gpt2", 64, blocks, 100, 64, "fp32", True, tuple(layers))


def test_simulate_plan_replays_a_hand_written_plan():
    link = LinkSpec(100, 10)
    cl = Cluster("c", (GpuGroup("a", GpuType("A", 10, 16), 1, 2, link, link),
                       GpuGroup("b", GpuType("B", 5, 16), 1, 1, link, link)),
                 (GroupLink("a", "b", LinkSpec(10, 100)),))
    m = _model()
    stages = (Stage.even(0, (0, 4), "a", "A", (0, 1), 2, micro_batch_size=2),
              Stage.even(1, (4, 6), "b", "B", (2,), 1, micro_batch_size=2))
    plan = Plan("m", 6, 64, 8, 2, 4, "1f1b", stages).validate()
    r = simulate_plan(plan, m, cl)
    assert r.feasible
    assert len(r.stage_busy_s) == 2 and r.iteration_s > max(r.stage_busy_s)
    # the 2-wide stage all-reduces its gradients; the 1-wide one has nothing to all-reduce
    ar = {e.stage: e for e in r.events if e.kind == "ALLREDUCE"}
    assert ar[0].end > ar[0].start and ar[1].end == ar[1].start
    with pytest.raises(ValueError, match="layers"):
        simulate_plan(plan, _model(blocks=5), cl)


@pytest.mark.parametrize("kind,n,m,warm", [("1f1b", 4, 7, None), ("gpipe", 3, 5, None),
                                           ("h1f1b", 4, 9, [8, 5, 2, 1]), ("h1f1b", 2, 3, [9, 1])])
def test_fast_encoding_matches_build_schedule(kind, n, m, warm):
    from hapt_hf.planner.simulate import _encode, encode_schedule
    sched = build_schedule(kind, n, m, warm)
    slow = [tuple(a for a in lst if a[0] != 4) for lst in _encode(sched)]  # 4: receives
    lists, placement = encode_schedule(kind, n, m, sched.warmups)
    assert list(lists) == slow and placement == sched.placement
