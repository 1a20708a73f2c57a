"""Timeline layout and PNG drawing, on hand-made simulator results."""
from __future__ import annotations

import struct

import pytest

from hapt_hf.planner.plan import Plan
from hapt_hf.planner.simulate import SimEvent, SimResult
from hapt_hf.planner.timeline import (
    KIND_COLOURS,
    ZOOM_ABOVE,
    StagePhases,
    ZoomWindow,
    draw_timeline,
    plan_labels,
    stage_phases,
    timeline_boxes,
    zoom_windows,
)


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
    plain = tmp_path / "plain.png"
    plain.write_bytes(b"")  # the permissions open() gives a new file under this umask
    assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


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


def _one_f_one_b(stages: int, micro: int, f: float = 0.010, b: float = 0.020) -> SimResult:
    """A 1F1B iteration replayed by hand: stage s runs stages - s forwards, then one backward
    and one forward in turn, then the remaining backwards; a send takes 1 ms."""
    order = []
    for s in range(stages):
        warm = min(stages - s, micro)
        ops = [("F", i) for i in range(warm)]
        for i in range(micro - warm):
            ops += [("B", i), ("F", warm + i)]
        ops += [("B", i) for i in range(micro - warm, micro)]
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    clock, pos, events = [0.0] * stages, [0] * stages, []
    while any(pos[s] < len(order[s]) for s in range(stages)):
        for s in range(stages):
            while pos[s] < len(order[s]):
                kind, i = order[s][pos[s]]
                dep = (("F", s - 1, i) if s else None) if kind == "F" else \
                    (("B", s + 1, i) if s < stages - 1 else ("F", s, i))
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] + (0.001 if dep[1] != s else 0.0)) \
                    if dep else clock[s]
                end = start + (f if kind == "F" else b)
                events.append(SimEvent(s, kind, i, start, end))
                if (kind == "F" and s < stages - 1) or (kind == "B" and s):
                    events.append(SimEvent(s, "SEND_" + kind, i, end, end + 0.001))
                done[(kind, s, i)], clock[s] = end, end
                pos[s] += 1
    for s in range(stages):
        events.append(SimEvent(s, "UPDATE", -1, clock[s], clock[s] + 0.005))
    total = max(e.end for e in events)
    busy = micro * (f + b)
    return SimResult(iteration_s=total, bubble_fraction=1 - busy / total,
                     stage_busy_s=(busy,) * stages, peak_memory_bytes=(1e9,) * stages,
                     events=tuple(events), feasible=True)


def test_warmup_marks_count_the_forwards_before_the_first_backward():
    phases = stage_phases(_two_stage_result())
    assert phases == [StagePhases(0, 2, 0.000, 0.044, 2, 0.020, 0.094),
                      StagePhases(1, 1, 0.012, 0.022, 1, 0.052, 0.072)]
    sim = _one_f_one_b(4, 8)
    marks = stage_phases(sim)
    assert [p.warmup for p in marks] == [4, 3, 2, 1]
    assert [p.drain for p in marks] == [4, 3, 2, 1]
    for p in marks:  # the warm-up ends where the stage's first backward starts
        first_b = min(e.start for e in sim.events if e.stage == p.stage and e.kind == "B")
        last_f = max(e.end for e in sim.events if e.stage == p.stage and e.kind == "F")
        assert p.warmup_end == first_b and p.drain_start == last_f
        assert p.warmup_start < p.warmup_end <= p.drain_start < p.drain_end
    # the fill: each stage starts later than the one before it
    assert [p.warmup_start for p in marks] == sorted(p.warmup_start for p in marks)


def test_a_stage_with_only_forwards_is_all_warm_up():
    res = SimResult(iteration_s=0.02, bubble_fraction=0.0, stage_busy_s=(0.02,),
                    peak_memory_bytes=(1.0,), feasible=True,
                    events=(SimEvent(0, "F", 0, 0.0, 0.01), SimEvent(0, "F", 1, 0.01, 0.02)))
    assert stage_phases(res) == [StagePhases(0, 2, 0.0, 0.02, 0, 0.02, 0.02)]


def test_few_micro_batches_draw_in_one_panel():
    assert zoom_windows(_one_f_one_b(4, 8)) == []
    assert zoom_windows(_one_f_one_b(4, ZOOM_ABOVE)) == []
    assert zoom_windows(_two_stage_result()) == []


def test_many_micro_batches_zoom_on_the_first_and_the_last():
    sim = _one_f_one_b(4, 256)
    head, tail = zoom_windows(sim, max_boxes=30)
    assert isinstance(head, ZoomWindow)
    assert head.t0 == 0.0 and tail.t1 == pytest.approx(sim.iteration_s)
    assert head.t1 < tail.t0  # two separate windows, far apart
    assert tail.t0 - head.t1 > 0.5 * sim.iteration_s
    compute = [e for e in sim.events if e.kind in ("F", "B")]
    for w in (head, tail):
        for s in range(4):  # every row holds at most 1.5 x 30 boxes: wide enough for numbers
            inside = [e for e in compute if e.stage == s and e.end > w.t0 and e.start < w.t1]
            assert 0 < len(inside) <= 45
        # the label names the micro-batches the window shows
        mbs = [e.microbatch for e in compute if e.end > w.t0 and e.start < w.t1]
        assert w.label.endswith(f"micro-batches {min(mbs)} to {max(mbs)}")
    assert head.label.startswith("start: micro-batches 0 to ")
    assert tail.label.endswith("to 255")
    # the start window shows the pipeline full: the last stage's first backward in it
    first_b = next(e for e in sim.events if e.stage == 3 and e.kind == "B")
    assert first_b.end <= head.t1
    # the update is part of the end
    assert max(e.end for e in sim.events if e.kind == "UPDATE") <= tail.t1


def test_zoom_windows_are_pure_and_checked():
    sim = _one_f_one_b(3, 64)
    assert zoom_windows(sim) == zoom_windows(sim)
    assert zoom_windows(sim, zoom_above=64) == []
    with pytest.raises(ValueError, match="max_boxes"):
        zoom_windows(sim, max_boxes=0)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_draw_many_micro_batches_adds_the_zoom_panels(tmp_path):
    few = draw_timeline(_one_f_one_b(4, 8), tmp_path / "few.png")
    many = draw_timeline(_one_f_one_b(4, 256), tmp_path / "many.png", title="256")
    (w_few, h_few), (w_many, h_many) = _png_size(few), _png_size(many)
    assert w_few == w_many and h_many > 1.5 * h_few  # a second row of panels
    assert sorted(p.name for p in tmp_path.iterdir()) == ["few.png", "many.png"]


def _plan() -> Plan:
    return Plan.from_dict({
        "version": 1, "model": {"name": "toy", "num_layers": 6}, "schedule": "1f1b",
        "seq_len": 16, "micro_batch_size": 4, "num_microbatches": 8, "global_batch_size": 32,
        "stages": [
            {"index": 0, "layers": [0, 3], "warmup": 2, "replicas": [
                {"ranks": [0], "group": "v100", "device_type": "V100-32", "samples": 2},
                {"ranks": [1], "group": "v100", "device_type": "V100-32", "samples": 2}]},
            {"index": 1, "layers": [3, 6], "warmup": 1, "replicas": [
                {"ranks": [2], "group": "a100", "device_type": "A100-40", "samples": 2},
                {"ranks": [3], "group": "v100", "device_type": "V100-32", "samples": 1},
                {"ranks": [4], "group": "v100", "device_type": "V100-32", "samples": 1}]},
        ]})


def test_labels_name_each_stage_gpus(tmp_path):
    plan = _plan()
    assert plan_labels(plan) == ["stage 0: v100 x2", "stage 1: a100 x1 + v100 x2"]
    out = draw_timeline(_two_stage_result(), tmp_path / "t.png", plan=plan)
    assert _png_size(out)[0] > 1000
