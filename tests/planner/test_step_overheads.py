"""The cost model prices the profile's step overheads: a fixed cost per action and per transfer,
and the split backward's measured parts; the planner's choice of kind follows them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.profile import LayerTiming, LinkMeasurement, Profile, ProfileKey, StepOverheads
from hapt_hf.planner.search.kinds import best_kind, replay_kind
from hapt_hf.planner.search.plans import layout_of_plan
from hapt_hf.planner.simulate import backward_split, simulate_plan

from .test_cost_model import toy_model, two_groups

ACTION, TRANSFER = 0.004, 0.0003


def _profile(**overheads) -> Profile:
    m = toy_model()
    timings = {ProfileKey(dev, sig, 2, m.seq_len, m.dtype): LayerTiming(0.01, 0.02, 0.001)
               for dev in ("T-a", "T-b") for sig in ("emb", "blk", "head")}
    # the stages' cut is inside group a: the overhead measured between two of its ranks
    return Profile(timings, [LinkMeasurement("a", "a", 8.0, 1000.0,
                                             overhead_us=overheads.pop("transfer_us", 0.0))],
                   overheads=overheads)


def _plan(schedule: str, stages: int = 2, m: int = 4) -> Plan:
    cut = [(0, 3), (3, 6)] if stages == 2 else [(0, 6)]
    return Plan("toy", 6, 64, 2 * m, 2, m, schedule, tuple(
        Stage.even(i, layers, "a", "T-a", (i,),
                   warmup=stages - i, micro_batch_size=2)
        for i, layers in enumerate(cut))).validate()


def _sim(plan: Plan, prof: Profile):
    return simulate_plan(plan, toy_model(), two_groups(), prof, record_events=False)


def test_every_action_and_transfer_pays_its_measured_overhead():
    plain = CostModel(toy_model(), two_groups(), _profile()).plan_costs(_plan("1f1b"))
    over = CostModel(toy_model(), two_groups(), _profile(
        transfer_us=TRANSFER * 1e6, **{"T-a": StepOverheads(ACTION), "T-b": StepOverheads(
            ACTION / 2)})).plan_costs(_plan("1f1b"))
    for p, o in zip(plain.stages, over.stages):
        assert o.forward_s == pytest.approx(p.forward_s + ACTION)
        assert o.backward_s == pytest.approx(p.backward_s + ACTION)
        assert o.split_ratios is None  # not measured: the replay's default share
    # the one cut pays the transfer's fixed cost both ways, its latency unchanged
    assert over.stages[0].send_forward_s == pytest.approx(plain.stages[0].send_forward_s + TRANSFER)
    assert over.stages[1].send_backward_s == pytest.approx(plain.stages[1].send_backward_s
                                                           + TRANSFER)
    assert over.stages[0].send_forward_latency_s == plain.stages[0].send_forward_latency_s


def test_every_action_pays_one_post_per_boundary_of_its_stage():
    # each micro-batch posts a send and a receive at each of a stage's boundaries: one post
    # per boundary in each of its forward's and backward's turns, on the stage's own group
    post = 0.0002  # seconds a transfer takes from a rank's compute
    prof = _profile()
    posted = Profile(prof.timings, [replace(prof.links[0], transfer_cpu_us=post * 1e6)])
    for stages in (1, 2):
        plain = CostModel(toy_model(), two_groups(), prof).plan_costs(_plan("1f1b", stages))
        over = CostModel(toy_model(), two_groups(), posted).plan_costs(_plan("1f1b", stages))
        for p, o in zip(plain.stages, over.stages):
            assert o.forward_s == pytest.approx(p.forward_s + (stages - 1) * post)
            assert o.backward_s == pytest.approx(p.backward_s + (stages - 1) * post)
            assert o.send_forward_s == p.send_forward_s  # the link's time is the link's


def test_a_plan_of_one_stage_moves_by_exactly_two_actions_a_micro_batch():
    m, layer = 4, 0.001
    base = _sim(_plan("1f1b", stages=1, m=m), _profile())
    over = _sim(_plan("1f1b", stages=1, m=m), _profile(**{"T-a": StepOverheads(ACTION)}))
    assert over.iteration_s - base.iteration_s == pytest.approx(2 * m * ACTION)
    # each of the stage's 6 layers beyond its first adds the further layer's cost too
    more = _sim(_plan("1f1b", stages=1, m=m),
                _profile(**{"T-a": StepOverheads(ACTION, layer_s=-layer)}))
    assert more.iteration_s - base.iteration_s == pytest.approx(2 * m * (ACTION - 5 * layer))


def test_a_stage_pays_the_further_layer_cost_per_layer_as_the_profile_timed_them():
    cm = CostModel(toy_model(), two_groups(),
                   _profile(**{"T-a": StepOverheads(0.0, layer_s=0.002)}))
    stages = cm.plan_costs(_plan("1f1b")).stages
    plain = CostModel(toy_model(), two_groups(), _profile()).plan_costs(_plan("1f1b")).stages
    for o, p in zip(stages, plain):  # 3 layers a stage: two further layers
        assert o.forward_s - p.forward_s == pytest.approx(0.004)


def test_the_split_backward_is_priced_from_its_measured_parts():
    prof = _profile(**{"T-a": StepOverheads(0.0, 0.8, 0.7)})
    cost = CostModel(toy_model(), two_groups(), prof).plan_costs(_plan("1f1b")).stages[1]
    assert cost.split_ratios == (0.8, 0.7)
    assert backward_split(cost) == (pytest.approx(0.8 * cost.backward_s),
                                    pytest.approx(0.7 * cost.backward_s))
    assert backward_split(cost, 0.5) == (cost.backward_s / 2, cost.backward_s / 2)  # given: kept
    # the measured split lengthens a zero_bubble plan by what I + W add over B on its rank
    zb = _plan("zero_bubble")
    plain, split = _sim(zb, _profile()), _sim(zb, prof)
    assert split.iteration_s > plain.iteration_s
    # with I + W = B measured in halves, the replay is the default one exactly
    halves = _profile(**{"T-a": StepOverheads(0.0, 0.5, 0.5)})
    assert _sim(zb, halves).iteration_s == pytest.approx(plain.iteration_s)


def test_the_planner_drops_zero_bubble_where_the_split_costs_more_than_it_gains():
    m = 8

    def weighed(prof):
        cm = CostModel(toy_model(), two_groups(), prof)
        lay = layout_of_plan(cm, _plan("h1f1b", m=m))
        got, _, kinds = best_kind(cm, lay, replay_kind(cm, lay, m), m, "h1f1b")
        return got.schedule, dict(kinds)

    chosen, plain = weighed(_profile())
    assert chosen == "zero_bubble"
    # the split backward measured at twice the fused one: zero_bubble replays slower than h1f1b
    chosen, costly = weighed(_profile(**{"T-a": StepOverheads(0.0, 1.0, 1.0)}))
    assert chosen != "zero_bubble" and costly["zero_bubble"] > costly["h1f1b"] == plain["h1f1b"]
