"""Execution mapping without processes: slices, pieces between widths, per-rank work."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hapt_hf.pipeline.placement import (max_in_flight, pieces_between, rank_work,
                                       replica_slice)
from hapt_hf.pipeline.torch_pipelining import torch_supports
from hapt_hf.planner.plan import Plan, PlanError, Replica, Stage
from hapt_hf.planner.schedule import ActionKind, build_schedule


def plan_of(widths: list[int], mbs: int, m: int = 4, schedule: str = "1f1b") -> Plan:
    stages, rank = [], 0
    for i, w in enumerate(widths):
        stages.append(Stage.even(i, (i, i + 1), "g", "cpu", tuple(range(rank, rank + w)),
                                 warmup=len(widths) - i, micro_batch_size=mbs))
        rank += w
    return Plan("t", len(widths), 8, mbs * m, mbs, m, schedule, tuple(stages)).validate()


def test_replica_slices_tile_the_micro_batch():
    even = Stage.even(0, (0, 1), "g", "cpu", (0, 1, 2, 3), 1, micro_batch_size=8)
    assert [replica_slice(8, even, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(PlanError, match="multiple of the stage's width"):
        replica_slice(8, Stage.even(0, (0, 1), "g", "cpu", (0, 1, 2), 1, micro_batch_size=8), 0)
    uneven = Stage(0, (0, 1), (Replica("a", "A", 5, (0,)), Replica("b", "B", 2, (1,)),
                               Replica("b", "B", 1, (2,))), 1)
    assert [replica_slice(8, uneven, r) for r in range(3)] == [(0, 5), (5, 7), (7, 8)]


def test_two_wide_feeding_one_wide_and_back():
    plan = plan_of([2, 1, 2], mbs=2)
    w0, w1, w2 = (rank_work(plan, r) for r in (0, 2, 3))
    # rank 0 sends its single sample to rank 2, which gathers both samples in order
    assert [(p.peer, p.start, p.stop) for p in w0.downstream] == [(2, 0, 1)]
    assert [(p.peer, p.start, p.stop) for p in w1.upstream] == [(0, 0, 1), (1, 1, 2)]
    # and scatters them to the two ranks of the next stage
    assert [(p.peer, p.start, p.stop) for p in w1.downstream] == [(3, 0, 1), (4, 1, 2)]
    assert w2.samples == (0, 1) and w2.is_last and not w2.downstream
    assert w0.tied_ranks == (0, 1, 3, 4)


def _shares(mbs: int):
    """A composition of ``mbs`` into 1..8 positive shares (a stage's replicas' samples)."""
    if mbs == 1:
        return st.just([1])
    cuts = st.lists(st.integers(1, mbs - 1), max_size=min(7, mbs - 1), unique=True)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *sorted(c)], [*sorted(c), mbs])])


def _stage(index: int, first_rank: int, shares: list[int]) -> Stage:
    reps = tuple(Replica("g", "cpu", n, (first_rank + i,)) for i, n in enumerate(shares))
    return Stage(index, (index, index + 1), reps, 1)


@given(st.data())
def test_pieces_cover_each_slice_exactly_once(data):
    """Every sample of a micro-batch crosses the cut exactly once, to the rank that owns it,
    for any shares on either side (even ones like 3 | 8 widths, or 5:2:1 against 3:1)."""
    mbs = data.draw(st.integers(1, 24))
    up = _stage(0, 0, data.draw(_shares(mbs)))
    down = _stage(1, up.width, data.draw(_shares(mbs)))
    for st_ in (up, down):
        st_.validate(mbs)
    sent = []
    for r in range(up.width):
        mine = replica_slice(mbs, up, r)
        for p in pieces_between(mbs, mine, down):
            lo, hi = replica_slice(mbs, down, down.ranks.index(p.peer))
            # the piece lies inside the receiver's slice
            assert lo <= mine[0] + p.start and mine[0] + p.stop <= hi
            sent.extend(range(mine[0] + p.start, mine[0] + p.stop))
    assert sorted(sent) == list(range(mbs))
    # the receiving side computes the same pieces from its end
    got = []
    for r in range(down.width):
        mine = replica_slice(mbs, down, r)
        got.extend(mine[0] + i for p in pieces_between(mbs, mine, up) for i in range(p.start, p.stop))
    assert sorted(got) == list(range(mbs))


def test_every_sample_of_every_micro_batch_is_computed_once_per_stage():
    """Over a whole plan with uneven, unlike layouts: each stage's replicas own every sample of
    every micro-batch exactly once (their rows of the global batch tile it)."""
    mixed = Stage(1, (1, 2), (Replica("a", "A", 5, (2,)), Replica("b", "B", 2, (3,)),
                              Replica("b", "B", 1, (4,))), 1)
    stages = (_stage(0, 0, [6, 2]), mixed, _stage(2, 5, [8]))
    plan = Plan("t", 3, 8, 24, 8, 3, "gpipe", stages).validate()
    for s in plan.stages:
        rows = []
        for rank in s.ranks:
            w = rank_work(plan, rank)
            for k in range(plan.num_microbatches):
                rows.extend(range(k * 8 + w.samples[0], k * 8 + w.samples[1]))
        assert sorted(rows) == list(range(plan.global_batch_size))


@pytest.mark.parametrize("kind,warm", [("gpipe", None), ("1f1b", None), ("h1f1b", [4, 3, 1])])
def test_in_flight_is_the_warmup(kind, warm):
    sched = build_schedule(kind, 3, 4, warm)
    assert [max_in_flight(sched.actions[s]) for s in range(3)] == list(sched.warmups)


def test_rank_work_uses_its_stage_list():
    plan = plan_of([1, 2, 1], mbs=2, schedule="gpipe")
    w = rank_work(plan, 2)
    assert w.stage.index == 1 and w.replica == 1 and w.samples == (1, 2)
    assert {a.stage for a in w.actions} == {1}
    assert sum(a.kind is ActionKind.F for a in w.actions) == plan.num_microbatches


def test_torch_capability_check_names_what_it_lacks():
    assert torch_supports(plan_of([1, 1], mbs=2)) is None
    assert "different widths" in torch_supports(plan_of([2, 1], mbs=2))
    deeper = plan_of([1, 1, 1], mbs=2).with_schedule("h1f1b", [4, 3, 1])
    assert "per-stage depths" in torch_supports(deeper)
    one = plan_of([1, 1], mbs=2)
    tp = replace(one, stages=(replace(one.stages[0], replicas=(replace(
        one.stages[0].replicas[0], ranks=(0, 2)),)),) + one.stages[1:]).validate()
    assert tp.stages[0].width == 1 and "tensor-parallel" in torch_supports(tp)
