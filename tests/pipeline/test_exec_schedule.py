"""Execution mapping without processes: slices, pieces between widths, per-rank work."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hapt_hf.pipeline.placement import (max_in_flight, pieces_between, rank_work,
                                       replica_slice)
from hapt_hf.pipeline.torch_pipelining import torch_supports
from hapt_hf.planner.plan import Plan, StagePlan
from hapt_hf.planner.schedule import ActionKind, build_schedule


def plan_of(widths: list[int], mbs: int, m: int = 4, schedule: str = "1f1b") -> Plan:
    stages, rank = [], 0
    for i, w in enumerate(widths):
        stages.append(StagePlan(i, (i, i + 1), "g", "cpu", tuple(range(rank, rank + w)),
                                warmup=len(widths) - i))
        rank += w
    return Plan("t", len(widths), 8, mbs * m, mbs, m, schedule, tuple(stages)).validate()


def test_replica_slices_tile_the_micro_batch():
    assert [replica_slice(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="multiple of the stage width 3"):
        replica_slice(8, 3, 0)


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


@given(st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_pieces_cover_each_slice_exactly_once(d1, d2):
    """Every sample of a micro-batch crosses the cut exactly once, to the rank that owns it."""
    mbs = 24
    up = StagePlan(0, (0, 1), "g", "cpu", tuple(range(d1)), 1)
    down = StagePlan(1, (1, 2), "g", "cpu", tuple(range(d1, d1 + d2)), 1)
    sent = []
    for r in range(d1):
        mine = replica_slice(mbs, d1, r)
        for p in pieces_between(mbs, mine, down):
            lo, hi = replica_slice(mbs, d2, down.ranks.index(p.peer))
            # the piece lies inside the receiver's slice
            assert lo <= mine[0] + p.start and mine[0] + p.stop <= hi
            sent.extend(range(mine[0] + p.start, mine[0] + p.stop))
    assert sorted(sent) == list(range(mbs))
    # the receiving side computes the same pieces from its end
    got = []
    for r in range(d2):
        mine = replica_slice(mbs, d2, r)
        got.extend(mine[0] + i for p in pieces_between(mbs, mine, up) for i in range(p.start, p.stop))
    assert sorted(got) == list(range(mbs))


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
