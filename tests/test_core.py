"""The shared facts in hapt_hf.core, and that every side reads them rather than its own copy."""
from __future__ import annotations

import pytest

from hapt_hf.core.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_of
from hapt_hf.core.layers import (BLOCK, HALF, BlockPart, block_boundary_in_halves, block_parts,
                                 layer_name, layer_names, num_blocks, num_layers)
from hapt_hf.core.precision import DTYPE_BYTES, DTYPES, canonical_dtype
from hapt_hf.core.ranks import first_ranks
from hapt_hf.core.schedules import (GENERATORS, SCHEDULES, ActionKind, ScheduleKind,
                                    default_warmups, plan_sets_warmups, schedule_generator,
                                    schedule_warmups, warmups_from_steps)
from hapt_hf.errors import HaptError, ScheduleError


# -- layers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("unit, blocks, layers", [(BLOCK, 4, 6), (HALF, 4, 10), (BLOCK, 1, 3)])
def test_layer_count_in_each_unit(unit, blocks, layers):
    assert num_layers(blocks, unit) == layers and num_blocks(layers, unit) == blocks


def test_names_of_entries_and_ranges():
    assert [layer_name(i, 6) for i in range(6)] == ["emb", "b0", "b1", "b2", "b3", "head"]
    assert [layer_name(i, 6, HALF) for i in range(1, 5)] == ["b0.attn", "b0.mlp", "b1.attn",
                                                             "b1.mlp"]
    assert layer_names((0, 3), 6) == "emb,b0-b1" and layer_names((5, 6), 6) == "head"
    assert layer_names((2, 6), 10, HALF) == "b0.mlp-b2.attn"
    assert layer_names((2, 7), 10, HALF) == "b0.mlp-b2"
    assert layer_names((1, 5), 10, HALF) == "b0-b1"


def test_block_parts_join_two_halves_into_a_whole_block():
    assert block_parts((2, 6), 4, HALF) == (BlockPart(0, "mlp"), BlockPart(1, "full"),
                                           BlockPart(2, "attn"))
    assert block_parts((0, 6), 4, BLOCK) == tuple(BlockPart(i, "full") for i in range(4))


@pytest.mark.parametrize("blocks", [1, 3, 5])
def test_block_boundaries_keep_the_same_blocks_in_halves(blocks):
    for a in range(num_layers(blocks)):
        for b in range(a + 1, num_layers(blocks) + 1):
            halves = (block_boundary_in_halves(a, blocks), block_boundary_in_halves(b, blocks))
            assert block_parts(halves, blocks, HALF) == block_parts((a, b), blocks, BLOCK)
            assert (halves[0] == 0) == (a == 0)
            assert (halves[1] == num_layers(blocks, HALF)) == (b == num_layers(blocks))


# -- schedules ---------------------------------------------------------------------------------

def test_schedule_kinds_read_as_their_names():
    assert SCHEDULES == ("gpipe", "1f1b", "h1f1b", "zero_bubble", "interleaved")
    assert ScheduleKind.H1F1B == "h1f1b" and f"{ScheduleKind.GPIPE}" == "gpipe"
    assert str(ScheduleKind.ONE_F_ONE_B) == "1f1b"


def test_warmup_rules():
    assert default_warmups("gpipe", 3, 5) == [5, 5, 5]
    assert default_warmups("1f1b", 4, 3) == [3, 3, 2, 1]
    assert default_warmups("h1f1b", 4, 9) == [4, 3, 2, 1]
    # only H-1F1B keeps the depths a plan gives; the others run their own
    assert schedule_warmups("h1f1b", (7, 2, 1), 9) == (7, 2, 1)
    assert schedule_warmups("gpipe", (7, 2, 1), 9) == (9, 9, 9)
    assert schedule_warmups("1f1b", (7, 2, 1), 9) == (3, 2, 1)
    assert warmups_from_steps([3, 1, 0], 5) == (5, 3, 2, 1)  # a step under 1 counts as 1
    assert plan_sets_warmups("h1f1b") and not plan_sets_warmups("1f1b")
    assert set(GENERATORS) == set(ScheduleKind)  # one generator per kind, in one registry
    with pytest.raises(ScheduleError, match="'2f2b' is unknown"):
        schedule_generator("2f2b")


def _rank_list(kind, stages, m, warmups, rank, **kw):
    lists, placement = schedule_generator(kind).generate(stages, m, warmups, **kw)
    assert placement == tuple(range(stages))  # these kinds: stage s on pipeline rank s
    assert all(s == rank for _, s, _ in lists[rank])  # every action names its stage
    return [(k, mb) for k, _, mb in lists[rank]]


def test_rank_lists_post_receives_ahead_and_send_after_each_compute():
    got = [f"{k.value}{mb}" for k, mb in _rank_list("h1f1b", 3, 3, [3, 2, 1], 1)]
    assert got == ["RECV_F0", "RECV_F1", "F0", "SEND_F0", "RECV_B0", "F1", "SEND_F1", "RECV_F2",
                   "B0", "SEND_B0", "RECV_B1", "F2", "SEND_F2", "RECV_B2", "B1", "SEND_B1",
                   "B2", "SEND_B2"]
    # early: a stage after an all-forwards-first stage posts every activation's receive at the
    # start; the gradient of j from a one-deep stage after it right after sending F(j)
    early = [f"{k.value}{mb}" for k, mb in _rank_list("h1f1b", 4, 4, [4, 4, 2, 1], 2,
                                                      early_receives=True)]
    assert early == ["RECV_F0", "RECV_F1", "RECV_F2", "RECV_F3", "F0", "SEND_F0", "RECV_B0",
                     "F1", "SEND_F1", "RECV_B1", "B0", "SEND_B0", "F2", "SEND_F2", "RECV_B2",
                     "B1", "SEND_B1", "F3", "SEND_F3", "RECV_B3", "B2", "SEND_B2", "B3",
                     "SEND_B3"]
    last = _rank_list("h1f1b", 3, 2, [2, 1, 1], 2, receives=False)
    assert all(k not in (ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.SEND_F)
               for k, _ in last)


# -- the other facts ---------------------------------------------------------------------------

def test_precision():
    assert DTYPES == tuple(DTYPE_BYTES)
    assert canonical_dtype("bfloat16") == "bf16" and canonical_dtype("fp8") is None


def test_ranks_are_numbered_group_by_group():
    assert first_ranks([("a", 4), ("b", 2), ("c", 1)]) == {"a": 0, "b": 4, "c": 6}


def test_every_error_class_has_one_root():
    import hapt_hf.errors as errors
    import hapt_hf.planner as planner
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), HaptError)
    for name in planner.__all__:
        if name.endswith("Error"):
            assert getattr(planner, name) is getattr(errors, name), name


# -- every side reads the one family list ------------------------------------------------------

def test_planner_describes_every_supported_family_and_halves_where_allowed():
    from hapt_hf.planner.model_spec import SUPPORTED_FAMILIES, ModelSpec
    assert SUPPORTED_FAMILIES == SUPPORTED_MODEL_TYPES
    for model_type in SUPPORTED_MODEL_TYPES:
        spec = ModelSpec.from_name_or_path(f"{model_type}-tiny", seq_len=16)
        assert spec.can_split_blocks == family_of(model_type).halvable, model_type


def test_stage_builder_cuts_every_supported_family_and_halves_where_allowed():
    from hapt_hf.pipeline.families import adapter_for, supported_families
    assert supported_families() == [f.name for f in FAMILIES]
    for f in FAMILIES:
        for model_type in f.model_types:
            adapter = adapter_for(model_type)
            assert adapter.name == f.name
            assert (adapter.attention_half is not None) == f.halvable, model_type


def test_an_atomic_write_gets_the_permissions_open_gives(tmp_path):
    """A plan.json or profile store written atomically is readable as a plainly written file
    is (a temporary file from mkstemp would leave it owner-only), under any umask."""
    import os

    from hapt_hf.core.files import write_atomic
    old = os.umask(0o022)
    try:
        for mask in (0o022, 0o077, 0o002):
            os.umask(mask)
            out = write_atomic(tmp_path / f"plan{mask}.json", "{}")
            plain = tmp_path / f"plain{mask}.json"
            plain.write_text("{}")
            assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o666 & ~mask
            assert out.read_text() == "{}"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_tp_refusal_names_each_size_the_degree_does_not_divide():
    from hapt_hf.core.tp import tp_refusal
    assert tp_refusal(1, 3, 1, 7) is None
    assert tp_refusal(4, 32, 8, 11008) is None
    assert tp_refusal(2, 32, None, 11008) is None  # no GQA: kv heads = heads
    why = tp_refusal(4, 12, 2, 3072)
    assert why is not None and "key/value heads 2;" in why and "attention heads 12" not in why
    why = tp_refusal(8, 12, 12, 100)
    assert "attention heads 12" in why and "key/value heads 12" in why and "MLP width 100" in why
    assert "must be >= 1" in tp_refusal(0, 4, 4, 4)


def test_sp_refusal_names_what_keeps_a_stage_from_sequence_parallelism():
    from hapt_hf.core.tp import sp_refusal
    from transformers import GPT2Config, LlamaConfig, Qwen3Config
    llama, qwen3 = LlamaConfig().base_model_tp_plan, Qwen3Config().base_model_tp_plan
    assert sp_refusal("llama", llama, 2) is None and sp_refusal("qwen3", qwen3, 4) is None
    assert "'gpt2' is not among" in sp_refusal("gpt2", GPT2Config().base_model_tp_plan, 2)
    assert "has 1" in sp_refusal("llama", llama, 1)
    assert "layer_unit is 'half'" in sp_refusal("llama", llama, 2, "half")
    no_down = {k: v for k, v in llama.items() if "down_proj" not in k}
    assert "mlp.down_proj: rowwise" in sp_refusal("llama", no_down, 2)


def test_head_sharded_only_where_the_class_plan_names_it_and_it_is_untied():
    from hapt_hf.core.tp import head_refusal, head_sharded
    plan = {"lm_head": "colwise_gather_output"}  # LlamaForCausalLM._tp_plan
    assert head_sharded(2, plan, tied=False) and not head_sharded(1, plan, tied=False)
    assert not head_sharded(4, plan, tied=True) and "tied" in head_refusal(plan, True)
    assert not head_sharded(4, None, tied=False) and "None" in head_refusal(None, False)


def test_block_activation_parts_split_everything_under_sequence_parallelism():
    from hapt_hf.core.tp import block_activation_parts
    assert block_activation_parts(1, False) == block_activation_parts(1, True) == 34
    assert block_activation_parts(2, False) == 22 and block_activation_parts(2, True) == 17
    assert block_activation_parts(8, True) == 34 / 8
