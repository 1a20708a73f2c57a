"""Profiler: cache hits, sane figures, the link fit, and a planner that follows a slowed group."""
from __future__ import annotations

import json
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import GPT2Config

from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.profile import (LayerTiming, LinkMeasurement, Profile, ProfileKey,
                                     cluster_with_links)
from hapt_hf.profiling import (ProfilerError, ProfilerOptions, ProfileStore, cli_main, fit_link,
                               profile_model, profiler)

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64
# Small enough for seconds, large enough that a block's backward clearly outweighs its forward.
CONFIG = dict(n_embd=256, n_layer=6, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0,
              eos_token_id=0)
# The optimizer step is timed over copies of a layer filling profiler.UPDATE_WORKING_SET_BYTES
# (test_the_optimizer_step_is_timed_over_the_working_set_and_divided_back checks that); 256 MiB
# of a tiny layer's copies are tens of thousands of tensors, a minute of CPU a profile. These
# tests time it over 4 MiB, in this process and in the scripts they launch.
TEST_WORKING_SET = 4 << 20
SMALL_WORKING_SET = (f"import hapt_hf.profiling.profiler as _p; "
                     f"_p.UPDATE_WORKING_SET_BYTES = {TEST_WORKING_SET}")


@pytest.fixture(scope="module", autouse=True)
def _small_working_set():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler, "UPDATE_WORKING_SET_BYTES", TEST_WORKING_SET)
        yield
FAST = ProfilerOptions(micro_batches=(2, 8), warmup=1, repeats=5, min_window_s=0.02,
                       budget_s=0.3)


def _config() -> GPT2Config:
    return GPT2Config(**CONFIG)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, Profile]:
    store = tmp_path_factory.mktemp("profile") / "store.json"
    prof = profile_model(_config(), device_name="tb-a", seq_len=SEQ, options=FAST,
                         store=ProfileStore.open(store))
    return store, prof


def test_one_entry_per_distinct_layer_and_micro_batch(measured):
    _, prof = measured
    spec = ModelSpec.from_config(_config(), SEQ)
    signatures = {l.signature for l in spec.layers}
    assert len(signatures) == 3  # embedding, one shared block signature, head
    assert {(k.layer_signature, k.micro_batch) for k in prof.timings} == \
        {(s, b) for s in signatures for b in FAST.micro_batches}


def test_figures_in_a_sane_range(measured):
    _, prof = measured
    spec = ModelSpec.from_config(_config(), SEQ)
    block = next(l for l in spec.layers if l.kind == "block")
    for key, t in prof.timings.items():
        assert t.forward_s > 0 and t.backward_s > 0, key
        assert t.peak_memory_bytes > 0 and t.spread >= 0, key
        assert 0 < t.update_s < 10, key
    small = prof.timings[next(k for k in prof.timings
                              if k.layer_signature == block.signature and k.micro_batch == 2)]
    large = prof.timings[next(k for k in prof.timings
                              if k.layer_signature == block.signature and k.micro_batch == 8)]
    # the backward (about twice the forward's FLOPs) takes longer, over both sizes together: one
    # window preempted by a busy machine must not flip it, swapped phases would
    assert small.backward_s + large.backward_s > small.forward_s + large.forward_s
    assert large.forward_s + large.backward_s > small.forward_s + small.backward_s
    # activations kept grow with the micro-batch; per sample within 3x of ModelSpec's formula
    assert large.peak_memory_bytes > 3 * small.peak_memory_bytes
    # (the config's dropout is on: PyTorch's CPU masks are wider than the model's 1-byte ones)
    per_sample = small.peak_memory_bytes / 2
    assert block.act_keep_bytes / 3 < per_sample < 3 * block.act_keep_bytes
    assert 0 < small.kept_bytes < small.peak_memory_bytes  # the output is not saved


def test_second_profile_reads_the_store(measured, monkeypatch):
    store, first = measured
    saved = json.loads(store.read_text())
    assert len(saved["timings"]) == len(first.timings)
    calls = []
    monkeypatch.setattr(profiler, "time_layer", lambda *a, **k: calls.append(a) or None)
    again = profile_model(_config(), device_name="tb-a", seq_len=SEQ, options=FAST,
                          store=ProfileStore.open(store))
    assert calls == []
    assert again.timings == first.timings


def test_another_key_is_measured_not_reused(measured, monkeypatch):
    store, first = measured
    real, calls = profiler.time_layer, []

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(profiler, "time_layer", spy)
    opts = ProfilerOptions(micro_batches=(2, 4), warmup=1, repeats=1, min_window_s=0,
                           budget_s=0.1)
    prof = profile_model(_config(), device_name="tb-a", seq_len=SEQ, options=opts,
                         store=ProfileStore.open(store))
    assert len(calls) == 3  # micro-batch 4 of each of the 3 layer kinds; 2 came from the store
    assert {k.micro_batch for k in prof.timings} == {2, 4}


def test_link_fit_recovers_bandwidth_and_latency():
    sizes = [1 << 16, 1 << 20, 1 << 22, 1 << 24]
    seconds = [1e-3 + n * 8 / 1e9 for n in sizes]  # 1 Gbit/s, 1 ms
    bw, lat = fit_link(sizes, seconds)
    assert bw == pytest.approx(1.0, rel=1e-6)
    assert lat == pytest.approx(1000.0, rel=1e-6)
    with pytest.raises(ProfilerError, match="two distinct message sizes"):
        fit_link([10, 10], [1.0, 1.0])


def test_bad_input_is_one_clear_message(tmp_path, capsys):
    with pytest.raises(ProfilerError, match="micro_batches"):
        ProfilerOptions(micro_batches=(0, 2))
    rc = cli_main(["--model", "gpt2-tiny", "--seq-len", "16", "--micro-batches", "1,x",
                   "--device-name", "cpu", "--store", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--micro-batches" in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfilerError, match="delete it or pass another --store"):
        ProfileStore.open(bad)


def _slowdown_hook(factor: float) -> list:
    """The testbed's delay hook (benchmarks/testbed/site), installed in this process."""
    path = ROOT / "benchmarks/testbed/site/testbed_hooks.py"
    spec = importlib.util.spec_from_file_location("testbed_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.install_slowdown(factor)


def _blocks_on(plan, group: str) -> float:
    """Blocks the group's stages hold (a half block counts one half)."""
    per_block = 2 if plan.layer_unit == "half" else 1
    return sum(min(s.layers[1], plan.num_layers - 1) - max(s.layers[0], 1)
               for s in plan.stages if s.group == group) / per_block


def test_planner_fed_a_profile_follows_a_slowed_group(measured, tmp_path):
    search = pytest.importorskip("hapt_hf.planner.search",
                                 reason="the planner's search module is not importable yet")
    _, prof_a = measured
    handles = _slowdown_hook(3.0)
    try:
        # the layers' timings are what this test reads (the profiles below keep no overheads)
        slowed = profile_model(_config(), device_name="tb-b", seq_len=SEQ,
                               options=replace(FAST, step_overheads=False))
    finally:
        for h in handles:
            h.remove()
    # "alike": group b is the same machine as a, so it gets a's own measurements
    alike = Profile(dict(prof_a.timings))
    alike.timings.update({replace(k, device="tb-b"): t for k, t in prof_a.timings.items()})
    unlike = Profile(dict(prof_a.timings))
    unlike.timings.update(slowed.timings)
    assert {"tb-a", "tb-b"} <= unlike.devices()
    # both groups claim the same speed: only the profile can tell them apart
    cluster = Cluster.from_dict({
        "name": "two-cpu", "links": [{"between": ["a", "b"], "bandwidth_gbps": 10,
                                      "latency_us": 50}],
        "groups": [{"name": n, "gpu": f"tb-{n}", "tflops": 0.05, "memory_gb": 8, "nodes": 1,
                    "gpus_per_node": 1} for n in ("a", "b")]})
    spec = ModelSpec.from_config(_config(), SEQ)
    # the layer split is what follows the profile: pipelines of one group per stage only
    # (data parallelism over both, as the uneven candidate or the equal-share DDP baseline,
    # or a stage mixing them, would hold every layer on both)
    opts = search.PlannerOptions(schedule="1f1b", micro_batch_sizes=(2,), allow_uneven_dp=False,
                                 allow_mixed_stages=False, include_baselines=False)
    plans = {name: search.plan_job(spec, cluster, 8, profile=prof, options=opts).plan
             for name, prof in (("alike", alike), ("unlike", unlike))}
    assert [s.layers for s in plans["alike"].stages] != [s.layers for s in plans["unlike"].stages]
    assert _blocks_on(plans["unlike"], "b") < _blocks_on(plans["alike"], "b")
    assert _blocks_on(plans["unlike"], "b") < _blocks_on(plans["unlike"], "a")


def test_measured_links_replace_the_cluster_file_figures():
    cluster = Cluster.from_dict({
        "name": "two", "links": [{"between": ["a", "b"], "bandwidth_gbps": 10, "latency_us": 5}],
        "groups": [{"name": n, "gpu": "cpu", "nodes": 1, "gpus_per_node": 1} for n in "ab"]})
    prof = Profile(links=[LinkMeasurement("b", "a", 0.1, 900.0)])
    link = cluster_with_links(cluster, prof).link("a", "b")
    assert (link.bandwidth_gbps, link.latency_us) == (0.1, 900.0)


def test_a_groups_measured_allreduce_replaces_the_link_inside_it():
    # a group's link to itself is what its all-reduce was timed on: the intra-node link of a
    # group on one node, the inter-node link of one over several; other groups keep theirs
    cluster = Cluster.from_dict({
        "name": "two", "links": [{"between": ["a", "b"], "bandwidth_gbps": 10, "latency_us": 5}],
        "groups": [{"name": "a", "gpu": "cpu", "nodes": 1, "gpus_per_node": 2},
                   {"name": "b", "gpu": "cpu", "nodes": 2, "gpus_per_node": 2}]})
    prof = Profile(links=[LinkMeasurement("a", "a", 0.5, 300.0),
                          LinkMeasurement("b", "b", 0.25, 700.0)])
    out = {g.name: g for g in cluster_with_links(cluster, prof).groups}
    before = {g.name: g for g in cluster.groups}
    assert (out["a"].intra_node.bandwidth_gbps, out["a"].intra_node.latency_us) == (0.5, 300.0)
    assert out["a"].inter_node == before["a"].inter_node
    assert (out["b"].inter_node.bandwidth_gbps, out["b"].inter_node.latency_us) == (0.25, 700.0)
    assert out["b"].intra_node == before["b"].intra_node
    assert cluster_with_links(cluster, prof).link("a", "b") == cluster.link("a", "b")


LEADERS_SCRIPT = """
import json, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
""" + SMALL_WORKING_SET + """
from transformers import GPT2Config
from hapt_hf.profiling import ProfilerOptions, profile_group_leaders
dist.init_process_group("gloo")
config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=16,
                    bos_token_id=0, eos_token_id=0)
prof = profile_group_leaders(config, groups={"a": [0], "b": [1]},
                             device_names={"a": "cpu-a", "b": "cpu-b"}, seq_len=16,
                             options=ProfilerOptions(micro_batches=(1,), warmup=1, repeats=3,
                                                     min_window_s=0.01, budget_s=0.1),
                             link_sizes=(1 << 12, 1 << 14), busy_peers=True)
print(json.dumps({"devices": sorted(prof.devices()), "links": len(prof.links),
                  "overheads": sorted(d for d, o in prof.overheads.items() if o.split_measured),
                  "transfer": prof.links[0].overhead_us >= 0}))
"""


@pytest.mark.multiproc
def test_group_leaders_profile_with_busy_peers_and_all_get_the_merged_profile(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT))
    from benchmarks.testbed import Testbed, TestbedSpec
    script = tmp_path / "leaders.py"
    script.write_text(LEADERS_SCRIPT)
    spec = TestbedSpec.from_dict({"name": "leaders", "slowdown": "hook",
                                  "groups": [{"name": "a", "ranks": 1}, {"name": "b", "ranks": 1}]})
    with Testbed(spec) as tb:
        results = tb.run([sys.executable, str(script), str(ROOT)], timeout_s=180, cwd=ROOT)
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    outs = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
    # the leader done first kept computing until the other finished, then both timed the link
    # each device's step overheads and the link's per-transfer cost came with them
    assert outs == [{"devices": ["cpu-a", "cpu-b"], "links": 1,
                     "overheads": ["cpu-a", "cpu-b"], "transfer": True}] * 2


INSIDE_SCRIPT = """
import json, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
""" + SMALL_WORKING_SET + """
from transformers import GPT2Config
from hapt_hf.profiling import ProfilerOptions, profile_group_leaders
dist.init_process_group("gloo")
config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=8,
                    bos_token_id=0, eos_token_id=0)
prof = profile_group_leaders(config, groups={"a": [0, 1], "b": [2]},
                             device_names={"a": "cpu-a", "b": "cpu-b"}, seq_len=8,
                             options=ProfilerOptions(micro_batches=(1,), warmup=1, repeats=2,
                                                     min_window_s=0.005, budget_s=0.05),
                             link_sizes=(1 << 12, 1 << 14), allreduce_sizes=(1 << 16, 1 << 20))
links = sorted([m.a, m.b] for m in prof.links)
inside = next(m for m in prof.links if m.a == m.b)
print(json.dumps({"links": links, "inside": [inside.bandwidth_gbps, inside.latency_us,
                                             inside.overhead_us, inside.transfer_cpu_us]}))
"""


@pytest.mark.multiproc
def test_each_group_of_several_ranks_times_its_allreduce(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT))
    from benchmarks.testbed import Testbed, TestbedSpec
    script = tmp_path / "inside.py"
    script.write_text(INSIDE_SCRIPT)
    spec = TestbedSpec.from_dict({"name": "inside", "groups": [{"name": "a", "ranks": 2},
                                                               {"name": "b", "ranks": 1}]})
    with Testbed(spec) as tb:
        results = tb.run([sys.executable, str(script), str(ROOT)], timeout_s=180, cwd=ROOT)
    assert all(r.returncode == 0 for r in results), [r.output[-2000:] for r in results]
    outs = [json.loads(r.output.strip().splitlines()[-1]) for r in results]
    # every rank gets the link between the groups and the one inside 'a' (b has one rank),
    # the same figures everywhere
    assert [o["links"] for o in outs] == [[["a", "a"], ["a", "b"]]] * 3
    assert outs[0]["inside"] == outs[1]["inside"] == outs[2]["inside"]
    assert outs[0]["inside"][0] > 0 and outs[0]["inside"][1] >= 0
    assert outs[0]["inside"][2] >= 0  # a transfer's cost beyond the fit, between a's two ranks
    assert outs[0]["inside"][3] > 0  # the post of a send or a receive on a's first rank


@pytest.mark.parametrize("width", [2, 3, 8])
def test_the_allreduce_fit_recovers_the_link_the_cost_model_prices(monkeypatch, width):
    # an all-reduce that takes exactly what the cost model's ring formula
    # (CostModel.allreduce_s) says for a link of 4 Gbit/s and 30 us: the fit gives that link
    # back, so the planner prices what was timed
    import torch.distributed as dist

    from hapt_hf.profiling import links
    clock = [0.0]
    bw, lat = 4.0, 30.0

    def all_reduce(buf, group=None):
        nbytes = buf.numel() * 4
        clock[0] += 2 * (width - 1) / width * nbytes * 8 / (bw * 1e9) + \
            2 * (width - 1) * lat * 1e-6

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(links.time, "perf_counter", lambda: clock[0])
    m = links.measure_group_allreduce("g", None, width, sizes_bytes=(1 << 16, 1 << 20, 1 << 22))
    assert (m.a, m.b) == ("g", "g")
    assert m.bandwidth_gbps == pytest.approx(bw, rel=1e-6)
    assert m.latency_us == pytest.approx(lat, rel=1e-6)


def test_profile_runs_the_jobs_precision_and_attention(tmp_path):
    # bf16 under autocast with eager attention: the block gets the eager signature, and the
    # bytes autograd kept match the planner's figure for that precision and attention
    cfg = GPT2Config(**{**CONFIG, "n_layer": 2, "attn_pdrop": 0.0, "resid_pdrop": 0.0,
                        "embd_pdrop": 0.0})
    opts = replace(FAST, micro_batches=(2,), attn_implementation="eager")
    store = ProfileStore.open(tmp_path / "s.json")
    prof = profile_model(cfg, device_name="tb-a", seq_len=SEQ, dtype="bf16", options=opts,
                         store=store)
    spec = ModelSpec.from_config(cfg, SEQ, "bf16", attn_implementation="eager")
    for layer in spec.layers[:2] + spec.layers[-1:]:
        t = prof.timings[ProfileKey("tb-a", layer.signature, 2, SEQ, "bf16")]
        planned = 2 * layer.act_keep_bytes + layer.act_keep_fixed_bytes
        assert t.kept_bytes == pytest.approx(planned, rel=0.10), layer.kind
    assert spec.layers[1].signature.endswith(":eager")
    assert Profile.load(tmp_path / "s.json").timings == prof.timings  # kept_bytes stored too
    with pytest.raises(ProfilerError, match="attn_implementation 'flash'"):
        ProfilerOptions(attn_implementation="flash")


def test_store_write_is_atomic(tmp_path, monkeypatch):
    # a failing write leaves the previous store whole and no temporary file behind
    path = tmp_path / "s.json"
    store = ProfileStore(path)
    store.put(ProfileKey("d", "sig", 1, 8, "fp32"), LayerTiming(1.0, 2.0))
    store.save()
    before = path.read_text()
    store.put(ProfileKey("d", "sig", 2, 8, "fp32"), LayerTiming(2.0, 4.0))

    def torn(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", torn)
    with pytest.raises(OSError, match="disk full"):
        store.save()
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


class _FixedClock:
    """Runs what it times, and says every call took 6 s."""

    def measure(self, fn):
        return 6.0, fn()


@pytest.mark.parametrize("working_set,copies", [(10_000, 6), (100, 1)])
def test_the_optimizer_step_is_timed_over_the_working_set_and_divided_back(
        monkeypatch, working_set, copies):
    """A layer's Adam state alone sits in the cache; the step is timed over copies of it
    reaching the working set (110 parameters x 16 bytes = 1760 B a copy), then divided."""
    import torch

    from hapt_hf.profiling import profiler
    monkeypatch.setattr(profiler, "UPDATE_WORKING_SET_BYTES", working_set)
    seen = []

    class Counting(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            seen.append(len(params))
            super().__init__(params, **kw)
    monkeypatch.setattr(torch.optim, "AdamW", Counting)
    layer = torch.nn.Linear(10, 10)
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    w0 = layer.weight.detach().clone()
    assert profiler._update_s(layer, _FixedClock()) == pytest.approx(6.0 / copies)
    assert seen == [2 * copies]  # the layer's weight and bias, copies times
    assert all(p.grad is None for p in layer.parameters())
    # copies step on clones; a layer as large as the working set steps on itself
    assert torch.equal(layer.weight.detach(), w0) == (copies > 1)


def test_a_groups_ranks_pool_their_measurements_by_median():
    from hapt_hf.profiling.profiler import pool_timings
    blk = ProfileKey("cpu-fast", "gpt2:b", 2, 64, "fp32")
    head = ProfileKey("cpu-fast", "gpt2:h", 2, 64, "fp32")
    lead = {blk: LayerTiming(1.0, 2.0, 0.5, peak_memory_bytes=7.0, kept_bytes=3.0),
            head: LayerTiming(4.0, 8.0)}
    peers = [{blk: LayerTiming(3.0, 6.0, 0.1, peak_memory_bytes=9.0)},
             {blk: LayerTiming(2.0, 2.5, 0.3)}]
    pooled = pool_timings([lead, *peers])
    assert pooled[blk] == LayerTiming(2.0, 2.5, 0.3, peak_memory_bytes=7.0, kept_bytes=3.0)
    assert pooled[head] == lead[head]  # measured by one rank only
    assert pool_timings([lead, {}]) == lead


def test_profiler_options_leave_the_attention_to_the_model():
    """Without an attention given, the profiler times the model's best: sdpa where the model
    supports it, eager for gemma2 (whose class does not), as the planner and runtime choose."""
    from transformers import Gemma2Config, LlamaConfig

    from hapt_hf.profiling.profiler import with_attention
    from hapt_hf.profiling.store import ProfilerOptions

    assert ProfilerOptions().attn_implementation is None
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=64, head_dim=16)
    assert with_attention(ProfilerOptions(), Gemma2Config(**small)).attn_implementation == "eager"
    assert with_attention(ProfilerOptions(), LlamaConfig(**small)).attn_implementation == "sdpa"
    given = ProfilerOptions(attn_implementation="eager")
    assert with_attention(given, LlamaConfig(**small)) is given
