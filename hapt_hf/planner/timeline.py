"""Draw a simulated iteration as a PNG: one row per stage, time to the right.

Where pipeline ranks hold several stages (an interleaved schedule) the rows are the ranks
instead, each drawing all its stages' work (a darker shade for each later stage of the rank),
so the rank's idle time shows. A split backward draws its input gradient ``I`` and weight
gradient ``W`` in shades of their own.

Each row has a compute lane (forward and backward boxes numbered by micro-batch, the
optimizer update) and, just under it, a thinner communication lane (activations sent on,
gradients sent back, the data-parallel all-reduce), since transfers overlap compute. Behind
each row a light band marks the stage's warm-up (the forwards before its first backward) and
another its drain (the backwards after its last forward), so the pipeline's fill and drain
show at any scale. The title carries the iteration time and the bubble; a legend names the
colours.

With few micro-batches (:data:`ZOOM_ABOVE` or fewer) one panel shows everything, every box
numbered. With more, the top panel shows the whole iteration with forwards in the upper half
of each compute lane and backwards in the lower half (so the two stay apart when a box is a
pixel wide), and two zoom panels under it show the first and the last micro-batches' time
windows (:func:`zoom_windows`), where the boxes are wide enough to carry their numbers.

:func:`timeline_boxes`, :func:`stage_phases`, :func:`zoom_windows` and :func:`plan_labels`
are pure (testable without drawing); :func:`draw_timeline` renders them with matplotlib's Agg
canvas, imported lazily so planning never needs a display or pays matplotlib's import time.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hapt_hf.core.files import replace_atomic

if TYPE_CHECKING:
    from hapt_hf.planner.plan import Plan
    from hapt_hf.planner.simulate import SimResult

__all__ = ["TimelineBox", "StagePhases", "ZoomWindow", "timeline_boxes", "stage_phases",
           "zoom_windows", "plan_labels", "draw_timeline", "rows_by_rank", "KIND_COLOURS",
           "ZOOM_ABOVE"]

KIND_COLOURS = {
    "F": "#2b6cb0",          # forward: blue
    "B": "#e8871e",          # backward: orange
    "I": "#c2410c",          # input gradient of a split backward: dark orange
    "W": "#2f9e44",          # weight gradient of a split backward (deferred): green
    "UPDATE": "#6b3fa0",     # optimizer step: purple
    "SEND_F": "#8cc4ec",     # activation transfer (goes with the forwards): light blue
    "SEND_B": "#f2c078",     # gradient transfer (goes with the backwards): light orange
    "ALLREDUCE": "#7a5c3e",  # data-parallel gradient all-reduce: brown
    "ALLGATHER": "#d45d9c",  # sharded optimizer state: updated weights to every replica: pink
}
KIND_NAMES = {
    "F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
    "UPDATE": "optimizer step", "SEND_F": "activation send",
    "SEND_B": "gradient send", "ALLREDUCE": "all-reduce", "ALLGATHER": "all-gather",
}
WARMUP_COLOUR = "#dce9f7"  # band behind a stage's warm-up
DRAIN_COLOUR = "#fbe8cf"   # band behind a stage's drain
TURN_COLOUR = "#2b4f7a"    # line at a stage's first backward
ZOOM_ABOVE = 16
"""Above this many micro-batches the drawing adds the two zoom panels."""

_COMPUTE = frozenset({"F", "B", "I", "W"})
_BACKWARD = frozenset({"B", "I"})  # the backward that ends a stage's warm-up
_COMM_KINDS = frozenset({"SEND_F", "SEND_B", "ALLREDUCE", "ALLGATHER"})
_ROW_H = 1.0          # height of one stage's row
_COMPUTE_H = 0.62     # compute lane height within it
_COMM_H = 0.22        # communication lane height
_ROW_TOP = 0.9        # a row's boxes reach this far above its bottom (the rest is a gap)
_DPI = 110
_FIG_W = 15.0         # inches
_NUMBER_PT = 6.0      # micro-batch numbers' font size
_DIGIT_PX = _NUMBER_PT * _DPI / 72 * 0.64  # one digit's width on the canvas


@dataclass(frozen=True)
class TimelineBox:
    """One rectangle of the drawing, in data coordinates (seconds, row units)."""

    stage: int
    kind: str
    microbatch: int
    x: float
    width: float
    y: float
    height: float
    row: int = -1
    """The row it is drawn in: its stage, or its pipeline rank where ranks hold several
    stages (-1: its stage)."""
    shade: float = 0.0
    """How much darker than its kind's colour it is drawn (0: not at all; the compute of the
    later stages of a rank holding several)."""

    @property
    def is_comm(self) -> bool:
        return self.kind in _COMM_KINDS


@dataclass(frozen=True)
class StagePhases:
    """A row's fill and drain, in seconds (``stage``: the row's stage, or its pipeline rank
    where the rows are ranks).

    ``warmup`` forwards run before the stage's first backward, over ``warmup_start`` to
    ``warmup_end`` (the first backward's start); ``drain`` backwards run after its last
    forward, over ``drain_start`` (the last forward's end) to ``drain_end``. A stage that runs
    no backward has its whole forward span as warm-up and no drain."""

    stage: int
    warmup: int
    warmup_start: float
    warmup_end: float
    drain: int
    drain_start: float
    drain_end: float


@dataclass(frozen=True)
class ZoomWindow:
    """A time window of the iteration drawn in its own panel, in seconds."""

    t0: float
    t1: float
    label: str


def _events(sim: "SimResult") -> tuple[Any, ...]:
    events = tuple(getattr(sim, "events", ()))
    if not events:
        raise ValueError("the simulation recorded no events; simulate with "
                         "record_events=True to draw a timeline")
    for e in events:
        if e.kind not in KIND_COLOURS:
            raise ValueError(f"event kind {e.kind!r} is unknown; expected one of "
                             f"{sorted(KIND_COLOURS)}")
    return events


def _row_top(stage: int, n: int) -> float:
    return (n - 1 - stage) * _ROW_H + _ROW_TOP


def rows_by_rank(sim: "SimResult") -> dict[int, tuple[int, ...]]:
    """The stages of each pipeline rank, where the events record ranks and some rank holds
    several stages (the drawing then has a row per rank); empty otherwise (a row per
    stage)."""
    placed: dict[int, set[int]] = {}
    for e in _events(sim):
        if getattr(e, "rank", -1) < 0:
            return {}
        placed.setdefault(e.rank, set()).add(e.stage)
    if all(len(v) == 1 for v in placed.values()):
        return {}
    return {r: tuple(sorted(v)) for r, v in sorted(placed.items())}


def _row(e: Any, by_rank: dict[int, tuple[int, ...]]) -> int:
    return e.rank if by_rank else e.stage


def timeline_boxes(sim: "SimResult") -> list[TimelineBox]:
    """Lay out the simulator's events; stage 0 (or pipeline rank 0) is the top row.

    Raises ValueError when the result carries no events (simulated with
    ``record_events=False``) or an event of a kind this drawing does not know.
    """
    events = _events(sim)
    by_rank = rows_by_rank(sim)
    n = 1 + max(_row(e, by_rank) for e in events)
    boxes = []
    for e in events:
        row = _row(e, by_rank)
        top = _row_top(row, n)
        if e.kind in _COMM_KINDS:
            y, h = top - _COMPUTE_H - _COMM_H - 0.02, _COMM_H
        else:
            y, h = top - _COMPUTE_H, _COMPUTE_H
        shade = 0.0
        if by_rank and e.kind in _COMPUTE:  # transfers keep their colours
            mine = by_rank[row]
            shade = 0.5 * mine.index(e.stage) / len(mine)
        boxes.append(TimelineBox(e.stage, e.kind, e.microbatch, e.start,
                                 max(e.end - e.start, 0.0), y, h, row, shade))
    return boxes


def _compute_by_stage(events: Sequence[Any],
                      by_rank: dict[int, tuple[int, ...]] | None = None) -> dict[int, list[Any]]:
    rows: dict[int, list[Any]] = {}
    for e in events:
        if e.kind in _COMPUTE:
            rows.setdefault(_row(e, by_rank or {}), []).append(e)
    for row in rows.values():
        row.sort(key=lambda e: (e.start, e.end))
    return rows


def stage_phases(sim: "SimResult") -> list[StagePhases]:
    """Each row's warm-up and drain, in row order (rows with no compute left out): the
    forwards before the row's first backward (``B`` or ``I``) and the backwards after its
    last forward (a deferred ``W`` after them ends the drain, uncounted)."""
    rows = _compute_by_stage(_events(sim), rows_by_rank(sim))
    out = []
    for stage in sorted(rows):
        row = rows[stage]
        fwd = [e for e in row if e.kind == "F"]
        bwd = [e for e in row if e.kind in _BACKWARD]
        if not fwd:
            continue
        if not bwd:
            out.append(StagePhases(stage, len(fwd), fwd[0].start, fwd[-1].end, 0,
                                   fwd[-1].end, fwd[-1].end))
            continue
        first_b, last_f = bwd[0].start, max(e.end for e in fwd)
        warm = [e for e in fwd if e.start < first_b]
        drain = [e for e in bwd if e.start >= last_f]
        tail = [e.end for e in row if e.kind != "F" and e.start >= last_f]
        out.append(StagePhases(stage, len(warm), fwd[0].start, first_b, len(drain), last_f,
                               max(tail) if drain else last_f))
    return out


def _microbatch_span(events: Sequence[Any], t0: float, t1: float) -> tuple[int, int]:
    inside = [e.microbatch for e in events
              if e.kind in _COMPUTE and e.end > t0 and e.start < t1]
    return min(inside), max(inside)


def zoom_windows(sim: "SimResult", *, max_boxes: int = 30,
                 zoom_above: int = ZOOM_ABOVE) -> list[ZoomWindow]:
    """The start and the end of the iteration, each a window where no stage's row holds more
    than ``max_boxes`` forward and backward boxes (so each is wide enough for its number).

    Empty when there are ``zoom_above`` micro-batches or fewer (the whole iteration reads in
    one panel), or when the two windows would meet. The start window runs from the first
    event to the end of the earliest row's ``max_boxes``-th box, or on to the end of the last
    stage's first backward (the pipeline full) where no row then holds over 1.5 ``max_boxes``
    boxes; the end window from the start of the latest row's ``max_boxes``-th box from last to
    the last event (the optimizer step included)."""
    if max_boxes < 1:
        raise ValueError(f"max_boxes must be at least 1, got {max_boxes}")
    events = _events(sim)
    rows = _compute_by_stage(events, rows_by_rank(sim))
    if not rows:
        return []
    micro = 1 + max(e.microbatch for row in rows.values() for e in row)
    if micro <= zoom_above:
        return []
    t_first = min(e.start for e in events)
    t_last = max(e.end for e in events)
    head_ends = [row[max_boxes - 1].end for row in rows.values() if len(row) >= max_boxes]
    tail_starts = [sorted(row, key=lambda e: (e.end, e.start))[-max_boxes].start
                   for row in rows.values() if len(row) >= max_boxes]
    if not head_ends:
        return []
    head_t1, tail_t0 = min(head_ends), max(tail_starts)
    turn = next((e.end for e in rows[max(rows)] if e.kind in _BACKWARD), head_t1)
    if turn > head_t1 and all(sum(e.start < turn for e in row) <= max_boxes * 3 // 2
                              for row in rows.values()):
        head_t1 = turn  # show the pipeline full: the last stage's first backward
    if head_t1 >= tail_t0:
        return []
    lo, hi = _microbatch_span(events, t_first, head_t1)
    head = ZoomWindow(t_first, head_t1, f"start: micro-batches {lo} to {hi}")
    lo, hi = _microbatch_span(events, tail_t0, t_last)
    tail = ZoomWindow(tail_t0, t_last, f"end: micro-batches {lo} to {hi}")
    return [head, tail]


def plan_labels(plan: "Plan") -> list[str]:
    """Row labels naming each stage's GPUs: ``"stage 0: v100 x4"``, or for a stage whose
    replicas span groups ``"stage 1: a100 x2 + v100 x3"`` (one GPU per replica); where
    pipeline ranks hold several stages, one label per rank: ``"rank 0 (stages 0, 4): v100
    x2"``."""
    if plan.virtual_stages > 1:
        p = plan.num_pipeline_ranks
        return [f"rank {r} (stages {', '.join(str(s) for s in range(r, plan.num_stages, p))}):"
                f"{lab.split(':', 1)[1]}" for r, lab in enumerate(_stage_labels(plan)[:p])]
    return _stage_labels(plan)


def _stage_labels(plan: "Plan") -> list[str]:
    labels = []
    for s in plan.stages:
        groups = tuple(s.groups)
        if len(groups) <= 1:
            gpus = f"{groups[0] if groups else s.group} x{len(s.ranks)}"
        else:
            count = Counter(r.group for r in s.replicas)
            gpus = " + ".join(f"{g} x{count[g]}" for g in groups)
        labels.append(f"stage {s.index}: {gpus}")
    return labels


# -- drawing -----------------------------------------------------------------------------------

def _title(sim: Any, title: str) -> str:
    head = f"{title}: " if title else ""
    it = sim.iteration_s
    when = f"{it * 1e3:.1f} ms" if it < 1 else f"{it:.3f} s"
    text = (f"{head}iteration {when}, "
            f"bubble {100 * sim.bubble_fraction:.1f}%")
    if not getattr(sim, "feasible", True):
        text += f" - DOES NOT FIT ({getattr(sim, 'reason', '')})"
    return text


@dataclass(frozen=True)
class _Panel:
    t0: float          # seconds
    t1: float
    width_px: float    # the axes' approximate width on the canvas
    row_px: float      # one row's height on the canvas
    split: bool        # forwards in the upper half of the compute lane, backwards in the lower
    numbers: bool      # write micro-batch numbers in the boxes wide enough


def _draw_panel(ax: Any, boxes: Sequence[TimelineBox], phases: Sequence[StagePhases], n: int,
                panel: _Panel, scale: float, names: dict[str, Any]) -> None:
    """Draw ``boxes`` between ``panel.t0`` and ``panel.t1`` on ``ax``; ``names`` holds the
    row labels, their font size and the time unit."""
    from matplotlib.collections import LineCollection, PolyCollection

    def rects(spans: list[tuple[float, float, float, float]], colour: str, edge: str,
              width: float, zorder: float) -> None:  # one collection: fast with 10^5 boxes
        if spans:
            ax.add_collection(PolyCollection(
                [[(x, y), (x + w, y), (x + w, y + h), (x, y + h)] for x, w, y, h in spans],
                facecolors=colour, edgecolors=edge, linewidths=width, zorder=zorder))

    span = max(panel.t1 - panel.t0, 1e-12)
    warm, drain, turns = [], [], []
    for p in phases:  # warm-up and drain bands behind the row
        bottom = _row_top(p.stage, n) - _COMPUTE_H - _COMM_H - 0.04
        height = _COMPUTE_H + _COMM_H + 0.06
        warm.append((p.warmup_start * scale, (p.warmup_end - p.warmup_start) * scale, bottom,
                     height))
        if p.drain:
            drain.append((p.drain_start * scale, (p.drain_end - p.drain_start) * scale, bottom,
                          height))
        if p.warmup_end > p.warmup_start:  # the first backward: end of the warm-up
            turns.append([(p.warmup_end * scale, bottom), (p.warmup_end * scale, bottom + height)])
    rects(warm, WARMUP_COLOUR, "none", 0.0, 0)
    rects(drain, DRAIN_COLOUR, "none", 0.0, 0)
    ax.add_collection(LineCollection(turns, colors=TURN_COLOUR, linewidths=0.8, zorder=1))
    visible = [b for b in boxes if b.x + b.width >= panel.t0 and b.x <= panel.t1]
    by_kind: dict[tuple[str, float], list[tuple[float, float, float, float]]] = {}
    for b in visible:
        y, h = b.y, b.height
        if panel.split and b.kind in _COMPUTE:
            h = b.height / 2
            y = b.y + h if b.kind == "F" else b.y
        by_kind.setdefault((b.kind, b.shade), []).append((b.x * scale, b.width * scale, y, h))
    for (kind, shade), spans in by_kind.items():
        colour = _darker(KIND_COLOURS[kind], shade)
        if panel.split:
            rects(spans, colour, "none", 0.0, 2)
        else:
            rects(spans, colour, "white", 0.4, 2)
    if panel.numbers:
        px_per_s = panel.width_px / span
        px_per_row = panel.row_px / _ROW_H
        for b in visible:
            if b.kind not in _COMPUTE:
                continue
            label = str(b.microbatch)
            lo, hi = max(b.x, panel.t0), min(b.x + b.width, panel.t1)
            wide, tall = (hi - lo) * px_per_s, b.height * px_per_row
            need = _DIGIT_PX * len(label) + 2
            if wide >= need:
                rotation = 0
            elif wide >= _DIGIT_PX * 1.6 and tall >= need:
                rotation = 90  # a narrow but tall box takes its number upright
            else:
                continue
            dark = b.kind in ("F", "I", "W") or b.shade > 0.2
            ax.text((lo + hi) / 2 * scale, b.y + b.height / 2, label, ha="center",
                    va="center", fontsize=_NUMBER_PT, rotation=rotation, zorder=3,
                    color="white" if dark else "black", clip_on=True)
    ax.set_yticks([_row_top(i, n) - _COMPUTE_H / 2 for i in range(n)])
    ax.set_yticklabels(names["labels"], fontsize=names["size"])
    ax.set_xlabel(f"time ({names['unit']})", fontsize=8)
    ax.set_ylim(0, n * _ROW_H)
    pad = span * 0.01
    ax.set_xlim((panel.t0 - pad) * scale, (panel.t1 + pad) * scale)
    ax.tick_params(axis="x", labelsize=8)


def _darker(colour: str, shade: float) -> str:
    """``colour`` (``#rrggbb``) mixed with black by ``shade`` (0: as it is)."""
    if shade <= 0:
        return colour
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * (1 - shade)):02x}" for c in rgb)


def _row_labels(n: int, phases: Sequence[StagePhases],
                stage_labels: Sequence[str] | None,
                by_rank: dict[int, tuple[int, ...]] | None = None) -> list[str]:
    names = list(stage_labels or ())
    if by_rank:
        names += [f"rank {i} (stages {', '.join(map(str, by_rank.get(i, ())))})"
                  for i in range(len(names), n)]
    names += [f"stage {i}" for i in range(len(names), n)]
    warm = {p.stage: p.warmup for p in phases}
    return [f"{names[i]}\nwarm-up {warm[i]}" if i in warm else names[i] for i in range(n)]


def _legend_handles(boxes: Sequence[TimelineBox], split: bool) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    kinds = {b.kind for b in boxes}
    handles: list[Any] = []
    for k in KIND_COLOURS:
        if k in kinds:
            name = KIND_NAMES[k]
            if split and k in _COMPUTE:
                name += f" (whole iteration: {'upper' if k == 'F' else 'lower'} half)"
            handles.append(Patch(color=KIND_COLOURS[k], label=f"{k} {name}"))
    if any(b.shade > 0 for b in boxes):
        handles.append(Patch(color=_darker(KIND_COLOURS["F"], 0.25),
                             label="darker: a rank's later stages"))
    handles += [Patch(color=WARMUP_COLOUR, label="warm-up: forwards before the first backward"),
                Line2D([], [], color=TURN_COLOUR, linewidth=0.8, label="first backward"),
                Patch(color=DRAIN_COLOUR, label="drain: backwards after the last forward")]
    return handles


def draw_timeline(sim: "SimResult", path: str | os.PathLike, *, title: str = "",
                  stage_labels: Sequence[str] | None = None,
                  plan: "Plan | None" = None) -> Path:
    """Write the timeline of ``sim`` as a PNG at ``path`` (atomically) and return the path.

    Rows are named by ``stage_labels`` (e.g. ``"stage 0: v100 x4"``), else by the GPUs of
    ``plan``'s stages (:func:`plan_labels`), else ``"stage i"``; each label adds the stage's
    warm-up count. Where ranks hold several stages the rows are ranks (:func:`rows_by_rank`)
    and ``stage_labels`` names each rank.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    boxes = timeline_boxes(sim)
    phases = stage_phases(sim)
    windows = zoom_windows(sim)
    n = 1 + max(b.row for b in boxes)
    end = max(max(b.x + b.width for b in boxes), getattr(sim, "iteration_s", 0.0)) or 1.0
    start = min(0.0, min(b.x for b in boxes))
    scale, unit = (1.0, "s") if end >= 10 else (1e3, "ms")
    if stage_labels is None and plan is not None:
        stage_labels = plan_labels(plan)
    labels = _row_labels(n, phases, stage_labels, rows_by_rank(sim))

    row_in = max(0.3, min(0.6, 9.0 / n))
    panel_in = 0.4 + row_in * n
    rows = 2 if windows else 1
    # Figure object, not pyplot: no global state, no GUI backend, safe in any process.
    fig = Figure(figsize=(_FIG_W, 1.2 + rows * (panel_in + 0.5)), layout="constrained")
    FigureCanvasAgg(fig)
    axes_px = _FIG_W * _DPI * 0.86
    row_px = row_in * _DPI
    names = {"labels": labels, "size": 8 if n <= 12 else 6.5, "unit": unit}
    if not windows:
        ax = fig.add_subplot(1, 1, 1)
        _draw_panel(ax, boxes, phases, n, _Panel(start, end, axes_px, row_px, False, True),
                    scale, names)
    else:
        grid = fig.add_gridspec(2, 2)
        ax = fig.add_subplot(grid[0, :])
        _draw_panel(ax, boxes, phases, n, _Panel(start, end, axes_px, row_px, True, False),
                    scale, names)
        for w in windows:  # where the zoom panels look
            ax.axvspan(w.t0 * scale, w.t1 * scale, facecolor="none", edgecolor="#444444",
                       linestyle="--", linewidth=0.9, zorder=4)
        ax.set_title("whole iteration (dashed: the windows drawn below)", fontsize=9,
                     loc="left")
        for col, w in enumerate(windows):
            zax = fig.add_subplot(grid[1, col])
            zoom = _Panel(w.t0, w.t1, axes_px * 0.47, row_px, False, True)
            _draw_panel(zax, boxes, phases, n, zoom, scale,
                        names if col == 0 else {**names, "labels": []})
            zax.set_title(f"{w.label} ({w.t0 * scale:.4g} to {w.t1 * scale:.4g} {unit})",
                          fontsize=9, loc="left")
    fig.suptitle(_title(sim, title), fontsize=10, x=0.01, ha="left")
    handles = _legend_handles(boxes, bool(windows))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5),
               fontsize=7.5, frameon=False)
    out = Path(path)
    replace_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=_DPI), suffix=".png")
    return out
