"""Partial recompute in plan.json: Stage.recompute_layers (the first k block units of a stage
recompute), its round trip, older plans, each refusal, and the one derived reading."""
import json
import pytest

from hapt_hf.planner.plan import Plan, PlanError, Stage


def _plan(*, unit: str = "block", k: tuple[int, int] = (0, 0), recompute=(False, False)) -> Plan:
    # 12 blocks: layers 0..13 (block unit) or 0..25 (half unit); stage 0 holds the embedding
    n = 14 if unit == "block" else 26
    cut = 5 if unit == "block" else 9
    stages = (Stage.even(0, (0, cut), "a", "A100-40", (0,), 2, micro_batch_size=2,
                         recompute=recompute[0], recompute_layers=k[0]),
              Stage.even(1, (cut, n), "a", "A100-40", (1,), 1, micro_batch_size=2,
                         recompute=recompute[1], recompute_layers=k[1]))
    return Plan("llama", n, 128, 8, 2, 4, "1f1b", stages, layer_unit=unit)


def test_the_derived_reading_counts_block_units_only():
    plan = _plan(k=(2, 3)).validate()
    first, last = plan.stages
    # stage 0 holds emb + blocks 0..3 (4 units), stage 1 blocks 4..11 + head (8 units)
    assert (first.block_units(14), last.block_units(14)) == (4, 8)
    assert (first.recomputed_units(14), last.recomputed_units(14)) == (2, 3)
    whole = _plan(recompute=(True, False)).validate()
    assert whole.stages[0].recomputed_units(14) == 4 and whole.stages[1].recomputed_units(14) == 0
    halves = _plan(unit="half", k=(3, 0)).validate()  # emb, b0.attn .. b3.attn: 8 halves
    assert halves.stages[0].block_units(26) == 8 and halves.stages[0].recomputed_units(26) == 3


def test_round_trip_writes_the_key_only_when_set(tmp_path):
    plan = _plan(k=(3, 0)).validate()
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    stages = json.loads((tmp_path / "plan.json").read_text())["stages"]
    assert stages[0]["recompute_layers"] == 3 and "recompute_layers" not in stages[1]


def test_an_older_plan_without_the_key_loads_with_none(tmp_path):
    path = _plan(recompute=(True, False)).save(tmp_path / "plan.json")
    d = json.loads(path.read_text())
    assert all("recompute_layers" not in s for s in d["stages"])
    again = Plan.load(path)
    assert [s.recompute_layers for s in again.stages] == [0, 0]
    assert again.stages[0].recompute and not again.stages[1].recompute


@pytest.mark.parametrize("k, recompute, match", [
    ((-1, 0), (False, False), "stage 0 has recompute_layers -1; it must be >= 0"),
    ((0, 2), (False, True), "stage 1 sets recompute true and recompute_layers 2"),
    ((4, 0), (False, False), "stage 0 has recompute_layers 4 but holds 4 block unit"),
    ((0, 9), (False, False), "stage 1 has recompute_layers 9 but holds 8 block unit"),
])
def test_each_refusal_names_the_stage_and_the_fix(k, recompute, match):
    with pytest.raises(PlanError, match=match):
        _plan(k=k, recompute=recompute).validate()


def test_all_units_is_refused_with_the_way_to_say_it():
    with pytest.raises(PlanError, match="set recompute true and recompute_layers 0"):
        _plan(k=(4, 0)).validate()


def test_a_stage_of_no_blocks_takes_none():
    stages = (Stage.even(0, (0, 1), "a", "A100-40", (0,), 2, micro_batch_size=2,
                         recompute_layers=1),
              Stage.even(1, (1, 14), "a", "A100-40", (1,), 1, micro_batch_size=2))
    with pytest.raises(PlanError, match="holds 0 block unit"):
        Plan("llama", 14, 128, 8, 2, 4, "1f1b", stages).validate()


@pytest.mark.parametrize("value", [True, 1.5, "2"])
def test_a_non_integer_in_the_file_is_refused(tmp_path, value):
    d = json.loads(_plan().save(tmp_path / "plan.json").read_text())
    d["stages"][0]["recompute_layers"] = value
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="stage 0: recompute_layers .* must be an integer"):
        Plan.load(tmp_path / "plan.json")


def test_interleaving_hands_the_units_to_the_earliest_chunks():
    plan = _plan(k=(3, 5)).validate()
    inter = plan.interleave(2).validate()
    # rank 0: chunks (0, 3) emb,b0,b1 and (8, 10) b7,b8; rank 1: (3, 8) b2..b6, (10, 14) b9..
    by_rank = {r: [s for s in inter.stages if s.ranks == (r,)] for r in (0, 1)}
    assert [(s.recompute, s.recompute_layers) for s in by_rank[0]] == [(True, 0), (False, 1)]
    assert [(s.recompute, s.recompute_layers) for s in by_rank[1]] == [(True, 0), (False, 0)]
    assert [sum(s.recomputed_units(14) for s in by_rank[r]) for r in (0, 1)] == [3, 5]
