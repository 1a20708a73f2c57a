"""The end-to-end race's own logic, without processes: the uniform splits its torch contenders
run, the ranks a chosen plan keeps, and what the last line reports."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.e2e import (CONTENDERS, RaceConfig, interleaves, kept_ranks, summarize,
                            uniform_plan)
from hapt_hf.core.schedules import default_warmups
from hapt_hf.pipeline.torch_pipelining import torch_supports


def test_uniform_split_and_its_interleaved_chunks_run_under_torch():
    cfg = RaceConfig()
    one = uniform_plan(cfg)
    assert [s.layers for s in one.stages] == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert torch_supports(one) is None
    two = uniform_plan(cfg, 2)
    assert interleaves(cfg) and two.schedule == "interleaved" and two.num_pipeline_ranks == 4
    # one block per chunk, the embedding with the first, the head with the last
    assert [s.layers for s in two.stages] == [(0, 2)] + [(i, i + 1) for i in range(2, 8)] + \
        [(8, 10)]
    assert [s.ranks for s in two.stages] == [(i % 4,) for i in range(8)]
    assert two.warmups() == default_warmups("interleaved", 8, 8, 4)
    for schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        assert torch_supports(two, schedule) is None
    assert not interleaves(RaceConfig(blocks=6))


def test_a_plan_that_leaves_a_group_idle_runs_on_the_kept_ranks_in_file_order():
    cfg = RaceConfig()
    assert kept_ranks(cfg, []) == [0, 1, 2, 3]
    assert kept_ranks(cfg, ["slow"]) == [0, 1]
    assert kept_ranks(cfg, ["fast"]) == [2, 3]


def _race(times: dict[str, list[float]], idle: list[str]) -> dict:
    plan = uniform_plan(RaceConfig()).to_dict()
    plan["predicted"] = {"iteration_s": 1.1}
    return {"times": times, "plan": plan, "group_choice": {"idle": idle}, "links": [],
            "profile": {}, "profile_s": 1.0, "plan_s": 0.1, "ddp_estimate_s": 50.0}


def test_last_line_reports_the_speedup_over_torchs_best_and_every_median():
    times = {"a": [1.0, 1.0, 1.2], "b": [3.0, 3.0, 3.0], "d": [2.5] * 3, "f": [2.0, 2.2, 2.4],
             "g": [2.6] * 3, "h": [1.5] * 3}
    mech = SimpleNamespace(slowdown="hook", network="netns", notes=())
    out = summarize(RaceConfig(), _race(times, ["slow"]), mech, 10.0)
    assert out["speedup_vs_torch_1f1b_uniform"] == pytest.approx(3.0)
    assert out["speedup_vs_torch_best"] == pytest.approx(2.2)
    assert out["torch_best"] == CONTENDERS["f"]
    assert out["speedup_vs_all_groups"] == pytest.approx(1.5)
    assert "speedup_vs_plain_1f1b" not in out and "ddp_skipped" in out
    assert out["prediction_error"] == pytest.approx(0.1)
    assert {k: r["median_s"] for k, r in out["contenders"].items()} == \
        {"a": 1.0, "b": 3.0, "d": 2.5, "f": 2.2, "g": 2.6, "h": 1.5}
    assert out["group_choice"]["idle"] == ["slow"]


def test_a_race_of_some_contenders_reports_each_plans_prediction():
    race = _race({"a": [1.0], "b": [3.0], "c": [1.25]}, [])
    race["predicted"] = {"a": 1.1, "c": 1.0, "h": 2.0}  # (h) did not race: left out
    out = summarize(RaceConfig(contenders="abc"), race,
                    SimpleNamespace(slowdown="hook", network="netns", notes=()), 10.0)
    assert out["predictions"] == {"a": {"predicted_s": 1.1, "measured_s": 1.0, "error": 0.1},
                                  "c": {"predicted_s": 1.0, "measured_s": 1.25, "error": 0.2}}
    assert out["speedup_vs_torch_best"] == pytest.approx(3.0)
    assert "speedup_vs_uniform_hapt_runtime" not in out


def test_a_saved_race_config_reads_back_with_its_idle_load():
    from dataclasses import asdict

    assert RaceConfig.from_dict(asdict(RaceConfig(idle_load="rest"))).idle_load == "rest"
    # written before the idle load had a name: busy meant the matrix products
    assert RaceConfig.from_dict({"idle_ranks_busy": True}).idle_load == "burn"
    assert RaceConfig.from_dict({"idle_ranks_busy": False}).idle_load == "rest"
    with pytest.raises(ValueError, match="idle_load"):
        RaceConfig.from_dict({"idle_load": "nap"})


def test_every_idle_load_runs_about_a_millisecond():
    import time

    from benchmarks.e2e import IDLE_LOADS, IDLE_RUNS

    assert set(IDLE_RUNS) == set(IDLE_LOADS)
    for name, fn in IDLE_RUNS.items():
        t0 = time.perf_counter()
        fn()
        assert time.perf_counter() - t0 < 0.5, name
    t0 = time.perf_counter()
    IDLE_RUNS["spin"]()
    assert time.perf_counter() - t0 >= 0.001


def test_core_load_adds_up_the_ticks_of_every_span(monkeypatch):
    import benchmarks.e2e as e2e

    ticks = iter([[(100, 50, 0), (10, 10, 0)], [(160, 90, 0), (40, 70, 10)],   # span 1
                  [(160, 90, 0), (40, 70, 10)], [(200, 90, 0), (40, 110, 10)]])  # span 2
    monkeypatch.setattr(e2e, "_cpu_ticks", lambda: next(ticks))
    load = e2e.CoreLoad()
    for _ in range(2):
        load.start()
        load.stop()
    # core 0: 100 busy of 140; core 1: 30 busy, 100 idle, 10 stolen of 140
    assert load.summary() == {"busy": [round(100 / 140, 3), round(30 / 140, 3)],
                              "steal": [0.0, round(10 / 140, 3)]}
    assert e2e.CoreLoad().summary() == {"busy": [], "steal": []}


def test_the_idle_variants_race_only_where_asked_for():
    from benchmarks.e2e import CONTENDERS, IDLE_LOADS, IDLE_VARIANTS

    assert set(IDLE_VARIANTS.values()) == set(IDLE_LOADS)
    assert all(k in CONTENDERS for k in IDLE_VARIANTS)
    assert not set(IDLE_VARIANTS) & set(RaceConfig().contenders)
    assert RaceConfig().idle_load == "rest"
