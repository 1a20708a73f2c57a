"""Half-block layers (HAPT's fine-grained layers): ModelSpec figures, plan.json, profile split,
and the search's layer_unit option."""
from __future__ import annotations

from dataclasses import replace

import pytest
import transformers

from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import ModelSpec, ModelSpecError
from hapt_hf.planner.plan import Plan, PlanError, Stage
from hapt_hf.planner.profile import LayerTiming, Profile, ProfileKey
from hapt_hf.planner.search import PlannerOptions, PlanningError, plan_job
from hapt_hf.planner.simulate import simulate_plan

from benchmarks.inputs import scenario_path

SEQ = 16
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=48, n_layer=3, n_head=4, vocab_size=128,
                                            n_positions=64, n_inner=100),
    "llama-bias": lambda: transformers.LlamaConfig(**LLAMA_LIKE, attention_bias=True,
                                                   mlp_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE),
    "opt": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=3,
                                          num_attention_heads=4, vocab_size=128,
                                          max_position_embeddings=64),
    "opt-postnorm": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=96,
                                                   num_hidden_layers=3, num_attention_heads=4,
                                                   vocab_size=128, max_position_embeddings=64,
                                                   do_layer_norm_before=False),
}
HALVES = {"gpt2": (("ln_1", "attn"), ("ln_2", "mlp")),
          "llama": (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),
          "opt": (("self_attn_layer_norm", "self_attn"), ("final_layer_norm", "fc1", "fc2"))}


def _blocks_and_halves(model, key: str):
    """The model's decoder blocks and the submodule names of their two halves."""
    family = key.split("-")[0]
    if family == "gpt2":
        return model.transformer.h, HALVES["gpt2"]
    if family == "opt":
        return model.model.decoder.layers, HALVES["opt"]
    return model.model.layers, HALVES["llama"]


def _numel(*modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _matmul(*modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters() if p.dim() == 2)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_half_params_and_flops_match_the_real_modules(key):
    cfg = CONFIGS[key]()
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = ModelSpec.from_config(cfg, seq_len=SEQ)
    half = spec.split_blocks()
    eager = ModelSpec.from_config(cfg, seq_len=SEQ, attn_implementation="eager").split_blocks()
    assert half.layer_unit == "half" and half.num_layers == 2 * cfg.num_hidden_layers + 2
    assert half.total_params == spec.total_params
    blocks, (attn_names, mlp_names) = _blocks_and_halves(model, key)
    attn_width = spec.num_heads * (spec.hidden_size // spec.num_heads)
    for i, block in enumerate(blocks):
        a, m = half.layers[1 + 2 * i], half.layers[2 + 2 * i]
        attn_mods = [getattr(block, n) for n in attn_names]
        mlp_mods = [getattr(block, n) for n in mlp_names]
        assert (a.params, m.params) == (_numel(*attn_mods), _numel(*mlp_mods))
        # sdpa: causal kernels compute half the score square, and recompute it in the backward
        assert a.fwd_flops == 2 * SEQ * _matmul(*attn_mods) + 2 * SEQ ** 2 * attn_width
        assert a.bwd_flops == 4 * SEQ * _matmul(*attn_mods) + 5 * SEQ ** 2 * attn_width
        assert m.fwd_flops == 2 * SEQ * _matmul(*mlp_mods) and m.bwd_flops == 2 * m.fwd_flops
        e = eager.layers[1 + 2 * i]  # eager computes the whole square
        assert e.fwd_flops == 2 * SEQ * _matmul(*attn_mods) + 4 * SEQ ** 2 * attn_width
        assert e.bwd_flops == 2 * e.fwd_flops
        whole = spec.layers[1 + i]
        assert a.fwd_flops + m.fwd_flops == whole.fwd_flops
        assert a.bwd_flops + m.bwd_flops == whole.bwd_flops
        assert a.act_keep_bytes + m.act_keep_bytes == whole.act_keep_bytes
        assert a.act_keep_bytes > 0 and m.act_keep_bytes > 0
        # both halves send the residual stream, like the whole block
        assert a.act_out_bytes == m.act_out_bytes == whole.act_out_bytes
        assert a.profile_signature == m.profile_signature == whole.signature
        assert a.profile_share + m.profile_share == pytest.approx(1.0)
    assert half.layers[0] == spec.layers[0]
    assert half.layers[-1] == replace(spec.layers[-1], index=half.num_layers - 1)
    # one signature per half kind, distinct from each other and from the ends
    assert len({l.signature for l in half.layers}) == 4
    assert [l.index for l in half.layers] == list(range(half.num_layers))


def test_opt_blocks_are_halved():
    spec = ModelSpec.from_name_or_path("opt-tiny", 32)
    assert spec.can_split_blocks and spec.half_refusal == ""
    half = spec.split_blocks()
    assert half.num_layers == 2 * spec.num_blocks + 2 and half.total_params == spec.total_params


def _half_plan(layer_unit="half", num_layers=8) -> Plan:
    stages = (Stage.even(0, (0, 4), "g", "cpu", (0,), 2, micro_batch_size=2),
              Stage.even(1, (4, num_layers), "g", "cpu", (1,), 1, micro_batch_size=2))
    return Plan("m", num_layers, 16, 8, 2, 4, "1f1b", stages, layer_unit=layer_unit)


def test_plan_json_round_trip_with_layer_unit(tmp_path):
    plan = _half_plan().validate()
    assert plan.to_dict()["layer_unit"] == "half"
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back == plan and back.layer_unit == "half" and back.num_blocks() == 3
    block = replace(plan, layer_unit="block")
    assert "layer_unit" not in block.to_dict()  # absent means whole blocks: old files agree
    assert Plan.from_dict(block.to_dict()).layer_unit == "block"
    with pytest.raises(PlanError, match="layer_unit 'third' is unknown"):
        _half_plan("third").validate()
    with pytest.raises(PlanError, match="layer_unit 'half' needs an even num_layers"):
        _half_plan(num_layers=7).validate()


def _scenario(name: str):
    cluster = Cluster.load(scenario_path(name))
    job = cluster.job
    return ModelSpec.from_job_model(job.model, job.seq_len, job.dtype), cluster, job


def test_block_profile_is_shared_between_halves_by_flops():
    spec = ModelSpec.from_name_or_path("llama-tiny", 32)
    cluster = _scenario("harp_v100x2_a100x1")[1]
    group = cluster.groups[0]
    block = spec.layers[1]
    key = ProfileKey(group.gpu.name, block.signature, 2, spec.seq_len, spec.dtype)
    profile = Profile({key: LayerTiming(0.3, 0.6, 0.01)})
    whole = CostModel(spec, cluster, profile)
    half = CostModel(spec.split_blocks(), cluster, profile)
    f, b = whole.compute_s(group, 2, 1, 2)
    assert (f, b) == pytest.approx((0.3, 0.6))
    fa, ba = half.compute_s(group, 2, 1, 2)
    fm, bm = half.compute_s(group, 2, 2, 3)
    share = spec.split_blocks().layers[1].profile_share
    assert (fa, ba) == pytest.approx((0.3 * share, 0.6 * share))
    assert (fa + fm, ba + bm) == pytest.approx((0.3, 0.6))


def test_auto_keeps_the_faster_unit_and_stays_ahead_of_baselines():
    model, cluster, job = _scenario("harp_3groups_1p3b")
    results = {u: plan_job(model, cluster, job.global_batch_size,
                           options=PlannerOptions(layer_unit=u)) for u in ("block", "half", "auto")}
    assert results["block"].plan.layer_unit == "block"
    half = results["half"].plan
    assert half.layer_unit == "half" and half.num_layers == 2 * model.num_blocks + 2
    # on this scenario a cut inside a block balances the stages better
    assert any(s.layers[1] % 2 == 0 and s.layers[1] < half.num_layers for s in half.stages)
    auto = results["auto"]
    assert auto.sim.iteration_s == min(r.sim.iteration_s for r in results.values())
    assert auto.plan == plan_job(model, cluster, job.global_batch_size).plan  # deterministic
    for name, b in auto.baselines.items():
        assert b.plan is None or b.plan.layer_unit == "block", name
        if b.sim is not None and b.sim.feasible:
            assert auto.sim.iteration_s <= b.sim.iteration_s * (1 + 1e-9), name
    # the simulator replays the half plan on the half sequence to the same time
    replay = simulate_plan(half, model.split_blocks(), cluster)
    assert replay.iteration_s == pytest.approx(results["half"].sim.iteration_s)


def test_layer_unit_option_is_checked():
    with pytest.raises(PlanningError, match="layer_unit 'quarter' is unknown"):
        PlannerOptions(layer_unit="quarter")
    model, cluster, job = _scenario("sailor_a100x8_v100x8_opt350")
    # OPT-350m's post-norm blocks are cut in halves too
    half = plan_job(model, cluster, job.global_batch_size, options=PlannerOptions(layer_unit="half"))
    assert half.plan.layer_unit == "half" and half.plan.num_layers == 2 * model.num_blocks + 2
    whole = replace(model, half_layers=())  # a sequence without half figures
    with pytest.raises(PlanningError, match="cannot be cut in two"):
        plan_job(whole, cluster, job.global_batch_size, options=PlannerOptions(layer_unit="half"))


def test_with_layer_unit_gives_the_sequence_a_plan_indexes():
    spec = ModelSpec.from_name_or_path("gpt2-tiny", 32)
    assert spec.with_layer_unit("block") is spec
    half = spec.with_layer_unit("half")
    assert half == spec.split_blocks() and half.with_layer_unit("half") is half
    with pytest.raises(ModelSpecError, match="build the ModelSpec again"):
        half.with_layer_unit("block")


def _group(name: str, tflops: float, gpus: int):
    from hapt_hf.planner.cluster import GpuGroup, GpuType, LinkSpec
    return GpuGroup(name, GpuType(f"G{tflops:g}", tflops, 16.0), 1, gpus, LinkSpec(200, 10),
                    LinkSpec(50, 20))


@pytest.mark.parametrize("speeds", [(20.0, 312.0), (125.0, 50.0)], ids=["slow-fast", "fast-slow"])
@pytest.mark.parametrize("widths", [(1, 1), (2, 1), (1, 2)], ids=["1+1", "2+1", "1+2"])
@pytest.mark.parametrize("gbps", [1.0, 100.0])
def test_half_plans_are_within_one_percent_of_exhaustive_search(speeds, widths, gbps):
    from hapt_hf.planner.cluster import GroupLink, LinkSpec
    from benchmarks.exhaustive import exhaustive_plan
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=1000,
                                   max_position_embeddings=256)
    model = ModelSpec.from_config(cfg, 128, "fp16")
    cluster = Cluster("c", (_group("a", speeds[0], widths[0]), _group("b", speeds[1], widths[1])),
                      (GroupLink("a", "b", LinkSpec(gbps, 100.0)),))
    best = exhaustive_plan(model.split_blocks(), cluster, 4)
    res = plan_job(model, cluster, 4, options=PlannerOptions(layer_unit="half"))
    assert res.sim.iteration_s <= best.sim.iteration_s * 1.01


def test_hand_edited_sequence_is_planned_as_it_is():
    spec = ModelSpec.from_name_or_path("gpt2-tiny", 32)
    edited = replace(spec, layers=spec.layers[:-1] + spec.layers[1:2] + (
        replace(spec.layers[-1], index=spec.num_layers),))
    assert not edited.can_split_blocks
    with pytest.raises(ModelSpecError, match="cannot be cut in two"):
        edited.split_blocks()
