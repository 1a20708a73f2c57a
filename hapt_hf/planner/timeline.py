"""Draw a simulated iteration as a PNG: one row per stage, time to the right.

Each stage's row has a compute lane (forward and backward boxes numbered by micro-batch, the
optimizer update) and, just under it, a thinner communication lane (activations sent on,
gradients sent back, the data-parallel all-reduce), since transfers overlap compute. The title
carries the iteration time and the bubble.

:func:`timeline_boxes` is the pure layout (testable without drawing); :func:`draw_timeline`
renders it with matplotlib's Agg canvas, imported lazily so planning never needs a display or
pays matplotlib's import time.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from hapt_hf.planner.simulate import SimResult

__all__ = ["TimelineBox", "timeline_boxes", "draw_timeline", "KIND_COLOURS"]

KIND_COLOURS = {
    "F": "#4c72b0",          # forward: blue
    "B": "#55a868",          # backward: green
    "UPDATE": "#8172b2",     # optimizer step: purple
    "SEND_F": "#dd8452",     # activation transfer: orange
    "SEND_B": "#c44e52",     # gradient transfer: red
    "ALLREDUCE": "#937860",  # data-parallel gradient all-reduce: brown
    "ALLGATHER": "#da8bc3",  # sharded optimizer state: updated weights to every replica: pink
}
_COMM_KINDS = frozenset({"SEND_F", "SEND_B", "ALLREDUCE", "ALLGATHER"})
_ROW_H = 1.0          # height of one stage's row
_COMPUTE_H = 0.62     # compute lane height within it
_COMM_H = 0.22        # communication lane height
_MAX_LABELS = 600     # above this many boxes the numbers would be unreadable clutter


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

    @property
    def is_comm(self) -> bool:
        return self.kind in _COMM_KINDS


def timeline_boxes(sim: "SimResult") -> list[TimelineBox]:
    """Lay out the simulator's events; stage 0 is the top row.

    Raises ValueError when the result carries no events (simulated with
    ``record_events=False``) or an event of a kind this drawing does not know.
    """
    events = tuple(getattr(sim, "events", ()))
    if not events:
        raise ValueError("the simulation recorded no events; simulate with "
                         "record_events=True to draw a timeline")
    n = 1 + max(e.stage for e in events)
    boxes = []
    for e in events:
        if e.kind not in KIND_COLOURS:
            raise ValueError(f"event kind {e.kind!r} is unknown; expected one of "
                             f"{sorted(KIND_COLOURS)}")
        top = (n - 1 - e.stage) * _ROW_H + 0.9  # row top, leaving a gap between rows
        if e.kind in _COMM_KINDS:
            y, h = top - _COMPUTE_H - _COMM_H - 0.02, _COMM_H
        else:
            y, h = top - _COMPUTE_H, _COMPUTE_H
        boxes.append(TimelineBox(e.stage, e.kind, e.microbatch, e.start,
                                 max(e.end - e.start, 0.0), y, h))
    return boxes


def _title(sim: Any, title: str) -> str:
    head = f"{title}: " if title else ""
    it = sim.iteration_s
    when = f"{it * 1e3:.1f} ms" if it < 1 else f"{it:.3f} s"
    text = (f"{head}iteration {when}, "
            f"bubble {100 * sim.bubble_fraction:.1f}%")
    if not getattr(sim, "feasible", True):
        text += f" - DOES NOT FIT ({getattr(sim, 'reason', '')})"
    return text


def _save_atomic(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def draw_timeline(sim: "SimResult", path: str | os.PathLike, *, title: str = "",
                  stage_labels: Sequence[str] | None = None) -> Path:
    """Write the timeline of ``sim`` as a PNG at ``path`` (atomically) and return the path.

    ``stage_labels`` names the rows (e.g. ``"0 v100 x4"``); default ``"stage i"``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    boxes = timeline_boxes(sim)
    n = 1 + max(b.stage for b in boxes)
    end = max(max(b.x + b.width for b in boxes), getattr(sim, "iteration_s", 0.0)) or 1.0
    # Figure object, not pyplot: no global state, no GUI backend, safe in any process.
    fig = Figure(figsize=(14, 1.0 + 0.55 * n))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lanes: dict[tuple[str, float, float], list[tuple[float, float]]] = {}
    for b in boxes:  # one collection per (kind, lane): fast even with 10^5 boxes
        lanes.setdefault((b.kind, b.y, b.height), []).append((b.x * 1e3, b.width * 1e3))
    for (kind, y, h), spans in lanes.items():
        ax.broken_barh(spans, (y, h), facecolors=KIND_COLOURS[kind], edgecolors="white",
                       linewidth=0.3)
    compute = [b for b in boxes if b.kind in ("F", "B")]
    if len(compute) <= _MAX_LABELS:
        min_w = end * 1e3 / 150  # a box narrower than this cannot hold a number
        for b in compute:
            if b.width * 1e3 >= min_w:
                ax.text((b.x + b.width / 2) * 1e3, b.y + b.height / 2, str(b.microbatch),
                        ha="center", va="center", fontsize=7, color="white")
    labels = list(stage_labels) if stage_labels else [f"stage {i}" for i in range(n)]
    ax.set_yticks([(n - 1 - i) * _ROW_H + 0.9 - _COMPUTE_H / 2 for i in range(n)])
    ax.set_yticklabels(labels[:n], fontsize=8)
    ax.set_ylim(0, n * _ROW_H)
    ax.set_xlim(0, end * 1e3 * 1.01)
    ax.set_xlabel("time (ms)")
    ax.set_title(_title(sim, title), fontsize=10, loc="left")
    present = [k for k in KIND_COLOURS if any(b.kind == k for b in boxes)]
    # legend in the title line, right-aligned, so it never covers a box or the axis label
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in present],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(present), fontsize=7,
              frameon=False, borderaxespad=0.2)
    fig.tight_layout()
    out = Path(path)
    _save_atomic(fig, out)
    return out
