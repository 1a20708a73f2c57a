"""The race trace's breakdown of a step: compute less the waits inside it, waits, and what
runs between the actions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.race_trace import Recorder, rank_breakdown  # noqa: E402


def test_a_steps_breakdown_parts_add_up_to_its_total(tmp_path):
    # one step of 100 ms: F 0-20 (a 5 ms wait inside), B 22-52, the last wait 52-60,
    # the loss all-reduce 61-63 and the optimizer 63-90; 10 ms elsewhere
    events = [["F", 1, 0, 0.000, 0.020], ["WAIT", 1, -1, 0.002, 0.007],
              ["B", 1, 0, 0.022, 0.052], ["WAIT", 1, -1, 0.052, 0.060],
              ["LOSS", -1, -1, 0.061, 0.063], ["OPT", -1, -1, 0.063, 0.090]]
    calls = [{"events": [["F", 1, 0, 0.0, 1.0]], "total_s": 5.0},  # untimed: skipped
             {"events": events, "total_s": 0.100}]
    (tmp_path / "trace_rank1.json").write_text(json.dumps(calls))
    got = rank_breakdown(tmp_path, skip=1)[1]
    assert round(got["compute"], 6) == 0.045
    assert round(got["waits"], 6) == 0.013
    assert round(got["opt"], 6) == 0.027 and round(got["loss"], 6) == 0.002
    assert round(got["between actions"], 6) == 0.013
    assert got["actions"] == 2


def test_the_recorder_times_each_call_and_what_runs_inside_it():
    rec = Recorder()
    inner = rec.timed("F", lambda m, s, k: None, lambda m, s, k: (s, k))
    rec.call(lambda: inner(None, 2, 5))()
    (call,) = rec.calls
    assert call["total_s"] >= 0 and [e[:3] for e in call["events"]] == [("F", 2, 5)]


def test_only_the_chosen_plans_own_calls_are_read(tmp_path):
    # (i), (j), (k) run (a)'s step too, tagged with their letter: they are left out
    one = [["F", 0, 0, 0.0, 0.010]]
    calls = [{"events": one, "total_s": 0.02, "tag": "a"},
             {"events": [["F", 0, 0, 0.0, 0.5]], "total_s": 1.0, "tag": "i"},
             {"events": one, "total_s": 0.02}]  # written before calls had tags: (a)'s
    (tmp_path / "trace_rank0.json").write_text(json.dumps(calls))
    got = rank_breakdown(tmp_path, skip=0)[0]
    assert round(got["total"], 6) == 0.02 and round(got["compute"], 6) == 0.01
    rec = Recorder()
    rec.tag = "j"
    rec.call(lambda: None)()
    assert rec.calls[0]["tag"] == "j"
