"""Profile lookup (exact, interpolated, extrapolated), JSON round trip, merge, Sailor data."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.profile import (LayerTiming, LinkMeasurement, Profile, ProfileError,
                                     ProfileKey, load_sailor_profiles)

from benchmarks.inputs import SAILOR_PROFILES_DIR

SAILOR = SAILOR_PROFILES_DIR
OPT350 = dict(profile_name="OPT-350", family="opt", hidden_size=1024, num_layers=24,
              num_heads=16, vocab_size=50272)


def _key(mb, device="A100-40", sig="blk"):
    return ProfileKey(device, sig, mb, 1024, "fp16")


def _profile(points):
    return Profile({_key(mb): LayerTiming(f, b, u, m) for mb, (f, b, u, m) in points.items()})


def test_exact_and_interpolated():
    p = _profile({2: (1.0, 2.0, 0.5, 100.0), 4: (3.0, 6.0, 0.5, 300.0)})
    assert p.lookup("A100-40", "blk", 2, 1024, "fp16") == LayerTiming(1.0, 2.0, 0.5, 100.0)
    mid = p.lookup("A100-40", "blk", 3, 1024, "fp16")
    assert (mid.forward_s, mid.backward_s, mid.update_s, mid.peak_memory_bytes) == \
        (2.0, 4.0, 0.5, 200.0)


def test_extrapolated_both_ways():
    p = _profile({2: (1.0, 2.0, 0.5, 0.0), 4: (1.5, 3.0, 0.5, 0.0)})
    above = p.lookup("A100-40", "blk", 8, 1024, "fp16")
    assert above.forward_s == pytest.approx(2.5) and above.backward_s == pytest.approx(5.0)
    # a line through (2, 1.0) and (4, 1.5) gives 0.75 at 1; a sample's share of mb=2 is 0.5
    below = p.lookup("A100-40", "blk", 1, 1024, "fp16")
    assert below.forward_s == pytest.approx(0.75)
    steep = _profile({2: (1.0, 1.0, 0.0, 0.0), 4: (4.0, 4.0, 0.0, 0.0)})
    floor = steep.lookup("A100-40", "blk", 1, 1024, "fp16")
    assert floor.forward_s == pytest.approx(0.5)  # the line would reach -0.5


def test_single_point_scales_proportionally():
    p = _profile({4: (2.0, 4.0, 0.25, 0.0)})
    t = p.lookup("A100-40", "blk", 6, 1024, "fp16")
    assert (t.forward_s, t.backward_s, t.update_s) == (3.0, 6.0, 0.25)


def test_no_entry_for_other_device_signature_seq_or_dtype():
    p = _profile({2: (1.0, 2.0, 0.0, 0.0)})
    assert p.lookup("V100-16", "blk", 2, 1024, "fp16") is None
    assert p.lookup("A100-40", "other", 2, 1024, "fp16") is None
    assert p.lookup("A100-40", "blk", 2, 2048, "fp16") is None
    assert p.lookup("A100-40", "blk", 2, 1024, "bf16") is None


def test_lookup_by_catalogue_name_finds_profile_name():
    p = Profile({_key(1, device="GH-96"): LayerTiming(1.0, 2.0)})
    assert p.lookup("GH200", "blk", 1, 1024, "fp16") == LayerTiming(1.0, 2.0)
    assert p.micro_batches("GH200") == p.micro_batches("GH-96") == [1]


def test_json_round_trip(tmp_path):
    p = Profile({_key(1): LayerTiming(1e-3, 2e-3, 1e-4, 5e8, 0.02),
                 _key(2, device="cpu-slow"): LayerTiming(0.5, 1.0)},
                [LinkMeasurement("fast", "slow", 0.8, 510.0)], source="unit test")
    path = tmp_path / "profile.json"
    p.save(path)
    assert Profile.load(path) == p
    assert json.loads(path.read_text())["timings"][0]["device"] == "A100-40"  # readable records


def test_merge_prefers_other():
    a = Profile({_key(1): LayerTiming(1.0, 2.0), _key(2): LayerTiming(2.0, 4.0)},
                [LinkMeasurement("x", "y", 1.0, 1.0)], "a")
    b = Profile({_key(2): LayerTiming(1.5, 3.0)}, [LinkMeasurement("x", "y", 2.0, 1.0)], "b")
    m = a.merge(b)
    assert m.timings == {_key(1): LayerTiming(1.0, 2.0), _key(2): LayerTiming(1.5, 3.0)}
    assert m.links == [LinkMeasurement("x", "y", 2.0, 1.0)] and m.source == "a + b"
    assert a.timings[_key(2)] == LayerTiming(2.0, 4.0)  # inputs untouched


@pytest.mark.parametrize("d, match", [
    ({"timings": [{"device": "x"}]}, r"timings\[0\] is missing"),
    ({"timings": [], "version": 9}, "version 9"),
    ({"links": []}, "timings"),
])
def test_bad_profile_dict(d, match):
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(d)


def test_sailor_opt350_figures_as_in_file():
    model = ModelSpec.from_job_dict(OPT350, 2048, "fp16")
    prof = load_sailor_profiles(SAILOR, model)
    raw = json.loads((SAILOR / "layer_times.json").read_text())["OPT-350"]
    assert {"A100-40", "V100-16", "GH-96"} <= prof.devices()
    embed, block, head = model.layers[0], model.layers[1], model.layers[-1]
    for gpu in ("A100-40", "V100-16", "GH-96"):
        for mb, by_tp in raw[gpu].items():
            if "1" not in by_tp:
                assert int(mb) not in prof.micro_batches(gpu)
                continue
            layers = by_tp["1"]

            def get(layer, gpu=gpu, mb=mb):
                return prof.lookup(gpu, layer.signature, int(mb), 2048, "fp16")
            assert get(embed) == LayerTiming(*layers["0"])
            assert get(head) == LayerTiming(*layers["25"])
            blocks = [layers[str(i)] for i in range(1, 25)]
            mean = [sum(b[j] for b in blocks) / 24 for j in range(3)]
            assert (get(block).forward_s, get(block).backward_s, get(block).update_s) == \
                pytest.approx(mean)
    assert raw["A100-40"]["1"]["1"]["0"] == [0.0004, 3e-06, 0.002938]
    # the built-in opt-350m is the same layer sequence, known to the data as OPT-350
    builtin = ModelSpec.from_name_or_path("facebook/opt-350m", 2048, "fp16")
    assert load_sailor_profiles(SAILOR, builtin).timings == prof.timings


def test_sailor_layer_count_mismatch():
    model = ModelSpec.from_job_dict(dict(OPT350, num_layers=23), 2048, "fp16")
    with pytest.raises(ProfileError, match="26 layers.*model has 25"):
        load_sailor_profiles(SAILOR, model)


def test_sailor_wrong_model_or_seq_len():
    gpt = ModelSpec.from_name_or_path("gpt2", 1024)
    with pytest.raises(ProfileError, match="no model 'gpt2'.*OPT-350"):
        load_sailor_profiles(SAILOR, gpt)
    short = ModelSpec.from_job_dict(OPT350, 1024, "fp16")
    with pytest.raises(ProfileError, match="sequence length 2048"):
        load_sailor_profiles(SAILOR, short)


def test_sailor_missing_directory(tmp_path):
    model = ModelSpec.from_name_or_path("opt-tiny", 64)
    with pytest.raises(ProfileError, match="layer_times.json"):
        load_sailor_profiles(tmp_path, model)


_times = st.floats(1e-6, 10.0)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(1, 64), st.tuples(_times, _times), min_size=2, max_size=5),
       st.integers(1, 128))
def test_lookup_between_measured_sizes_stays_between_them(points, mb):
    p = Profile({_key(m): LayerTiming(f, b) for m, (f, b) in points.items()})
    t = p.lookup("A100-40", "blk", mb, 1024, "fp16")
    sizes = sorted(points)
    assert t.forward_s >= 0 and t.backward_s >= 0
    if mb in points:
        assert (t.forward_s, t.backward_s) == points[mb]
    elif sizes[0] < mb < sizes[-1]:
        lo = max(m for m in sizes if m < mb)
        hi = min(m for m in sizes if m > mb)
        for j, got in enumerate((t.forward_s, t.backward_s)):
            a, b = points[lo][j], points[hi][j]
            assert min(a, b) - 1e-12 <= got <= max(a, b) + 1e-12
