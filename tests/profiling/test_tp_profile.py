"""The profiler's tensor-parallel figures: a block's compute split per degree (shapes, numerics of
the shards, one entry per degree and micro-batch, stored and read back) and the all-reduce of a
block's activation inside a group (the ring fit, the store, the planner's reading of it)."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.cost_model import CostModel
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.profile import LinkMeasurement, Profile, ProfileKey, cluster_with_links
from hapt_hf.profiling import ProfilerError, ProfilerOptions, ProfileStore, cli_main, links
from hapt_hf.profiling import profiler as profiler_module
from hapt_hf.profiling.model_figures import model_spec
from hapt_hf.profiling.profiler import build_layer, profile_model
from hapt_hf.profiling.tp_split import split_block, tp_degrees

SEQ = 16
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64, head_dim=16)
FAST = ProfilerOptions(micro_batches=(1, 2), warmup=1, repeats=3, min_window_s=0.005,
                       budget_s=0.05, attn_implementation="sdpa", tp_degrees=(2,))


def _block(config):
    spec = model_spec(config, SEQ, attn_implementation="sdpa")
    layer = next(l for l in spec.layers if l.kind == "block")
    return build_layer(config, layer, "cpu", FAST)


def _shapes(stage) -> dict[str, tuple[int, ...]]:
    return {n.split("layers.0.")[1]: tuple(p.shape) for n, p in stage.named_parameters()}


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen3Config])
def test_the_split_block_holds_one_rank_of_heads_kv_heads_and_mlp_width(config_class):
    config = config_class(**SIZES)
    whole = _shapes(_block(config))
    split = _shapes(split_block(_block(config), config, 2))
    # colwise: output features (heads/2 x 16, kv heads/2 x 16, width/2); rowwise: input ones
    assert split["self_attn.q_proj.weight"] == (32, 64)
    assert split["self_attn.k_proj.weight"] == split["self_attn.v_proj.weight"] == (16, 64)
    assert split["self_attn.o_proj.weight"] == (64, 32)
    assert split["mlp.gate_proj.weight"] == split["mlp.up_proj.weight"] == (64, 64)
    assert split["mlp.down_proj.weight"] == (64, 64)
    # norms (and Qwen3's per-head q/k norms) stay whole
    assert {n: s for n, s in split.items() if "norm" in n} == \
        {n: s for n, s in whole.items() if "norm" in n}
    assert split_block(_block(config), config, 1) is not None
    assert _shapes(split_block(_block(config), config, 1)) == whole


def test_the_shards_of_a_split_block_add_up_to_the_whole_block():
    # Qwen2: biased q/k/v (colwise, cut with their rows). Each rank's attention and MLP give a
    # partial sum; over the ranks they are the whole block's, as the all-reduce makes them.
    config = Qwen2Config(**SIZES)
    whole = _block(config)
    ranks = [split_block(_block(config), config, 2, rank=j) for j in range(2)]
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).unsqueeze(0)
    rope = whole.model.rotary_emb(x, pos)

    def attention(stage):
        return stage.model.layers["0"].self_attn(x, position_embeddings=rope,
                                                 attention_mask=None)[0]

    def mlp(stage):
        return stage.model.layers["0"].mlp(x)

    with torch.no_grad():
        for part in (attention, mlp):
            torch.testing.assert_close(sum(part(r) for r in ranks), part(whole),
                                       rtol=1e-5, atol=1e-6)
            assert not torch.allclose(part(ranks[0]), part(whole), atol=1e-3)


def test_degrees_the_model_refuses_are_left_out_saying_why():
    config = LlamaConfig(**SIZES)
    kept, why = tp_degrees(config, (2, 4, 8))
    assert kept == (2,)
    assert len(why) == 2 and "key/value heads 2" in why[0] and "attention heads 4" in why[1]
    assert tp_degrees(config, (1, 4, 4)) == ((), [
        "tensor-parallel degree 4 does not divide the model's key/value heads 2; use a degree "
        "that divides the attention heads, the key/value heads and the MLP width"])
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    kept, why = tp_degrees(gpt2, (2,))
    assert kept == () and "no tensor-parallel plan" in why[0]
    with pytest.raises(ProfilerError, match="key/value heads 2"):
        split_block(_block(config), config, 4)
    with pytest.raises(ProfilerError, match="TP rank 2"):
        split_block(_block(config), config, 2, rank=2)


def test_each_degree_and_micro_batch_is_timed_stored_and_read_back(tmp_path, monkeypatch):
    config = LlamaConfig(**SIZES)
    path = tmp_path / "store.json"
    lines: list[str] = []
    prof = profile_model(config, device_name="cpu-t", seq_len=SEQ, options=FAST,
                         store=ProfileStore.open(path), log=lines.append)
    block = next(l for l in ModelSpec.from_config(config, SEQ).layers if l.kind == "block")
    split = {k: t for k, t in prof.timings.items() if k.tp > 1}
    assert set(split) == {ProfileKey("cpu-t", block.signature, mb, SEQ, "fp32", 2)
                          for mb in (1, 2)}
    for key, t in split.items():
        assert t.forward_s > 0 and t.backward_s > 0 and t.update_s > 0
        assert not t.tp_comm_included  # one rank's compute: the all-reduces are priced apart
        assert prof.timings[ProfileKey("cpu-t", block.signature, key.micro_batch, SEQ, "fp32")]
    assert sum("block/tp2" in line for line in lines) == 2
    # only blocks are split; the store file holds every entry and the planner reads it
    assert {k.tp for k in prof.timings if k.layer_signature != block.signature} == {1}
    loaded = Profile.load(path)
    assert loaded.timings == prof.timings
    assert loaded.lookup("cpu-t", block.signature, 2, SEQ, "fp32", tp=2) == \
        split[ProfileKey("cpu-t", block.signature, 2, SEQ, "fp32", 2)]
    # a second profile reads every entry, the splits too, from the store
    monkeypatch.setattr(profiler_module, "time_layer", lambda *a, **k: pytest.fail("timed"))
    again = profile_model(config, device_name="cpu-t", seq_len=SEQ, options=FAST,
                          store=ProfileStore.open(path))
    assert again.timings == prof.timings


@pytest.mark.parametrize("t", [2, 4, 8])
def test_the_tp_allreduce_fit_recovers_the_link_and_is_stored(monkeypatch, tmp_path, t):
    # an all-reduce that takes what the ring formula gives for 40 Gbit/s and 12 us per hop:
    # the fit gives that link back, marked with its degree
    import torch.distributed as dist
    clock = [0.0]
    bw, lat = 40.0, 12.0

    def ring_s(nbytes: float) -> float:
        return 2 * (t - 1) / t * nbytes * 8 / (bw * 1e9) + 2 * (t - 1) * lat * 1e-6

    def all_reduce(buf, group=None):
        clock[0] += ring_s(buf.numel() * buf.element_size())

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(links.time, "perf_counter", lambda: clock[0])
    sizes = links.activation_sizes(64, SEQ, "bf16", (1, 2))
    assert sizes == (1 * SEQ * 64 * 2, 2 * SEQ * 64 * 2, 8 * SEQ * 64 * 2)
    m = links.measure_tp_allreduce("g", None, t, sizes, "bf16")
    assert (m.a, m.b, m.tp) == ("g", "g", t)
    assert m.bandwidth_gbps == pytest.approx(bw, rel=1e-6)
    assert m.latency_us == pytest.approx(lat, rel=1e-6)
    store = ProfileStore.open(tmp_path / "store.json")
    store.put_link(LinkMeasurement("g", "g", 99.0, 1.0))  # the gradient all-reduce's
    store.put_link(m)
    store.save()
    back = Profile.load(tmp_path / "store.json")
    assert back.tp_link("g", t) == m and back.tp_link("g", 2 * t) is None
    assert ProfileStore.open(tmp_path / "store.json").tp_links == {("g", t): m}
    # the group's inside link stays the gradient all-reduce's measurement
    cluster = Cluster.from_dict({"name": "one", "groups": [
        {"name": "g", "gpu": "cpu", "nodes": 1, "gpus_per_node": 8}]})
    inside = cluster_with_links(cluster, back).groups[0].intra_node
    assert (inside.bandwidth_gbps, inside.latency_us) == (99.0, 1.0)
    # the planner prices a t-way block's two all-reduces of 2 samples' activation at the time
    # the all-reduce took here
    spec = ModelSpec.from_config(LlamaConfig(**SIZES), SEQ, "bf16")
    cost = CostModel(spec, cluster_with_links(cluster, back), back)
    block = next(l for l in spec.layers if l.kind == "block")
    assert cost.tp_allreduce_s(cost.group("g"), 2, t, block.index) == \
        pytest.approx(2 * ring_s(2 * SEQ * 64 * 2), rel=1e-9)


def test_profile_prints_the_tensor_parallel_figures(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(LlamaConfig(**SIZES).to_json_string())
    store = tmp_path / "store.json"
    ProfileStore(store, links={}, tp_links={("g", 2): LinkMeasurement("g", "g", 3.5, 20.0, 2)}
                 ).save()
    rc = cli_main(["--model", str(config), "--seq-len", str(SEQ), "--micro-batches", "1",
                   "--device-name", "cpu-t", "--store", str(store), "--device", "cpu",
                   "--repeats", "1", "--budget-s", "0.05", "--tp-degrees", "2,4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tensor-parallel split not timed: tensor-parallel degree 4" in out
    assert "tensor-parallel figures:" in out
    assert "mb=1 tp=2: fwd+bwd" in out and "(2 for an even split)" in out
    assert "all-reduce inside g, tp=2: 3.50 Gbit/s, 20.0 us per hop" in out
    assert len([k for k in Profile.load(store).timings if k.tp == 2]) == 1


def _leaders_with_tp(rank: int, world_size: int, store: str) -> dict:
    from hapt_hf.profiling import profile_group_leaders
    options = ProfilerOptions(micro_batches=(1,), warmup=1, repeats=2, min_window_s=0.002,
                              budget_s=0.02, attn_implementation="sdpa", tp_degrees=(2, 4))
    prof = profile_group_leaders(LlamaConfig(**SIZES), groups={"a": [0, 1]},
                                 device_names={"a": "cpu-a"}, seq_len=SEQ, options=options,
                                 store_path=store, allreduce_sizes=(1 << 12, 1 << 14))
    tp = prof.tp_link("a", 2)
    return {"tp_keys": sorted((k.tp, k.micro_batch) for k in prof.timings
                              if k.layer_signature.startswith("llama:")),
            "links": sorted((m.a, m.b, m.tp) for m in prof.links),
            "tp_link": None if tp is None else (tp.bandwidth_gbps, tp.latency_us)}


@pytest.mark.multiproc
def test_group_leaders_time_the_split_and_the_tp_allreduce_inside_the_group(tmp_path):
    from benchmarks.ranks import run_ranks
    store = tmp_path / "store.json"
    outs = [o.value for o in run_ranks(_leaders_with_tp, 2, str(store), timeout_s=240)]
    # the leader timed the whole block and its 2-way split (4 ways needs more ranks than the
    # group has); both ranks timed the all-reduce among the pair, as a gradient bucket and as
    # a block's activation; every rank gets the same figures and rank 0 stored them
    assert outs[0] == outs[1]
    assert outs[0]["tp_keys"] == [(1, 1), (2, 1)]
    assert outs[0]["links"] == [("a", "a", 1), ("a", "a", 2)]
    bw, lat = outs[0]["tp_link"]
    assert bw > 0 and lat >= 0
    saved = Profile.load(store)
    assert saved.tp_link("a", 2).bandwidth_gbps == bw
    assert {k.tp for k in saved.timings} == {1, 2}
