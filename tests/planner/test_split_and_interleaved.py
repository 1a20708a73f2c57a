"""The zero-bubble (split backward) and interleaved (virtual stages) schedule kinds: their
lists against torch's, validity and NCCL safety for any sizes and warm-ups, the replay's
closed forms and memory, the plan format for several stages per rank, and the timeline."""
from __future__ import annotations

import re

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from benchmarks.stream_order import in_order_hazard
from hapt_hf.core.schedules import (RUNTIME_KINDS, SCHEDULES, ActionKind, interleaved_bounds,
                                    fitting_deferrals, interleaved_rounds, peak_held,
                                    runtime_refusal,
                                    zero_bubble_deferrals)
from hapt_hf.errors import PlanError, ScheduleError
from hapt_hf.planner.cluster import Cluster, GpuGroup, GpuType, GroupLink, LinkSpec
from hapt_hf.planner.cost_model import StageCost, StageCosts
from hapt_hf.planner.model_spec import LayerSpec, ModelSpec
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.schedule import Action, Schedule, build_schedule, validate_schedule
from hapt_hf.planner.search.options import PlannerOptions
from hapt_hf.planner.simulate import (backward_split, encode_schedule, replay, simulate_plan,
                                      simulate_schedule)
from hapt_hf.planner.timeline import (KIND_COLOURS, draw_timeline, plan_labels, rows_by_rank,
                                      stage_phases, timeline_boxes)


def _compute(sched: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in sched.actions[rank] if a.is_compute)


def _costs(n: int, f: float = 1.0, b: float = 2.0, send: float = 0.0, act: float = 0.0,
           cap: float = 0.0, static: float = 0.0) -> StageCosts:
    return StageCosts(tuple(StageCost(f, b, send if i < n - 1 else 0.0, send if i else 0.0, 0.0,
                                      0.0, static, act, 0.0, cap) for i in range(n)))


# -- the lists -------------------------------------------------------------------------------

def test_the_lists_are_torchs():
    """torch 2.13's ScheduleInterleaved1F1B (2 ranks, 2 chunks, 4 micro-batches) and
    ScheduleInterleavedZeroBubble on one chunk per rank (ZB-H1; 3 ranks, 4 micro-batches),
    compute actions as its _calculate_single_rank_operations lists them."""
    il = build_schedule("interleaved", 4, 4, num_ranks=2)
    assert _compute(il, 0) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert _compute(il, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    assert il.placement == (0, 1, 0, 1) and il.virtual_stages == 2
    assert il.stages_of(1) == (1, 3)
    zb = build_schedule("zero_bubble", 3, 4)
    assert [_compute(zb, r) for r in range(3)] == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"]


def test_a_split_backward_sends_after_i_and_receives_before_it():
    zb = build_schedule("zero_bubble", 2, 3)
    lst = [str(a) for a in zb.actions[1]]
    assert lst.index("1SEND_B0") == lst.index("1I0") + 1
    lst0 = [str(a) for a in zb.actions[0]]
    assert lst0.index("0RECV_B0") < lst0.index("0I0") and "0SEND_B0" not in lst0
    for r in (0, 1):  # W sends nothing: what follows it is a receive or a compute
        acts = zb.actions[r]
        assert not any(a.kind is ActionKind.W and acts[i + 1].kind.value.startswith("SEND")
                       for i, a in enumerate(acts[:-1]))


def _h1f1b(n: int, m: int, extra: list[int]) -> list[int]:
    warm, acc = [min(n - i, m) for i in range(n)], 0
    for i in reversed(range(n)):
        acc += extra[i]
        warm[i] += acc
    return warm


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 7), m=st.integers(1, 12),
       extra=st.lists(st.integers(0, 4), min_size=7, max_size=7), early=st.booleans(),
       streams=st.sampled_from(["pair", "group"]),
       defer=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 13)),
                                           min_size=7, max_size=7)))
def test_every_zero_bubble_list_is_valid_and_finishes_on_nccl(n, m, extra, early, streams,
                                                              defer):
    """H-1F1B-shaped warm-ups (never shallower upstream), the rule's deferrals or any others:
    each stage runs F, I and W of every micro-batch once, W after I after F, nothing
    deadlocks, and the lists finish under NCCL's rules on the runtime's groups; each stage
    holds at most its warm-up plus its deferral."""
    warm = _h1f1b(n, m, extra)
    defer = None if defer is None else defer[:n]
    sched = build_schedule("zero_bubble", n, m, warm, early_receives=early,
                           deferrals=defer)  # validates
    for s in range(n):
        kinds = [(a.kind, a.microbatch) for a in sched.stage_actions(s) if a.is_compute]
        for k in range(m):
            at = {x: kinds.index((x, k)) for x in (ActionKind.F, ActionKind.I, ActionKind.W)}
            assert at[ActionKind.F] < at[ActionKind.I] < at[ActionKind.W]
        assert len(kinds) == 3 * m
    assert in_order_hazard(sched, groups="boundary", streams=streams) is None
    d = zero_bubble_deferrals(sched.warmups, m, defer)
    assert peak_held("zero_bubble", n, m, sched.warmups, deferrals=defer) == \
        tuple(min(w + x, m) for w, x in zip(sched.warmups, d))


@st.composite
def _interleaved_case(draw):
    """p ranks, v chunks, M micro-batches and warm-ups within interleaved_bounds, never
    growing along the pipeline, the first at most twice the smallest round above the last."""
    p, v, m = draw(st.integers(2, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    lo, hi = interleaved_bounds(p, v, m)
    last = draw(st.integers(lo, hi))
    top = hi if v == 1 else min(hi, last + 2 * min(len(r) for r in interleaved_rounds(p, m)))
    mids = sorted((draw(st.integers(last, top)) for _ in range(p - 2)), reverse=True)
    ranks = [draw(st.integers(mids[0] if mids else last, top))] + mids + [last] \
        if p > 1 else [last]
    return p, v, m, [ranks[s % p] for s in range(p * v)]


@settings(max_examples=150, deadline=None)
@given(case=_interleaved_case(), default=st.booleans(), streams=st.sampled_from(["pair", "group"]),
       early=st.booleans())
def test_every_interleaved_list_is_valid_and_finishes_on_nccl(case, default, streams, early):
    p, v, m, warm = case
    sched = build_schedule("interleaved", p * v, m, None if default else warm, num_ranks=p,
                           early_receives=early)
    assert sched.placement == tuple(s % p for s in range(p * v))
    for s in range(p * v):
        kinds = [(a.kind.value, a.microbatch) for a in sched.stage_actions(s) if a.is_compute]
        assert sorted(kinds) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
    assert in_order_hazard(sched, groups="boundary", streams=streams) is None


def test_warmups_outside_the_interleaved_conditions_are_named():
    with pytest.raises(ScheduleError, match="deadlock"):  # the last rank deeper than the first
        build_schedule("interleaved", 4, 8, [3, 7, 3, 7], num_ranks=2)
    with pytest.raises(ScheduleError, match="give them one value"):
        build_schedule("interleaved", 4, 8, [7, 5, 6, 5], num_ranks=2)
    with pytest.raises(ScheduleError, match="do not divide"):
        build_schedule("interleaved", 5, 8, num_ranks=2)
    with pytest.raises(ScheduleError, match="pass every activation"):
        build_schedule("interleaved", 2, 8, num_ranks=1)
    with pytest.raises(ScheduleError, match="use schedule 'interleaved'"):
        build_schedule("h1f1b", 4, 8, num_ranks=2)
    # below the bound: rounds of 2, so 2 forwards of chunk 0 and 1 of chunk 1 come first
    assert build_schedule("interleaved", 4, 8, [1, 1, 1, 1], num_ranks=2).warmups == (3,) * 4


def test_validation_names_a_broken_split_backward():
    good = build_schedule("zero_bubble", 2, 2)

    def swap(rank: int, a: str, b: str) -> Schedule:
        lst = list(good.actions[rank])
        i, j = lst.index(Action.parse(a)), lst.index(Action.parse(b))
        lst[i], lst[j] = lst[j], lst[i]
        acts = tuple(tuple(lst) if r == rank else x for r, x in enumerate(good.actions))
        return Schedule("zero_bubble", 2, 2, good.warmups, acts)

    with pytest.raises(ScheduleError, match="1W0: runs before its I"):
        validate_schedule(swap(1, "1I0", "1W0"))
    lst = [a for a in good.actions[0] if str(a) != "0W1"]
    with pytest.raises(ScheduleError, match="never runs W of micro-batch 1"):
        validate_schedule(Schedule("zero_bubble", 2, 2, good.warmups, (tuple(lst),
                                                                         good.actions[1])))
    lst = list(good.actions[0]) + [Action.parse("0B1")]
    with pytest.raises(ScheduleError, match="both whole"):
        validate_schedule(Schedule("zero_bubble", 2, 2, good.warmups, (tuple(lst),
                                                                         good.actions[1])))


# -- the replay ------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (5, 5)])
def test_zero_bubble_on_alike_stages_matches_zb_h1s_closed_form(p, m):
    """No transfers, F = 1, B = 2 split as I = W = 1: ZB-H1's bubble is (p - 1)(F + I - W)
    (Qi et al. 2024), against 1F1B's (p - 1)(F + B); with no weight gradient (all of B in
    I) the split lists take exactly 1F1B's time."""
    costs = _costs(p)
    assert backward_split(costs.stages[0]) == (1.0, 1.0)
    zb = simulate_schedule(build_schedule("zero_bubble", p, m), costs)
    one = simulate_schedule(build_schedule("1f1b", p, m), costs)
    assert one.iteration_s == pytest.approx(m * 3 + (p - 1) * 3)
    assert zb.iteration_s == pytest.approx(m * 3 + (p - 1) * 1)
    sched = build_schedule("zero_bubble", p, m)
    whole = replay(*encode_schedule("zero_bubble", p, m, sched.warmups), costs,
                   weight_share=0.0)
    assert whole.iteration_s == pytest.approx(one.iteration_s)
    # the replay's held micro-batches are the lists' (a deferred W keeps its inputs)
    assert zb.peak_in_flight == peak_held("zero_bubble", p, m, sched.warmups)
    assert zb.peak_in_flight == (min(p, m),) * p


def test_the_split_gives_a_recomputed_forward_to_i():
    c = StageCost(1.0, 3.0, 0, 0, 0, 0, 0, 0, 0, 0, recompute=True)
    assert backward_split(c) == (2.0, 1.0)
    assert backward_split(c, 0.25) == (2.5, 0.5)
    with pytest.raises(ValueError, match="weight_share"):
        backward_split(c, 1.5)
    # a share per stage: all of the last stage's backward in I makes its W free
    sched = build_schedule("zero_bubble", 2, 3)
    r = replay(*encode_schedule("zero_bubble", 2, 3, sched.warmups), _costs(2),
               weight_share=[0.5, 0.0])
    assert {e.end - e.start for e in r.events if e.kind == "W" and e.stage == 1} == {0.0}
    with pytest.raises(ValueError, match="one per stage"):
        replay(*encode_schedule("zero_bubble", 2, 3, sched.warmups), _costs(2),
               weight_share=[0.5])


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 3, 8), (4, 2, 8), (4, 3, 16), (3, 2, 9)])
def test_interleaved_on_alike_chunks_shrinks_the_fill_v_times(p, v, m):
    """Each chunk 1/v of a rank's work, no transfers: M (F + B) + (p - 1)(F + B) / v where
    every round holds a multiple of p micro-batches."""
    r = simulate_schedule(build_schedule("interleaved", p * v, m, num_ranks=p),
                          _costs(p * v, 1.0 / v, 2.0 / v))
    assert r.iteration_s == pytest.approx(m * 3 + (p - 1) * 3 / v)


def test_a_rank_holds_the_activations_of_all_its_stages():
    """Memory per rank: every stage's weights plus their activations held together; a cap
    below that makes the plan infeasible, naming the rank and its stages."""
    sched = build_schedule("interleaved", 4, 4, num_ranks=2)
    r = simulate_schedule(sched, _costs(4, act=1.0, static=10.0))
    held = peak_held("interleaved", 4, 4, sched.warmups, num_ranks=2)
    assert r.peak_in_flight == held
    # rank 0's stages 0 and 2 together: both weights, their activations at the joint peak
    assert r.peak_memory_bytes[0] == r.peak_memory_bytes[2]
    assert 20.0 + max(held[0], held[2]) <= r.peak_memory_bytes[0] <= 20.0 + held[0] + held[2]
    tight = simulate_schedule(sched, _costs(4, act=1.0, static=10.0, cap=21.0))
    assert not tight.feasible and "pipeline rank 0 (stages [0, 2])" in tight.reason


# -- the plan ------------------------------------------------------------------------------

def _model(blocks: int = 6) -> ModelSpec:
    layers = [LayerSpec(0, "embedding", "emb", 100, 1e9, 2e9, 1e5, 1e5)]
    layers += [LayerSpec(i + 1, "block", "blk", 1000, 1e11, 2e11, 1e5, 1e6, 1e5)
               for i in range(blocks)]
    layers.append(LayerSpec(blocks + 1, "head", "head", 10, 1e10, 2e10, 0, 1e6, 1e5))
    return ModelSpec("m", "gpt2", 64, blocks, 100, 64, "fp32", True, tuple(layers))


def _cluster() -> Cluster:
    link = LinkSpec(100, 10)
    return Cluster("c", (GpuGroup("a", GpuType("A", 10, 16), 1, 2, link, link),
                         GpuGroup("b", GpuType("B", 5, 16), 1, 1, link, link)),
                   (GroupLink("a", "b", LinkSpec(10, 100)),))


def _one_per_rank(schedule: str = "h1f1b") -> Plan:
    """Ranks 0-1 a 2-wide stage of group a, rank 2 a stage of group b; 8 layers."""
    stages = (Stage.even(0, (0, 5), "a", "A", (0, 1), 2, micro_batch_size=2),
              Stage.even(1, (5, 8), "b", "B", (2,), 1, micro_batch_size=2))
    return Plan("m", 8, 64, 16, 2, 8, schedule, stages).validate()


def test_interleave_keeps_each_ranks_layers_and_replicas():
    plan = _one_per_rank().interleave(2)
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2
    assert plan.num_pipeline_ranks == 2 and plan.num_stages == 4 and plan.world_size == 3
    assert [s.layers for s in plan.stages] == [(0, 3), (3, 5), (5, 7), (7, 8)]  # 3+2, 2+1
    assert [s.ranks for s in plan.stages] == [(0, 1), (2,), (0, 1), (2,)]
    assert plan.warmups() == [5, 3, 5, 3]  # torch's depths (rounds of 2), on each of a rank's stages
    assert [s.index for s in plan.stages_of_rank(2)] == [1, 3]
    with pytest.raises(PlanError, match="stages_of_rank"):
        plan.stage_of_rank(0)
    assert _one_per_rank().stage_of_rank(2).index == 1
    assert Plan.from_dict(plan.to_dict()).validate() == plan
    with pytest.raises(PlanError, match="fewer than 4 layers"):
        _one_per_rank().interleave(4)
    with pytest.raises(PlanError, match="already holds 2"):
        plan.interleave(2)


def test_interleave_cuts_each_ranks_chunks_as_given():
    # rank 0 (5 layers) as 1 + 4, rank 1 (3 layers) as 2 + 1
    plan = _one_per_rank().interleave(2, chunk_layers=[[1, 4], [2, 1]]).validate()
    assert [s.layers for s in plan.stages] == [(0, 1), (1, 3), (3, 7), (7, 8)]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2,), (0, 1), (2,)]
    assert Plan.from_dict(plan.to_dict()).validate() == plan
    # the even cut, given, is the default
    assert _one_per_rank().interleave(2, chunk_layers=[[3, 2], [2, 1]]) == \
        _one_per_rank().interleave(2)
    for bad, which in (([[1, 4]], "[1]"), ([[0, 5], [2, 1]], "[0]"), ([[1, 4], [1, 1]], "[1]"),
                       ([[1, 2, 2], [2, 1]], "[0]")):
        with pytest.raises(PlanError, match="sum to its stage's layers; they do not for "
                                            f"stage\\(s\\) {re.escape(which)}"):
            _one_per_rank().interleave(2, chunk_layers=bad)


def test_validate_takes_several_stages_per_rank_only_where_interleaving_places_them():
    plan = _one_per_rank().interleave(2)
    st_ = list(plan.stages)
    with pytest.raises(PlanError, match="each rank holds exactly one stage"):
        replace(plan, schedule="h1f1b").validate()
    swapped = (st_[0], replace(st_[2], index=1, layers=st_[1].layers),
               replace(st_[1], index=2, layers=st_[2].layers), st_[3])  # 0 and 1 on one rank
    with pytest.raises(PlanError, match="stage s with stage s mod 2"):
        replace(plan, stages=swapped).validate()
    with pytest.raises(PlanError, match="warm-ups 5 and 4"):
        replace(plan, stages=(st_[0], st_[1], replace(st_[2], warmup=4), st_[3])).validate()
    one = (replace(st_[2].replicas[0], samples=2),)
    with pytest.raises(PlanError, match="not their replicas"):
        replace(plan, stages=(st_[0], st_[1], replace(st_[2], replicas=one), st_[3])).validate()
    # an old plan: unchanged
    old = _one_per_rank()
    assert old.virtual_stages == 1 and old.num_pipeline_ranks == 2 and old.world_size == 3


def test_simulate_plan_replays_both_kinds_on_an_unlike_pipeline():
    model, cluster = _model(), _cluster()
    base = simulate_plan(_one_per_rank(), model, cluster)
    zb = simulate_plan(_one_per_rank().with_schedule("zero_bubble", [2, 1]), model, cluster)
    il = simulate_plan(_one_per_rank().interleave(2), model, cluster)
    for r in (base, zb, il):
        assert r.feasible
    assert {e.kind for e in zb.events} >= {"F", "I", "W"} and "B" not in {e.kind
                                                                          for e in zb.events}
    assert {e.rank for e in il.events if e.stage in (0, 2)} == {0}
    busy = sum(base.stage_busy_s)
    assert sum(zb.stage_busy_s) == pytest.approx(busy)  # I + W is the backward
    assert sum(il.stage_busy_s) == pytest.approx(busy)


# -- refusals and the planner's default --------------------------------------------------

def test_the_runtime_refuses_a_kind_it_does_not_run_in_one_sentence():
    assert {"gpipe", "1f1b", "h1f1b"} <= set(RUNTIME_KINDS) <= set(SCHEDULES)
    assert all(runtime_refusal(kind) is None for kind in RUNTIME_KINDS)
    why = runtime_refusal("looped_bfs")  # a kind the registry might hold before the runtime
    assert why is not None and "'looped_bfs'" in why and why.count(". ") == 0
    assert all(kind in why for kind in RUNTIME_KINDS)
    assert PlannerOptions().schedule in RUNTIME_KINDS  # the search's default runs


# -- the timeline ----------------------------------------------------------------------------

def test_the_timeline_draws_i_and_w_in_their_own_colours(tmp_path):
    r = simulate_schedule(build_schedule("zero_bubble", 3, 5), _costs(3, send=0.1))
    colours = {KIND_COLOURS[k] for k in ("B", "I", "W", "SEND_B")}
    assert len(colours) == 4
    assert rows_by_rank(r) == {}  # one stage per rank: a row per stage
    phases = stage_phases(r)
    assert [p.warmup for p in phases] == [3, 2, 1]  # forwards before the first I
    out = draw_timeline(r, tmp_path / "zb.png")
    assert out.stat().st_size > 10_000


def test_the_timeline_of_an_interleaved_plan_has_a_row_per_rank(tmp_path):
    plan = _one_per_rank().interleave(2)
    r = simulate_plan(plan, _model(), _cluster())
    assert rows_by_rank(r) == {0: (0, 2), 1: (1, 3)}
    boxes = timeline_boxes(r)
    assert {b.row for b in boxes} == {0, 1}
    shades = {b.stage: b.shade for b in boxes if b.kind == "F"}
    assert shades[0] == shades[1] == 0 < shades[2] == shades[3]
    assert all(b.shade == 0 for b in boxes if b.is_comm)
    assert [p.warmup for p in stage_phases(r)] == plan.warmups()[:2]
    assert plan_labels(plan) == ["rank 0 (stages 0, 2): a x2", "rank 1 (stages 1, 3): b x1"]
    out = draw_timeline(r, tmp_path / "il.png", plan=plan)
    assert out.stat().st_size > 10_000


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 3), min_size=2, max_size=4), m=st.integers(1, 6),
       extra=st.lists(st.integers(0, 2), min_size=4, max_size=4), data=st.data())
def test_zero_bubble_plans_with_uneven_replicas_finish_on_nccl(widths, m, extra, data):
    """Every global rank of every replica runs its stage's split lists, one transfer per piece
    to the replicas of the neighbouring stage (the runtime's pairing): nothing hangs."""
    from benchmarks.stream_order import plan_in_order_hazard
    from hapt_hf.planner.plan import Replica
    n, mbs = len(widths), 6
    warm = _h1f1b(n, m, extra[:n])
    stages, rank = [], 0
    for i, w in enumerate(widths):
        cuts = sorted(data.draw(st.lists(st.integers(1, mbs - 1), min_size=w - 1,
                                         max_size=w - 1, unique=True)))
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, mbs])]
        reps = tuple(Replica("g", "G", s, (rank + j,)) for j, s in enumerate(shares))
        rank += w
        stages.append(Stage(i, (i, i + 1), reps, warm[i]))
    plan = Plan("m", n, 64, mbs * m, mbs, m, "zero_bubble", tuple(stages)).validate()
    assert plan_in_order_hazard(plan) is None


@pytest.mark.parametrize("kind,n,p", [("interleaved", 6, 3), ("zero_bubble", 3, 3)])
def test_a_rank_computes_one_action_at_a_time(kind, n, p):
    """One clock per pipeline rank: the compute of a rank's stages never overlaps."""
    costs = StageCosts(tuple(StageCost(1.0 + s % 2, 2.0, 0.3 if s < n - 1 else 0.0,
                                       0.3 if s else 0.0, 0, 0, 0, 0, 0, 0) for s in range(n)))
    r = simulate_schedule(build_schedule(kind, n, 7, num_ranks=p), costs)
    for rank in range(p):
        spans = sorted((e.start, e.end) for e in r.events
                       if e.rank == rank and e.kind in ("F", "B", "I", "W"))
        assert len(spans) == (3 if kind == "zero_bubble" else 2) * 7 * (n // p)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_a_plan_may_set_each_stages_deferral_within_its_memory():
    """Deferrals the plan gives replace the rule stage by stage; fitting_deferrals keeps each
    stage's held micro-batches within what its memory holds; the replay holds what the lists
    hold; other schedules refuse a deferral rather than ignore it."""
    warm, m = (4, 3, 2, 1), 8
    assert zero_bubble_deferrals(warm, m) == (0, 1, 2, 3)
    assert zero_bubble_deferrals(warm, m, (None, 0, 5, None)) == (0, 0, 5, 3)
    fit = fitting_deferrals(warm, m, (8, 8, 3, 2))
    assert fit == (0, 1, 1, 1)
    sched = build_schedule("zero_bubble", 4, m, warm, deferrals=fit)
    held = peak_held("zero_bubble", 4, m, warm, deferrals=fit)
    assert held == (4, 4, 3, 2)
    assert simulate_schedule(sched, _costs(4)).peak_in_flight == held
    with pytest.raises(ScheduleError, match="apply to schedule 'zero_bubble' only"):
        build_schedule("h1f1b", 4, m, warm, deferrals=fit)
    plan = _one_per_rank().with_schedule("zero_bubble", [2, 1])
    plan = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], deferral=0)))
    again = Plan.from_dict(plan.validate().to_dict())
    assert again == plan and again.deferrals() == (None, 0)
    assert "deferral" not in plan.to_dict()["stages"][0]
    assert plan.with_schedule("h1f1b").deferrals() is None
    assert plan.interleave(2).validate().deferrals() is None
    with pytest.raises(PlanError, match="only schedule 'zero_bubble' runs"):
        replace(plan, schedule="h1f1b").validate()
    with pytest.raises(PlanError, match="must be >= 0"):
        replace(plan, stages=(plan.stages[0], replace(plan.stages[1], deferral=-1))).validate()
    r = simulate_plan(plan, _model(), _cluster())
    assert r.feasible and r.peak_in_flight == (2, 1)  # the last stage defers none


def test_early_receives_of_interleaved_lists_move_only_the_receives_and_only_earlier():
    """As soon as the sender may send: each receive right after the last of its rank's own
    actions the matching send depends on, never later than one compute ahead; everything
    else in place."""
    for p, v, m in [(2, 2, 4), (3, 2, 6), (4, 3, 8), (2, 3, 5)]:
        late = build_schedule("interleaved", p * v, m, num_ranks=p)
        early = build_schedule("interleaved", p * v, m, num_ranks=p, early_receives=True)
        moved = 0
        for r in range(p):
            def computes_before(lst):
                out, seen = {}, 0
                for a in lst:
                    if a.kind.value.startswith("RECV"):
                        out[str(a)] = seen
                    elif a.is_compute:
                        seen += 1
                return out
            keep = [a for a in late.actions[r] if not a.kind.value.startswith("RECV")]
            assert keep == [a for a in early.actions[r] if not a.kind.value.startswith("RECV")]
            before, after = computes_before(late.actions[r]), computes_before(early.actions[r])
            assert before.keys() == after.keys()
            assert all(after[k] <= before[k] for k in before)
            moved += sum(after[k] < before[k] for k in before)
        assert moved > 0


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 3), min_size=2, max_size=3), v=st.integers(2, 3),
       m=st.integers(1, 6), data=st.data())
def test_interleaved_plans_with_uneven_replicas_finish_on_nccl(widths, v, m, data):
    """Every global rank runs its pipeline rank's list over all its stages, trading each
    virtual boundary's pieces with the replicas of the neighbouring stage (the last pipeline
    rank's back to the first's included): nothing hangs."""
    from benchmarks.stream_order import plan_in_order_hazard
    from hapt_hf.planner.plan import Replica
    p, mbs = len(widths), 6
    reps, rank = [], 0
    for w in widths:
        cuts = sorted(data.draw(st.lists(st.integers(1, mbs - 1), min_size=w - 1,
                                         max_size=w - 1, unique=True)))
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, mbs])]
        reps.append(tuple(Replica("g", "G", s, (rank + j,)) for j, s in enumerate(shares)))
        rank += w
    flat = Plan("m", p * v, 64, mbs * m, mbs, m, "h1f1b",
                tuple(Stage(i, (i * v, (i + 1) * v), reps[i], 1) for i in range(p)))
    plan = flat.interleave(v).validate()
    assert plan.num_pipeline_ranks == p and plan.virtual_stages == v
    assert plan_in_order_hazard(plan) is None


def test_the_first_stage_runs_its_whole_backward_as_w():
    """It has no input gradient to send (the runtime's first stage runs its whole backward in
    W): its I costs nothing, the other stages' split by the share."""
    r = simulate_schedule(build_schedule("zero_bubble", 3, 4), _costs(3))
    dur = {(e.stage, e.kind): e.end - e.start for e in r.events if e.kind in ("I", "W")}
    assert dur[(0, "I")] == 0.0 and dur[(0, "W")] == 2.0
    assert dur[(1, "I")] == dur[(1, "W")] == 1.0
