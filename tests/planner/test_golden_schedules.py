"""Every schedule kind's generator gives the action lists recorded before schedules became
per-rank lists with a placement (tests/data/golden_schedules.json: gpipe, 1f1b and h1f1b over
1-5 stages, 1-8 micro-batches, default and H-1F1B warm-ups, receives one compute ahead and
as early as their sender may send)."""
from __future__ import annotations

import json
from pathlib import Path

from hapt_hf.planner.schedule import build_schedule

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden_schedules.json"


def test_lists_are_the_recorded_lists():
    cases = json.loads(GOLDEN.read_text())
    assert len(cases) == 360
    for c in cases:
        s = build_schedule(c["kind"], c["stages"], c["microbatches"], c["warmups"],
                           early_receives=c["early_receives"])
        assert [[str(a) for a in lst] for lst in s.actions] == c["actions"], c
        assert s.placement == tuple(range(c["stages"]))
        for st in range(c["stages"]):  # each stage's actions are its rank's whole list here
            assert s.stage_actions(st) == s.actions[s.rank_of(st)]
