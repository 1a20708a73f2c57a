"""The readable plan table that ``hapt-hf plan`` and ``hapt-hf simulate`` print.

A :class:`PlanReport` gathers, from a :class:`~hapt_hf.planner.plan.Plan` and the simulator's
result for it, one row per stage (where it runs, which layers, how long a micro-batch takes, how
much memory it needs against what its GPUs have) and the whole-iteration figures (iteration
time, tokens/s, bubble, distance to the physical limit, the attention the plan was budgeted
for and why, each baseline's time and the speed-up over it). It is plain data:
:func:`format_report` turns it into text, :func:`report_to_dict` into JSON.

The simulator's result and the baselines are read by attribute only (``iteration_s``,
``events``, ``plan``, ``sim``, ``reason``...), so this module needs nothing but the plan.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from hapt_hf.core.layers import layer_names
from hapt_hf.core.precision import SHARDED
from hapt_hf.planner.plan import Plan, Stage

if TYPE_CHECKING:  # only for annotations: the simulator imports nothing of this module
    from hapt_hf.planner.simulate import SimResult

__all__ = ["StageRow", "BaselineRow", "PlanReport", "build_report", "format_report",
           "report_to_dict", "format_ranks", "layer_names"]

_GB = 1e9


@dataclass(frozen=True)
class StageRow:
    """One line of the table: a pipeline stage."""

    index: int
    group: str
    device: str
    ranks: tuple[int, ...]
    layers: tuple[int, int]
    """Half-open range over the layer sequence."""
    layer_names: str
    """The same range in words, e.g. ``emb,b0-b3``."""
    forward_ms: float
    """Forward time of one micro-batch on one GPU of the stage."""
    backward_ms: float
    peak_memory_gb: float
    """Peak memory of one GPU of the stage."""
    capacity_gb: float | None
    """Memory of one GPU of the stage's group; None when the cluster is not known."""
    warmup: int
    optimizer: str = "replicated"
    """'replicated' or 'sharded' (ZeRO-1: the Adam moments split among the replicas)."""
    tp: int = 1
    """Tensor-parallel degree: the GPUs holding each replica together."""

    @property
    def fits(self) -> bool:
        return self.capacity_gb is None or self.peak_memory_gb <= self.capacity_gb


@dataclass(frozen=True)
class BaselineRow:
    """A baseline split scored by the same simulator, or why it could not be scored."""

    name: str
    iteration_s: float | None
    """None when the baseline is infeasible (see ``reason``)."""
    speedup: float | None
    """Baseline iteration time over the plan's: above 1 means the plan is faster."""
    reason: str = ""


@dataclass(frozen=True)
class PlanReport:
    """Everything the table shows, as data."""

    title: str
    schedule: str
    micro_batch_size: int
    num_microbatches: int
    stages: tuple[StageRow, ...]
    iteration_s: float
    tokens_per_s: float
    bubble_fraction: float
    feasible: bool
    reason: str = ""
    physical_limit_s: float | None = None
    """Total work over the sum of every GPU's speed; no plan can be faster."""
    used_limit_s: float | None = None
    """The same over the GPUs of the groups the plan uses, where it leaves some idle (None
    where it uses every group): how far the plan is from what its own GPUs could do."""
    search_time_s: float | None = None
    baselines: tuple[BaselineRow, ...] = ()
    idle_groups: tuple[str, ...] = ()
    """Groups of the cluster the plan leaves idle."""
    all_groups_s: float | None = None
    """The best plan's iteration time on every group, where the search found one."""
    sharding: tuple[str, ...] = ()
    """One line per stage with sharded optimizer state: why it shards."""
    data_parallel: str = ""
    """For a one-stage plan on several GPUs (data parallelism): the shares each GPU takes and
    why the plan is one stage; empty otherwise."""
    mixed_stages: tuple[str, ...] = ()
    """One line per pipeline stage whose GPUs differ (several groups, or uneven shares): each
    kind of GPU's share of every micro-batch."""
    attention: str = ""
    """The attention the plan was budgeted for (and the runtime builds), with why where the
    caller said, e.g. ``eager (gemma2 does not support sdpa; the model's best)``."""
    tensor_parallel: tuple[str, ...] = ()
    """One line per run of consecutive stages of one group whose replicas are several GPUs
    (tensor parallelism): the degree and what the GPUs of a replica split."""
    schedule_detail: str = ""
    """The kind's own settings: ``v=2`` (interleaved: chunks per pipeline rank) or
    ``deferrals 0,1,4`` (zero_bubble: each stage's, where the plan sets them)."""

    @property
    def limit_distance(self) -> float | None:
        """(iteration - limit) / limit: 0.05 means 5% slower than the physical limit."""
        return _above(self.iteration_s, self.physical_limit_s)

    @property
    def used_limit_distance(self) -> float | None:
        """(iteration - used_limit_s) / used_limit_s, where groups are idle."""
        return _above(self.iteration_s, self.used_limit_s)


def _above(iteration_s: float, limit_s: float | None) -> float | None:
    """How far ``iteration_s`` is above ``limit_s``, as a fraction of it; None without one."""
    if not limit_s or limit_s <= 0:
        return None
    return (iteration_s - limit_s) / limit_s


# -- building ---------------------------------------------------------------------------------

def format_ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``: contiguous runs collapsed."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _event_means(sim: Any, stage: int, kind: str) -> float | None:
    """Mean duration of one stage's events of one kind, from the simulator's record."""
    spans = [e.end - e.start for e in getattr(sim, "events", ()) if e.stage == stage
             and e.kind == kind]
    return sum(spans) / len(spans) if spans else None


def _stage_rows(plan: Plan, sim: Any | None,
                capacity_gb: Mapping[str, float] | None) -> tuple[StageRow, ...]:
    rows = []
    for s in plan.stages:
        # The simulator's record wins over the plan's own figures: a hand-edited plan's
        # "predicted" block may be stale, the replay is not.
        fwd = _event_means(sim, s.index, "F") if sim is not None else None
        bwd = _event_means(sim, s.index, "B") if sim is not None else None
        peak = s.predicted.peak_memory_bytes
        if sim is not None and s.index < len(sim.peak_memory_bytes):
            peak = sim.peak_memory_bytes[s.index]
        # a stage across groups names them all; the replay's peak is its tightest GPU's, held
        # against that GPU's own memory by the simulator, so no single capacity is shown
        devices = "+".join(dict.fromkeys(r.device_type for r in s.replicas)) or s.device_type
        rows.append(StageRow(
            index=s.index, group="+".join(s.groups), device=devices, ranks=tuple(s.ranks),
            tp=s.tp,
            layers=tuple(s.layers),
            layer_names=layer_names(s.layers, plan.num_layers, plan.layer_unit),
            forward_ms=1e3 * (s.predicted.forward_s if fwd is None else fwd),
            backward_ms=1e3 * (s.predicted.backward_s if bwd is None else bwd),
            peak_memory_gb=peak / _GB,
            capacity_gb=None if capacity_gb is None or len(s.groups) > 1
            else capacity_gb.get(s.group),
            warmup=s.warmup, optimizer=s.optimizer))
    return tuple(rows)


def _baseline_rows(baselines: Mapping[str, Any] | None,
                   iteration_s: float) -> tuple[BaselineRow, ...]:
    rows = []
    for name, b in (baselines or {}).items():
        sim = getattr(b, "sim", None)
        if sim is None or not getattr(sim, "feasible", True) or getattr(b, "plan", 1) is None:
            why = getattr(b, "reason", "") or (getattr(sim, "reason", "") if sim else "")
            rows.append(BaselineRow(name, None, None, why or "infeasible"))
            continue
        speed = sim.iteration_s / iteration_s if iteration_s > 0 else None
        rows.append(BaselineRow(name, sim.iteration_s, speed, getattr(b, "reason", "")))
    return tuple(rows)


def build_report(plan: Plan, sim: "SimResult | None", *, title: str = "",
                 capacity_gb: Mapping[str, float] | None = None,
                 physical_limit_s: float | None = None, search_time_s: float | None = None,
                 baselines: Mapping[str, Any] | None = None,
                 used_limit_s: float | None = None,
                 all_groups_s: float | None = None,
                 sharding: Mapping[int, str] | None = None,
                 attention_reason: str = "") -> PlanReport:
    """Gather the table's figures; without ``sim`` the plan's own predictions are shown.

    ``capacity_gb`` maps a group name to the memory of one of its GPUs; ``baselines`` maps a
    name to an object with ``plan``, ``sim`` and ``reason`` (the search's BaselineResult);
    ``all_groups_s`` is the best time the search found on every group and ``used_limit_s``
    the physical limit of the groups the plan uses (for a plan that leaves groups idle);
    ``sharding`` maps a stage index to why it shards its optimizer state; ``attention_reason``
    says why the plan's attention (the ModelSpec's ``attn_reason``).
    """
    if sim is not None:
        iteration, bubble = sim.iteration_s, sim.bubble_fraction
        feasible, reason = bool(sim.feasible), str(getattr(sim, "reason", ""))
    else:
        iteration, bubble = plan.predicted.iteration_s, plan.predicted.bubble_fraction
        feasible, reason = True, ""
    tokens = plan.global_batch_size * plan.seq_len / iteration if iteration > 0 else 0.0
    return PlanReport(
        title=title or f"{plan.model_name} on {plan.cluster_name or 'cluster'}",
        schedule=plan.schedule, schedule_detail=_schedule_detail(plan),
        micro_batch_size=plan.micro_batch_size,
        num_microbatches=plan.num_microbatches,
        stages=_stage_rows(plan, sim, capacity_gb), iteration_s=iteration,
        tokens_per_s=tokens, bubble_fraction=bubble, feasible=feasible, reason=reason,
        physical_limit_s=physical_limit_s, used_limit_s=used_limit_s,
        search_time_s=search_time_s,
        baselines=_baseline_rows(baselines, iteration), idle_groups=tuple(plan.idle_groups),
        all_groups_s=all_groups_s, sharding=_sharding_lines(plan, sharding or {}),
        data_parallel=_data_parallel(plan, sim if feasible else None),
        mixed_stages=_mixed_lines(plan), tensor_parallel=_tp_lines(plan),
        attention=plan.attn_implementation + (f" ({attention_reason})" if attention_reason
                                              else ""))


def _sharding_lines(plan: Plan, why: Mapping[int, str]) -> tuple[str, ...]:
    """One line per run of consecutive sharded stages of one width and one reason (a deep plan
    would otherwise print a line per stage); a run's reason leaves out where each stage's
    layers start."""
    runs: list[list] = []  # [first, last, dp, reason key, full reason of the first]
    for s in plan.stages:
        if s.optimizer != SHARDED:
            continue
        full = why.get(s.index, "")
        key = re.sub(r" from \S+", "", full)
        if runs and runs[-1][1] == s.index - 1 and runs[-1][2:4] == [s.width, key]:
            runs[-1][1] = s.index
        else:
            runs.append([s.index, s.index, s.width, key, full])
    out = []
    for first, last, dp, key, full in runs:
        head = (f"stage {first} over {dp} replicas" if first == last
                else f"stages {first}-{last} over {dp} replicas each")
        text = full if first == last else key
        out.append(head + (f": {text}" if text else ""))
    return tuple(out)


def _data_parallel(plan: Plan, sim: Any | None) -> str:
    """Why a plan is one stage of several GPUs, with each GPU's share and whether the gradient
    all-reduce hides behind the backward (from the replay's events)."""
    if plan.num_stages != 1 or plan.stages[0].width < 2:
        return ""
    reps = plan.stages[0].replicas
    line = (f"one stage: the whole model fits every GPU, so all {len(reps)} train data-parallel; "
            f"samples of each micro-batch {_shares(plan.stages[0], plan.micro_batch_size)}")
    ends = [e.end for e in getattr(sim, "events", ()) if e.kind == "B"]
    ar = [e for e in getattr(sim, "events", ()) if e.kind == "ALLREDUCE"]
    if ends and ar:
        after = ar[0].end - max(ends)
        line += ("; gradient all-reduce hidden behind the backward" if after < 1e-9 else
                 f"; gradient all-reduce runs {_fmt_s(after)} past the last backward")
    return line


def _shares(stage: Stage, mbs: int) -> str:
    """Each kind of GPU's share of a micro-batch, e.g. ``(by speed): a100 (A100-40) 13 x 3
    GPUs, v100 (V100-32) 5 x 5 GPUs``."""
    kinds: dict[tuple[str, str, int], int] = {}
    for r in stage.replicas:
        key = (r.group, r.device_type, r.samples)
        kinds[key] = kinds.get(key, 0) + 1
    text = ", ".join(f"{g} ({d}) {s} x {k} GPU{'s' * (k > 1)}" for (g, d, s), k in kinds.items())
    return f"({'by speed' if len({s for _, _, s in kinds}) > 1 else 'equal'}): {text}"


def _mixed_lines(plan: Plan) -> tuple[str, ...]:
    """Per pipeline stage over several groups or with uneven shares: its shares."""
    if plan.num_stages == 1:  # the data-parallel line says it
        return ()
    return tuple(f"stage {s.index}: samples of each micro-batch "
                 f"{_shares(s, plan.micro_batch_size)}"
                 for s in plan.stages if s.uneven)


def _tp_lines(plan: Plan) -> tuple[str, ...]:
    """Runs of consecutive stages of one group at one tensor-parallel degree above 1 (and
    alike in sequence parallelism)."""
    runs: list[list] = []  # [first, last, groups, degree, sequence parallel]
    for s in plan.stages:
        if s.tp == 1:
            continue
        key = [s.groups, s.tp, s.sequence_parallel]
        if runs and runs[-1][1] == s.index - 1 and runs[-1][2:] == key:
            runs[-1][1] = s.index
        else:
            runs.append([s.index, s.index] + key)
    last = plan.stages[-1].index if plan.stages else -1
    return tuple(f"{f'stage {a}' if a == b else f'stages {a}-{b}'} ({'+'.join(g)}): "
                 f"replicas of {t} GPUs of one node, each GPU holding 1/{t} of every block's "
                 "projections" + (f" and, sequence parallel, 1/{t} of its activations"
                                  if sp else "")
                 + "; the embedding and norms whole on each"
                 + ("; the LM head split by vocabulary rows, its loss taken on each GPU's "
                    "columns, where the model's class plan allows it, else whole"
                    if b == last else "")
                 for a, b, g, t, sp in runs)


# -- text ----------------------------------------------------------------------------------

_HEADERS = ("stage", "group", "device", "GPUs (ranks)", "tp", "layers", "fwd ms", "bwd ms",
            "memory GB", "warm-up", "optimizer")


def _cells(r: StageRow) -> tuple[str, ...]:
    mem = f"{r.peak_memory_gb:.1f}"
    if r.capacity_gb is not None:
        mem += f" / {r.capacity_gb:.0f}" + ("" if r.fits else " OVER")
    layers = f"[{r.layers[0]},{r.layers[1]}) {r.layers[1] - r.layers[0]}: {r.layer_names}"
    return (str(r.index), r.group, r.device, f"{len(r.ranks)} ({format_ranks(r.ranks)})",
            str(r.tp), layers, _ms(r.forward_ms), _ms(r.backward_ms), mem, str(r.warmup), r.optimizer)


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"  # an embedding takes microseconds


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    # numbers right-aligned, words left-aligned, so columns of figures line up
    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] == "-" else c.ljust(w)
                         for c, w in zip(cells, widths)).rstrip()
    return [line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _schedule_detail(plan: Plan) -> str:
    if plan.virtual_stages > 1:
        return f"v={plan.virtual_stages}"
    d = plan.deferrals()
    if d is None:
        return ""
    return "deferrals " + ",".join("rule" if x is None else str(x) for x in d)


def format_report(rep: PlanReport) -> str:
    """The table and the figures under it, as printed by the CLI."""
    kind = rep.schedule + (f" ({rep.schedule_detail})" if rep.schedule_detail else "")
    out = [f"{rep.title}: {len(rep.stages)} stages, schedule {kind}, micro-batch "
           f"{rep.micro_batch_size} x {rep.num_microbatches}", ""]
    out += _table(_HEADERS, [_cells(r) for r in rep.stages])
    out.append("")
    out.append(f"iteration time   {_fmt_s(rep.iteration_s)}")
    out.append(f"throughput       {rep.tokens_per_s:,.0f} tokens/s")
    out.append(f"bubble           {100 * rep.bubble_fraction:.1f}%")
    if rep.limit_distance is not None:
        out.append(f"physical limit   {_fmt_s(rep.physical_limit_s)} "
                   f"(plan is {100 * rep.limit_distance:.1f}% above it)")
        if rep.used_limit_distance is not None:
            out.append(f"                 {_fmt_s(rep.used_limit_s)} on the groups it uses "
                       f"(plan is {100 * rep.used_limit_distance:.1f}% above it)")
    if rep.search_time_s is not None:
        out.append(f"search time      {rep.search_time_s:.2f} s")
    if rep.attention:
        out.append(f"attention        {rep.attention}")
    if rep.idle_groups:
        out.append(_idle_line(rep))
    if rep.data_parallel:
        out.append(f"data parallel    {rep.data_parallel}")
    for i, line in enumerate(rep.mixed_stages):
        out.append(f"{'mixed stages' if i == 0 else '':<17}{line}")
    for i, line in enumerate(rep.tensor_parallel):
        out.append(f"{'tensor parallel' if i == 0 else '':<17}{line}")
    over = [r for r in rep.stages if not r.fits]
    if not rep.feasible or over:
        why = rep.reason or ", ".join(f"stage {r.index} needs {r.peak_memory_gb:.1f} GB of "
                                      f"{r.capacity_gb:.0f} GB" for r in over)
        out.append(f"memory           DOES NOT FIT: {why}")
    elif any(r.capacity_gb is not None for r in rep.stages):
        out.append("memory           fits on every GPU")
    for i, line in enumerate(rep.sharding):
        out.append(f"{'sharded state' if i == 0 else '':<17}{line}")
    if rep.baselines:
        out += ["", "baseline                 iteration     plan speed-up"]
        for b in rep.baselines:
            if b.iteration_s is None:
                out.append(f"{b.name:<24} infeasible: {b.reason}")
            else:
                out.append(f"{b.name:<24} {_fmt_s(b.iteration_s):>12}  {b.speedup:>8.2f}x")
    return "\n".join(out)


def _idle_line(rep: PlanReport) -> str:
    """Which groups sit idle, and (after a search) what using them too would cost."""
    why = "left idle by the plan"
    if rep.all_groups_s is not None:
        why = (f"faster without them: {_fmt_s(rep.iteration_s)} per iteration, "
               f"{_fmt_s(rep.all_groups_s)} with every group")
    return (f"idle groups      {', '.join(rep.idle_groups)} ({why}); launch only the "
            f"{sum(len(r.ranks) for r in rep.stages)} ranks of the groups in the table")


def report_to_dict(rep: PlanReport) -> dict[str, Any]:
    """JSON-ready form of the report (``hapt-hf plan --json``)."""
    d = asdict(rep)
    d["limit_distance"] = rep.limit_distance
    d["used_limit_distance"] = rep.used_limit_distance
    for row, src in zip(d["stages"], rep.stages):
        row["fits"] = src.fits
        row["ranks"] = list(src.ranks)
        row["layers"] = list(src.layers)
    return d
