"""The one stage record (Stage of Replicas) in plan.json: the form written, the older forms that
still load, and the round trip for any valid plan."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapt_hf.planner.plan import Plan, PlanError, Replica, Stage, StagePrediction

MBS = 8


def _load(stage: dict, mbs: int = MBS) -> Stage:
    return Stage.from_dict(stage, mbs)


EVEN = Stage.even(1, (3, 6), "v100", "V100-32", (2, 3), 2, micro_batch_size=MBS,
                  predicted=StagePrediction(0.5, 1.0, 3e9))
UNEVEN = Stage(0, (0, 3), (Replica("a100", "A100-40", 5, (0,)),
                           Replica("v100", "V100-32", 3, (1,))), 3, recompute=True,
               optimizer="sharded")


def test_an_even_stage_is_written_as_replicas_of_equal_samples():
    d = EVEN.to_dict()
    assert list(d) == ["index", "layers", "replicas", "warmup", "recompute", "predicted", "dp", "tp",
                       "sp"]
    assert d["replicas"] == [{"group": "v100", "device_type": "V100-32", "samples": 4,
                              "ranks": [r]} for r in (2, 3)]
    assert d["dp"] == 2 and _load(d) == EVEN
    assert EVEN.ranks == (2, 3) and EVEN.width == 2 and EVEN.shares() == (4, 4)
    assert (EVEN.group, EVEN.device_type, EVEN.groups, EVEN.uneven) == \
        ("v100", "V100-32", ("v100",), False)


def test_uneven_replicas_are_written_in_the_same_form():
    d = UNEVEN.to_dict()
    assert list(d) == ["index", "layers", "replicas", "warmup", "recompute", "optimizer",
                       "predicted", "dp", "tp", "sp"]
    assert [r["samples"] for r in d["replicas"]] == [5, 3] and d["optimizer"] == "sharded"
    assert _load(d) == UNEVEN
    assert UNEVEN.uneven and UNEVEN.groups == ("a100", "v100") and UNEVEN.shares(8) == (5, 3)


def test_the_older_even_form_loads_to_the_same_stage():
    old = {"index": 1, "layers": [3, 6], "group": "v100", "device_type": "V100-32",
           "ranks": [2, 3], "warmup": 2, "recompute": False,
           "predicted": {"forward_s": 0.5, "backward_s": 1.0, "peak_memory_bytes": 3e9},
           "dp": 2}
    assert _load(old) == EVEN
    # the shares are the plan's micro-batch split evenly: it must divide
    with pytest.raises(PlanError, match="multiple of the stage's width"):
        _load(old, mbs=7)


def test_the_older_replicas_form_loads_to_the_same_stage():
    old = {"index": 0, "layers": [0, 3], "group": "a100", "device_type": "A100-40",
           "ranks": [0, 1], "warmup": 3, "recompute": True, "predicted": {},
           "replicas": [{"ranks": [0], "group": "a100", "device_type": "A100-40", "samples": 5},
                        {"ranks": [1], "group": "v100", "device_type": "V100-32", "samples": 3}],
           "optimizer": "sharded", "dp": 2}
    assert _load(old) == UNEVEN
    # what the older form lists beside the replicas must be theirs
    with pytest.raises(PlanError, match="make them agree"):
        _load(dict(old, ranks=[1, 0]))
    with pytest.raises(PlanError, match="first replica"):
        _load(dict(old, group="v100"))
    with pytest.raises(PlanError, match="dp is 3"):
        _load(dict(old, dp=3))


def test_a_replica_of_several_ranks_is_a_tensor_parallel_group():
    tp = Stage(0, (0, 3), (Replica("a100", "A100-40", 5, (0, 1)),
                           Replica("a100", "A100-40", 3, (2, 3))), 2)
    d = tp.to_dict()
    assert d["tp"] == 2 and d["dp"] == 2 and _load(d) == tp
    assert tp.ranks == (0, 1, 2, 3) and tp.width == 2 and tp.tp == 2
    tp.validate(MBS)
    plan = Plan("m", 6, 32, 16, MBS, 2, "1f1b",
                (tp, Stage.even(1, (3, 6), "v100", "V100-32", (4,), micro_batch_size=MBS)))
    assert plan.validate().world_size == 5
    assert plan.stage_of_rank(3) == tp and EVEN.tp == 1


def test_sequence_parallelism_is_written_per_stage_and_only_where_tp_is_above_one():
    sp = Stage(0, (0, 3), (Replica("a100", "A100-40", MBS, (0, 1)),), 2, sequence_parallel=True)
    d = sp.to_dict()
    assert d["sp"] is True and _load(d) == sp
    sp.validate(MBS)
    del d["sp"]  # older files: no sequence parallelism
    assert _load(d).sequence_parallel is False and EVEN.to_dict()["sp"] is False
    with pytest.raises(PlanError, match=r"stage 1 sets sp .*\(tp > 1\)"):
        Stage.even(1, (3, 6), "v100", "V100-32", (2, 3), micro_batch_size=MBS,
                   sequence_parallel=True).validate(MBS)
    with pytest.raises(PlanError, match="sp is 'yes'; it must be true or false"):
        _load(dict(d, sp="yes"))


def test_replicas_of_unequal_tensor_parallel_degrees_are_refused():
    d = UNEVEN.to_dict()
    d["replicas"][0]["ranks"] = [0, 2]
    del d["tp"]
    stage = _load(d)
    assert stage.ranks == (0, 2, 1) and stage.width == 2
    with pytest.raises(PlanError, match="same tensor-parallel degree"):
        stage.validate(MBS)
    d["tp"] = 1
    with pytest.raises(PlanError, match="tp is 1"):
        _load(d)


def test_a_plan_round_trips_in_every_form(tmp_path):
    plan = Plan("m", 6, 32, 16, MBS, 2, "1f1b", (UNEVEN, EVEN)).validate()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.load(plan.save(tmp_path / "plan.json")) == plan
    d = json.loads((tmp_path / "plan.json").read_text())
    assert all("replicas" in s and "ranks" not in s for s in d["stages"])
    assert plan.stage_of_rank(3) == EVEN and plan.world_size == 4


# -- any valid plan -------------------------------------------------------------------------

@st.composite
def plans(draw) -> Plan:
    n = draw(st.integers(1, 4))
    mbs = draw(st.integers(1, 12))
    blocks = draw(st.integers(n, 8))
    layers = blocks + 2
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1)))
    edges = [0, *cuts, layers]
    groups = ["a", "b", "c"]
    stages, rank = [], 0
    for i in range(n):
        width = draw(st.integers(1, min(4, mbs)))
        if draw(st.booleans()):  # uneven: any shares of at least one sample
            cut = sorted(draw(st.sets(st.integers(1, mbs - 1), min_size=width - 1,
                                      max_size=width - 1))) if width > 1 else []
            shares = [b - a for a, b in zip([0, *cut], [*cut, mbs])]
            reps = tuple(Replica(draw(st.sampled_from(groups)), draw(st.sampled_from(["X", "Y"])),
                                 s, (rank + j,)) for j, s in enumerate(shares))
        else:
            width = max(d for d in range(1, width + 1) if mbs % d == 0)
            reps = tuple(Replica("a", "X", mbs // width, (rank + j,)) for j in range(width))
        rank += len(reps)
        optimizer = "sharded" if len(reps) > 1 and draw(st.booleans()) else "replicated"
        prediction = StagePrediction(*draw(st.tuples(*[st.floats(0, 1e10)] * 3)))
        stages.append(Stage(i, (edges[i], edges[i + 1]), reps, draw(st.integers(1, 8)),
                            draw(st.booleans()), optimizer, prediction))
    m = draw(st.integers(1, 4))
    return Plan("m", layers, 16, mbs * m, mbs, m, draw(st.sampled_from(["1f1b", "gpipe"])),
                tuple(stages), baselines={"uniform": draw(st.floats(0, 10))},
                idle_groups=draw(st.sampled_from([(), ("d",)])))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_any_valid_plan_round_trips(plan):
    plan.validate()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
