"""Plan (plan.json) and Schedule (action lists): pure data, no processes."""
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from hapt_hf.planner.plan import Plan, PlanError, Replica, Stage, StagePrediction
from hapt_hf.planner.schedule import (Action, ActionKind, Schedule, ScheduleError, build_schedule,
                                      default_warmups, format_grid, validate_schedule)


def _plan(**kw) -> Plan:
    stages = (
        Stage.even(0, (0, 5), "v100", "V100-32", (0, 1), 3, micro_batch_size=2,
                   predicted=StagePrediction(0.011, 0.022, 9.1e9)),
        Stage.even(1, (5, 9), "a100", "A100-40", (2,), 2, micro_batch_size=2),
        Stage.even(2, (9, 14), "a100", "A100-40", (3,), 1, micro_batch_size=2, recompute=True),
    )
    base = dict(model_name="gpt2", num_layers=14, seq_len=1024, global_batch_size=64,
                micro_batch_size=2, num_microbatches=32, schedule="h1f1b", stages=stages)
    base.update(kw)
    return Plan(**base)


def test_plan_round_trips_through_json(tmp_path):
    plan = _plan(baselines={"uniform": 2.5})
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again == plan
    assert json.loads(path.read_text())["stages"][0]["dp"] == 2
    assert again.world_size == 4 and again.stage_of_rank(2).index == 1


def _uneven_plan(optimizer: str = "sharded") -> Plan:
    mixed = Stage(0, (0, 5), (Replica("a100", "A100-40", 5, (0,)),
                              Replica("v100", "V100-32", 2, (1,)),
                              Replica("v100", "V100-32", 1, (2,))), 2, optimizer=optimizer)
    even = Stage.even(1, (5, 14), "v100", "V100-32", (3, 4), 1, micro_batch_size=8,
                      optimizer="sharded")
    return Plan("gpt2", 14, 1024, 32, 8, 4, "1f1b", (mixed, even))


def test_uneven_replicas_and_sharded_optimizer_round_trip(tmp_path):
    plan = _uneven_plan().validate()
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    d = json.loads((tmp_path / "plan.json").read_text())["stages"]
    assert d[0]["replicas"][0] == {"ranks": [0], "group": "a100", "device_type": "A100-40",
                                   "samples": 5}
    assert d[0]["optimizer"] == "sharded" and "optimizer" in d[1]
    assert d[1]["replicas"] == [{"group": "v100", "device_type": "V100-32", "samples": 4,
                                 "ranks": [r]} for r in (3, 4)]
    assert again.stages[0].shares(8) == (5, 2, 1) and again.stages[1].shares(8) == (4, 4)
    assert again.stages[0].groups == ("a100", "v100")
    assert again.stages[0].uneven and not again.stages[1].uneven


def test_even_replicas_listed_in_full_are_an_even_stage():
    reps = tuple(Replica("v100", "V100-32", 2, (r,)) for r in (0, 1))
    assert Stage(0, (0, 5), reps, 3) == Stage.even(0, (0, 5), "v100", "V100-32", (0, 1), 3,
                                                   micro_batch_size=4)
    assert not Stage(0, (0, 5), reps, 3).uneven


def test_a_plan_without_optimizer_still_loads():
    d = _plan().to_dict()
    assert all("optimizer" not in s for s in d["stages"])
    again = Plan.from_dict(d)
    assert all(s.optimizer == "replicated" and not s.uneven for s in again.stages)


@pytest.mark.parametrize("edit, words", [
    (lambda s: replace(s, optimizer="zero3"), "optimizer 'zero3' is unknown"),
    (lambda s: replace(s, replicas=s.replicas[:2]), "sum to 7"),
    (lambda s: replace(s, replicas=(replace(s.replicas[0], samples=6), s.replicas[1],
                                    replace(s.replicas[2], samples=0))), "a replica with none"),
    (lambda s: replace(s, replicas=(replace(s.replicas[0], ranks=(0, 5)),) + s.replicas[1:]),
     "same tensor-parallel degree"),
])
def test_bad_replicas_are_named(edit, words):
    plan = _uneven_plan()
    bad = replace(plan, stages=(edit(plan.stages[0]), plan.stages[1]))
    with pytest.raises(PlanError, match=words):
        bad.validate()


def test_sharding_one_replica_is_refused():
    plan = _plan()
    one = replace(plan.stages[1], optimizer="sharded")
    with pytest.raises(PlanError, match="at least 2 replicas"):
        replace(plan, stages=(plan.stages[0], one, plan.stages[2])).validate()


@pytest.mark.parametrize("change, words", [
    (dict(micro_batch_size=3), "global_batch_size"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(num_layers=15), "last stage must end"),
])
def test_plan_validation_names_the_field(change, words):
    with pytest.raises(PlanError, match=words):
        _plan(**change).validate()


def test_plan_rejects_gap_overlap_and_empty_stage():
    p = _plan()
    gap = replace(p, stages=(p.stages[0], replace(p.stages[1], layers=(6, 9)), p.stages[2]))
    with pytest.raises(PlanError, match="leaves out"):
        gap.validate()
    empty = replace(p, stages=(p.stages[0], replace(p.stages[1], layers=(5, 5)),
                               replace(p.stages[2], layers=(5, 14))))
    with pytest.raises(PlanError, match="empty layer range"):
        empty.validate()
    with pytest.raises(PlanError, match="started"):
        p.validate(world_size=3)


def test_plan_load_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    d = _plan().to_dict()
    del d["stages"][1]["replicas"][0]["ranks"]
    with pytest.raises(PlanError, match="'ranks'"):
        Plan.from_dict(d)
    d = _plan().to_dict()
    del d["stages"][1]["replicas"]
    with pytest.raises(PlanError, match="'ranks'"):
        Plan.from_dict(d)


def test_with_schedule_sets_default_warmups():
    p = _plan()
    assert p.with_schedule("1f1b").warmups() == [3, 2, 1]
    assert p.with_schedule("gpipe").warmups() == [32, 32, 32]


def test_action_string_round_trip():
    for a in (Action(1, ActionKind.F, 3), Action(12, ActionKind.RECV_B, 40)):
        assert Action.parse(str(a)) == a


def _compute(s: Schedule, stage: int) -> list[str]:
    return [str(a) for a in s.compute_only(stage)]


def test_1f1b_order_matches_the_textbook():
    s = build_schedule("1f1b", 3, 4)
    assert _compute(s, 0) == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert _compute(s, 2) == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_gpipe_runs_all_forwards_first():
    s = build_schedule("gpipe", 2, 3)
    assert _compute(s, 1) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_receives_are_posted_one_compute_ahead():
    s = build_schedule("1f1b", 3, 4)
    for lst in s.actions:
        comp_pos = [i for i, a in enumerate(lst) if a.is_compute]
        for j, i in enumerate(comp_pos[1:], start=1):
            a = lst[i]
            want = {ActionKind.F: ActionKind.RECV_F, ActionKind.B: ActionKind.RECV_B}[a.kind]
            recv = [k for k, b in enumerate(lst) if b.kind is want and b.microbatch == a.microbatch]
            if recv:  # the transfer overlaps the compute before it
                assert recv[0] < comp_pos[j - 1], (lst, a)


def test_deadlocking_warmups_fail_with_marked_grid():
    with pytest.raises(ScheduleError) as e:
        build_schedule("h1f1b", 3, 4, [1, 2, 1])
    msg = str(e.value)
    assert "deadlock" in msg and "[0B0]" in msg and " rank |" in msg


def test_static_checks_catch_missing_and_unmatched_actions():
    good = build_schedule("1f1b", 2, 2)
    lists = [list(l) for l in good.actions]
    lists[1] = [a for a in lists[1] if str(a) != "1B1"]
    with pytest.raises(ScheduleError, match="never runs B of micro-batch 1"):
        validate_schedule(replace(good, actions=tuple(tuple(l) for l in lists)))
    lists = [list(l) for l in good.actions]
    lists[1] = [a for a in lists[1] if str(a) != "1RECV_F0"]
    with pytest.raises(ScheduleError, match="no matching RECV_F|before its RECV_F"):
        validate_schedule(replace(good, actions=tuple(tuple(l) for l in lists)))


def test_schedule_dict_round_trip():
    s = build_schedule("h1f1b", 3, 5, [4, 3, 1])
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert "0F0" in format_grid(s)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), m=st.integers(1, 12), kind=st.sampled_from(["gpipe", "1f1b"]),
       extra=st.lists(st.integers(0, 3), min_size=6, max_size=6))
def test_every_nonincreasing_warmup_schedule_is_valid(n, m, kind, extra):
    warm = default_warmups(kind, n, m)
    if kind == "1f1b":  # H-1F1B: deeper warm-ups, still non-increasing along the pipeline
        acc = 0
        for i in reversed(range(n)):
            acc += extra[i]
            warm[i] += acc
    s = build_schedule("h1f1b" if kind == "1f1b" else kind, n, m, warm)
    for stage in range(n):
        comp = s.compute_only(stage)
        assert sorted(str(a) for a in comp) == sorted(
            [f"{stage}F{k}" for k in range(m)] + [f"{stage}B{k}" for k in range(m)])
        first_b = next(i for i, a in enumerate(comp) if a.kind is ActionKind.B)
        assert first_b == min(s.warmups[stage], m)


def _run_lists(sched: Schedule, dur: list[float]) -> dict:
    """Execute the action lists with compute durations ``dur[stage]``: a compute waits for its
    input's arrival, a send leaves when posted and arrives 1.0 later, posting a receive takes
    no time. Returns when each transfer's send and receive were posted."""
    n = sched.num_stages
    pos, clock = [0] * n, [0.0] * n
    arrive: dict[tuple[str, int, int], float] = {}  # (F|B, stage it arrives at, mb) -> time
    posted: dict[tuple[str, int, int, str], float] = {}
    while any(pos[s] < len(sched.actions[s]) for s in range(n)):
        moved = False
        for s in range(n):
            while pos[s] < len(sched.actions[s]):
                a = sched.actions[s][pos[s]]
                k, t = a.microbatch, clock[s]
                if a.kind in (ActionKind.F, ActionKind.B):
                    need = ("F", s, k) if a.kind is ActionKind.F else ("B", s, k)
                    has_input = (a.kind is ActionKind.F and s == 0) or (
                        a.kind is ActionKind.B and s == n - 1)
                    if not has_input and need not in arrive:
                        break
                    clock[s] = max(t, 0.0 if has_input else arrive[need]) + dur[s]
                elif a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    to = ("F", s + 1, k) if a.kind is ActionKind.SEND_F else ("B", s - 1, k)
                    arrive[to] = t + 1.0
                    posted[to + ("send",)] = t
                else:
                    posted[("F" if a.kind is ActionKind.RECV_F else "B", s, k, "recv")] = t
                pos[s] += 1
                moved = True
        assert moved, "the lists deadlock"
    return posted


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 5), m=st.integers(1, 10),
       extra=st.lists(st.integers(0, 4), min_size=5, max_size=5),
       dur=st.lists(st.floats(0.1, 3.0), min_size=5, max_size=5))
def test_early_receives_are_posted_before_their_send_and_move_nothing_else(n, m, extra, dur):
    warm = default_warmups("1f1b", n, m)
    acc = 0
    for i in reversed(range(n)):
        acc += extra[i]
        warm[i] += acc
    late = build_schedule("h1f1b", n, m, warm)
    early = build_schedule("h1f1b", n, m, warm, early_receives=True)
    recv = (ActionKind.RECV_F, ActionKind.RECV_B)
    for s in range(n):
        # the computes and sends are the same list; only the receives move, never later
        assert [a for a in early.actions[s] if a.kind not in recv] == \
            [a for a in late.actions[s] if a.kind not in recv]
        def computes_before(lst, a):
            i = lst.index(a)
            return sum(1 for x in lst[:i] if x.kind in (ActionKind.F, ActionKind.B))
        for a in late.actions[s]:
            if a.kind in recv:
                assert computes_before(early.actions[s], a) <= computes_before(late.actions[s], a)
    # whatever the stages' speeds, every receive is up when (or before) its send leaves:
    # a transport that moves data only once the receive is posted never holds a send back
    times = _run_lists(early, dur[:n])
    for (what, stage, k, kind), t_recv in times.items():
        if kind == "recv":
            assert t_recv <= times[(what, stage, k, "send")] + 1e-9, f"{what}{k} into {stage}"


def test_a_receive_one_action_ahead_can_come_after_its_send():
    # what early receives fix: H-1F1B's stage 1 sends all 8 activations at once, the 1F1B
    # stage after it posts each receive one compute action ahead
    warm = [8, 8, 2, 1]
    for early, late_ones in ((False, True), (True, False)):
        times = _run_lists(build_schedule("h1f1b", 4, 8, warm, early_receives=early),
                           [0.2, 0.2, 1.0, 1.0])
        late = [(w, s, k) for (w, s, k, kind), t in times.items()
                if kind == "recv" and t > times[(w, s, k, "send")] + 1e-9]
        assert bool(late) is late_ones, late
