"""The step overheads' fits recover what synthetic timings hold; the profile keeps them."""
from __future__ import annotations

import pytest

from hapt_hf.errors import ProfileError
from hapt_hf.planner.profile import LayerTiming, LinkMeasurement, Profile, ProfileKey, StepOverheads
from hapt_hf.profiling import overheads
from hapt_hf.profiling.overheads import (fit_action_overhead, pool_overheads, split_ratios,
                                         transfer_overhead_us)
from hapt_hf.profiling.store import ProfilerError, ProfileStore


def test_the_action_overhead_is_the_intercept_over_micro_batch_sizes():
    # each action takes its layers' time, plus 3 ms whatever its size, plus 0.5 ms a sample
    sizes = [1, 1, 2, 2, 4, 4]
    priced = [0.010, 0.020, 0.018, 0.036, 0.035, 0.070]
    measured = [p + 0.003 + 0.0005 * s for p, s in zip(priced, sizes)]
    assert fit_action_overhead(sizes, measured, priced) == pytest.approx(0.003)
    # one size: the median difference, one stretched round left out; below 0 kept as it is
    assert fit_action_overhead([2, 2, 2], [0.010, 0.030, 0.090], [0.012, 0.032, 0.030]) == \
        pytest.approx(-0.002)
    # differences that scatter around 0 more than their median stands out: noise, none
    noisy = [0.004, -0.006, 0.001, -0.003, 0.005, -0.002, 0.007, -0.005]
    assert fit_action_overhead([1] * 8, [0.02 + d for d in noisy], [0.02] * 8) == 0.0
    assert fit_action_overhead([1] * 8, [0.025 + d for d in noisy], [0.02] * 8) == \
        pytest.approx(0.0045)
    with pytest.raises(ProfilerError, match="one size, measured and priced"):
        fit_action_overhead([1, 2], [0.1], [0.1, 0.2])


def test_the_split_ratios_are_the_medians_over_the_fused_backward():
    fused = [0.010, 0.011, 0.012]
    assert split_ratios(fused, [0.007, 0.0077, 0.0084], [0.006, 0.0066, 0.0072]) == \
        (pytest.approx(0.7), pytest.approx(0.6))
    with pytest.raises(ProfilerError, match="> 0"):
        split_ratios([0.0], [1.0], [1.0])


def test_the_transfer_overhead_is_what_the_link_fit_leaves_out():
    # 1 Gbit/s and 40 us fitted; a 4-byte send took 40 us + 32 ns + 250 us
    one_way = [40e-6 + 32e-9 + 250e-6] * 5
    assert transfer_overhead_us(4, one_way, 1.0, 40.0) == pytest.approx(250.0)
    assert transfer_overhead_us(4, [10e-6], 1.0, 40.0) == 0.0  # faster than the fit: none


def test_the_ranks_of_a_device_pool_their_overheads_by_median():
    got = pool_overheads([{"x": StepOverheads(0.001, 0.6, 0.7, -1e-3)},
                          {"x": StepOverheads(0.003, 0.8, 0.9, -3e-3)},
                          {"x": StepOverheads(0.002, 0.7, 0.8, -2e-3),
                           "y": StepOverheads(0.0, 0.5, 0.5)}])
    assert got == {"x": StepOverheads(0.002, 0.7, 0.8, -2e-3), "y": StepOverheads(0.0, 0.5, 0.5)}


def test_measure_step_overheads_fits_the_action_and_the_further_layer(monkeypatch):
    # a block: 2 ms a sample forward, 4 ms backward, timed bare; as an action 1.5 ms more
    # whatever its size; each further layer of a stage 0.5 ms less than timed alone; the split
    # I 0.7 and W 0.6 of the stage's B
    def one_round(stage, x0, grad, dtype, split=True, bare=False):
        mb = x0.shape[0]
        f, b = 0.002 * mb, 0.004 * mb
        if bare:
            return f, b, 0.0, 0.0
        if stage == "one":
            return f + 0.0015, b + 0.0015, 0.0, 0.0
        k = overheads.STAGE_BLOCKS
        f2, b2 = k * f + 0.0015 - 0.0005 * (k - 1), k * b + 0.0015 - 0.0005 * (k - 1)
        return f2, b2, 0.7 * b2, 0.6 * b2

    monkeypatch.setattr(overheads, "_one_round", one_round)
    monkeypatch.setattr(overheads, "_stage_of_blocks",
                        lambda config, blocks, *a: "one" if blocks == 1 else "stage")
    from transformers import GPT2Config
    got = overheads.measure_step_overheads(GPT2Config(n_embd=8), (1, 2, 4), 4, "fp32", "cpu",
                                           "eager", repeats=3)
    assert got.action_s == pytest.approx(0.0015)
    assert got.layer_s == pytest.approx(-0.0005)
    assert (got.input_grad_ratio, got.weight_grad_ratio) == (pytest.approx(0.7),
                                                             pytest.approx(0.6))


def test_the_profile_keeps_the_overheads_and_old_profiles_load_without(tmp_path):
    prof = Profile(links=[LinkMeasurement("a", "b", 0.01, 40000.0, overhead_us=300.0),
                          LinkMeasurement("a", "a", 2.0, 50.0, transfer_cpu_us=120.0)],
                   overheads={"cpu-a": StepOverheads(0.001, 0.7, 0.6)})
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back.overheads == prof.overheads and back.links == prof.links
    assert back.step_overheads("cpu-a") == StepOverheads(0.001, 0.7, 0.6)
    assert back.step_overheads("cpu-b") is None
    assert back.transfer_overhead_s("b", "a") == pytest.approx(300e-6)
    assert back.transfer_overhead_s("a", "a") == 0.0
    assert back.transfer_cpu_s("a") == pytest.approx(120e-6) and back.transfer_cpu_s("b") == 0.0
    store = ProfileStore.open(path)  # the store reads and writes the same figures
    assert store.to_profile().overheads == prof.overheads
    # a profile written before the overheads were measured: none, and links without them
    old = Profile.from_dict({"timings": [], "links": [{"a": "a", "b": "b", "bandwidth_gbps": 1,
                                                        "latency_us": 5}]})
    assert old.overheads == {} and old.links[0].overhead_us == old.links[0].transfer_cpu_us == 0.0
    assert "overheads" not in old.to_dict() and "overhead_us" not in old.to_dict()["links"][0]
    assert "transfer_cpu_us" not in old.to_dict()["links"][0]
    with pytest.raises(ProfileError, match="unknown fields"):
        Profile.from_dict({"timings": [], "overheads": {"x": {"action": 1}}})
    with pytest.raises(ProfileError, match="split ratios"):
        Profile.from_dict({"timings": [], "overheads": {"x": {"input_grad_ratio": -1}}})


def test_a_transfers_cost_to_the_compute_is_the_work_with_it_less_the_work_alone(monkeypatch):
    # the fixed work takes 10 ticks alone and 13 with a transfer in flight (its post and the
    # backend's threads on the rank's cores); the wait after it is not counted
    import torch.distributed as dist

    from hapt_hf.profiling import overheads
    clock, inflight = [0.0], [False]

    class Work:
        def wait(self):
            clock[0] += 50.0
            inflight[0] = False

    def post(*_args):
        inflight[0] = True
        return Work()

    def work():
        clock[0] += 13.0 if inflight[0] else 10.0
    monkeypatch.setattr(overheads.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(overheads, "_fixed_work", lambda: work)
    for name in ("isend", "irecv"):
        monkeypatch.setattr(dist, name, post)
    monkeypatch.setattr(dist, "send", lambda *a: None)
    monkeypatch.setattr(dist, "recv", lambda *a: None)
    assert overheads.time_transfer_cpu(1, True, repeats=5) == 3.0
    assert overheads.time_transfer_cpu(0, False, repeats=5) == 3.0


def test_a_device_timed_again_while_the_others_finish_is_priced_over_the_whole_profile():
    # its own profile: 10 s, the block at 20 ms f+b; then 30 s of windows at 30 ms (2 ranks,
    # 60 s of windows together): a time-weighted speed of (10 + 30 x 1.5) / 40 = 1.375 x the
    # profiled one, on every entry of the device and none of another
    from hapt_hf.profiling.profiler import over_the_profile
    block = ProfileKey("cpu-a", "blk", 1, 64, "fp32")
    other = ProfileKey("cpu-b", "blk", 1, 64, "fp32")
    head = ProfileKey("cpu-a", "head", 1, 64, "fp32")
    timings = {block: LayerTiming(0.008, 0.012, 0.004), head: LayerTiming(0.002, 0.002),
               other: LayerTiming(0.05, 0.05)}
    windows = [(0.012, 0.018)] * 2000
    got = over_the_profile(timings, "cpu-a", block, windows, 10.0, ranks=2)
    assert got[block].forward_s == pytest.approx(0.008 * 1.375)
    assert got[block].backward_s == pytest.approx(0.012 * 1.375)
    assert got[block].update_s == pytest.approx(0.004 * 1.375)
    assert got[head].forward_s == pytest.approx(0.002 * 1.375)
    assert got[other] == timings[other]
    assert over_the_profile(timings, "cpu-a", block, [], 10.0) == timings
