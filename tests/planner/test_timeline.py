"""Timeline layout and PNG drawing, on hand-made simulator results."""
from __future__ import annotations

import struct

import pytest

from hapt_hf.planner.simulate import SimEvent, SimResult
from hapt_hf.planner.timeline import KIND_COLOURS, draw_timeline, timeline_boxes


def _two_stage_result(feasible: bool = True) -> SimResult:
    """Stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1, with sends and an all-reduce."""
    ev = [
        SimEvent(0, "F", 0, 0.000, 0.010), SimEvent(0, "SEND_F", 0, 0.010, 0.012),
        SimEvent(0, "F", 1, 0.010, 0.020), SimEvent(0, "SEND_F", 1, 0.020, 0.022),
        SimEvent(1, "F", 0, 0.012, 0.022), SimEvent(1, "B", 0, 0.022, 0.042),
        SimEvent(1, "SEND_B", 0, 0.042, 0.044), SimEvent(1, "F", 1, 0.042, 0.052),
        SimEvent(1, "B", 1, 0.052, 0.072), SimEvent(1, "SEND_B", 1, 0.072, 0.074),
        SimEvent(0, "B", 0, 0.044, 0.064), SimEvent(0, "B", 1, 0.074, 0.094),
        SimEvent(0, "ALLREDUCE", 0, 0.094, 0.099), SimEvent(0, "UPDATE", 0, 0.099, 0.101),
        SimEvent(1, "UPDATE", 0, 0.072, 0.074),
    ]
    return SimResult(iteration_s=0.101, bubble_fraction=0.3, stage_busy_s=(0.062, 0.062),
                     peak_memory_bytes=(1e9, 2e9), events=tuple(ev), feasible=feasible,
                     reason="" if feasible else "stage 1 needs 41.0 GB of 40 GB")


def test_layout_puts_stage_zero_on_top_and_comm_under_compute():
    boxes = timeline_boxes(_two_stage_result())
    assert len(boxes) == 15
    top = {b.stage: b.y for b in boxes if b.kind == "F"}
    assert top[0] > top[1]  # stage 0 is the upper row
    for stage in (0, 1):
        compute = [b for b in boxes if b.stage == stage and not b.is_comm]
        comm = [b for b in boxes if b.stage == stage and b.is_comm]
        assert comm, f"stage {stage} has no transfer boxes"
        # the transfer lane lies wholly under the compute lane of the same row
        assert max(b.y + b.height for b in comm) <= min(b.y for b in compute)
    # rows never overlap: every box of stage 1 is under every box of stage 0
    assert max(b.y + b.height for b in boxes if b.stage == 1) < \
        min(b.y for b in boxes if b.stage == 0)
    f1 = next(b for b in boxes if b.stage == 1 and b.kind == "B" and b.microbatch == 1)
    assert f1.x == pytest.approx(0.052) and f1.width == pytest.approx(0.020)


def test_draw_writes_a_png_of_the_right_shape(tmp_path):
    out = draw_timeline(_two_stage_result(), tmp_path / "sub" / "t.png", title="demo",
                        stage_labels=["0 v100 x8", "1 a100 x4"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > height > 100  # a wide timeline, not an empty canvas
    assert len(data) > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["t.png"]  # no temporary left behind


def test_draw_an_infeasible_result_still_draws(tmp_path):
    out = draw_timeline(_two_stage_result(feasible=False), tmp_path / "t.png")
    assert out.stat().st_size > 10_000


def test_no_events_is_a_clear_error(tmp_path):
    empty = SimResult(iteration_s=1.0, bubble_fraction=0.0, stage_busy_s=(1.0,),
                      peak_memory_bytes=(1.0,), events=(), feasible=True)
    with pytest.raises(ValueError, match="record_events=True"):
        draw_timeline(empty, tmp_path / "t.png")
    assert not list(tmp_path.iterdir())


def test_unknown_event_kind_is_named():
    res = SimResult(iteration_s=1.0, bubble_fraction=0.0, stage_busy_s=(1.0,),
                    peak_memory_bytes=(1.0,), events=(SimEvent(0, "WAIT", 0, 0.0, 1.0),),
                    feasible=True)
    with pytest.raises(ValueError, match="'WAIT'"):
        timeline_boxes(res)


def test_every_kind_has_a_distinct_colour():
    assert len(set(KIND_COLOURS.values())) == len(KIND_COLOURS)
