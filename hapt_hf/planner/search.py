"""The planner's search: group order, stage shapes, layer ranges, micro-batch, warm-ups.

How it searches (every step deterministic):

1. Candidate *shapes*: for every group, every number of stages ``k`` it can be cut into, with
   widths as equal as the global batch allows (any integer, not only powers of two), and every
   micro-batch size that is a multiple of all widths and divides the global batch.
2. Each (shapes, micro-batch) gets an optimistic bound ``(M + n - 1) * T_bal``, where ``T_bal``
   is the per-micro-batch time if every stage were perfectly balanced. Candidates are expanded in
   order of that bound and the expansion stops once the bound passes the best estimate found.
3. Expanding a candidate tries every order of the groups along the pipeline whose neighbours are
   linked, and cuts the layers by a min-max partition: a binary search on the cap of a stage's
   time, with a greedy that gives each stage the longest range within the cap and its GPUs'
   memory (switching on recompute when only that fits). The result is scored with HAPT's
   formula ``sum(stage) + (M - 1) * max(stage, cut)``.
4. The best few are replayed in the event simulator; for H-1F1B their warm-up depths start from
   HAPT's 1/2/3 thresholds and are refined one slow link at a time by simulation; then the layer
   boundaries of the best plan are moved one layer at a time while the simulation improves.
5. The baselines' plans are candidates too, so the planner never returns a slower plan.

Simulations inside the search cap the number of micro-batches and extrapolate the steady state
linearly (see :func:`_simulate`); the returned plan is always replayed in full.
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, field, replace

from .cluster import Cluster, GpuGroup
from .cost_model import DEFAULT_EFFICIENCY, CostModel, StageShape
from .model_spec import ModelSpec
from .plan import SCHEDULES, Plan, PlanPrediction, StagePlan, StagePrediction
from .profile import Profile, load_sailor_profiles
from .simulate import SimResult, encode_warmup_schedule, replay

__all__ = ["PlanningError", "PlannerOptions", "BaselineResult", "PlanResult", "Layout",
           "plan_job", "physical_limit_s", "cluster_profile"]


LAYER_UNIT_OPTIONS = ("auto", "block", "half")


class PlanningError(ValueError):
    """No plan is possible (or an option is wrong); the message says what would fix it."""


@dataclass(frozen=True)
class PlannerOptions:
    schedule: str = "h1f1b"
    """'gpipe', '1f1b' or 'h1f1b' (1F1B with per-stage warm-up depths)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batch sizes to consider; None: every size the widths and global batch allow."""
    allow_recompute: bool = True
    """Let a stage recompute its blocks' activations when that is the only way it fits."""
    memory_headroom: float = 0.9
    """Fraction of each GPU's memory a plan may use."""
    max_stages: int | None = None
    """Upper bound on the pipeline depth; None: the number of layers."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of peak TFLOP/s assumed where no profile measured a layer."""
    simulate_top: int = 4
    """How many of the best analytic candidates are replayed in the simulator."""
    simulate_top_cheap: int = 12
    """Replayed instead when a candidate's replay is cheap (stages x micro-batches <= 512)."""
    max_expansions: int = 1500
    """Cap on (shapes, micro-batch, order) partitions tried: bounds the search time."""
    patience: int = 300
    """Stop after this many partitions in a row that do not enter the best few."""
    order_probe: int = 3
    """Candidates that try every group order before the search keeps only the best orders."""
    orders_kept: int = 4
    """Group orders kept after the probe."""
    max_shape_combos: int = 5000
    """Above this many ways to cut the groups, only equal widths inside a group are tried."""
    max_refine_simulations: int = 60
    """Cap on simulations spent moving layer boundaries of the best plan."""
    include_baselines: bool = True
    """Score the baselines too and keep the planner's plan no slower than any of them."""
    layer_unit: str = "auto"
    """What the planner cuts between: 'block' (whole transformer blocks), 'half' (HAPT's
    fine-grained layers: attention and MLP halves of each block) or 'auto' (search both, keep
    the faster plan; whole blocks on a tie, and where the family's blocks cannot be halved)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanningError(f"schedule {self.schedule!r} is unknown; use one of {SCHEDULES}")
        if not 0 < self.memory_headroom <= 1:
            raise PlanningError(f"memory_headroom {self.memory_headroom} must be in (0, 1]: "
                                "the fraction of each GPU's memory a plan may use")
        if self.max_stages is not None and self.max_stages < 1:
            raise PlanningError(f"max_stages {self.max_stages} must be >= 1 (or None)")
        if self.micro_batch_sizes is not None and any(m < 1 for m in self.micro_batch_sizes):
            raise PlanningError(f"micro_batch_sizes {self.micro_batch_sizes} must all be >= 1")
        if not 0 < self.efficiency <= 1:
            raise PlanningError(f"efficiency {self.efficiency} must be in (0, 1]")
        if self.layer_unit not in LAYER_UNIT_OPTIONS:
            raise PlanningError(f"layer_unit {self.layer_unit!r} is unknown; use one of "
                                f"{LAYER_UNIT_OPTIONS}")


@dataclass(frozen=True)
class Layout:
    """A candidate pipeline before it becomes a Plan."""

    shapes: tuple[StageShape, ...]
    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    micro_batch_size: int
    warmups: tuple[int, ...]
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.shapes)


@dataclass(frozen=True)
class BaselineResult:
    name: str
    plan: Plan | None
    sim: SimResult | None
    reason: str = ""
    """Why the baseline has no plan (e.g. it does not fit in memory)."""


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    sim: SimResult
    baselines: dict[str, BaselineResult]
    search_time_s: float
    physical_limit_s: float
    """Forward + backward work of the global batch over the sum of every GPU's speed."""
    candidates_tried: int = 0


# -- shapes ----------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split(size: int, k: int, allowed: set[int]) -> tuple[int, ...] | None:
    """``size`` GPUs as ``k`` stage widths from ``allowed``, as equal as possible, widest first."""
    if size % k == 0 and size // k in allowed:
        return (size // k,) * k
    best = None
    for hi in sorted(allowed):
        for lo in sorted(allowed):
            if lo >= hi:
                break
            # x stages of width hi, k - x of width lo
            if (size - k * lo) % (hi - lo):
                continue
            x = (size - k * lo) // (hi - lo)
            if 0 < x < k and (best is None or hi / lo < best[0]):
                best = (hi / lo, (hi,) * x + (lo,) * (k - x))
    return best[1] if best else None


def width_options(group: GpuGroup, global_batch: int, max_k: int) -> list[tuple[int, ...]]:
    """Ways to cut one group into stages (widths per stage), fewest stages first."""
    allowed = {d for d in _divisors(global_batch) if d <= group.size}
    out = []
    for k in range(1, min(group.size, max_k) + 1):
        w = _split(group.size, k, allowed)
        if w is not None:
            out.append(w)
    return out


def group_orders(cluster: Cluster, limit: int = 720) -> list[tuple[GpuGroup, ...]]:
    """Orders of all groups along the pipeline in which every pair of neighbours is linked."""
    names = {frozenset((l.a, l.b)) for l in cluster.links}
    out = []
    for perm in itertools.permutations(cluster.groups):
        if all(frozenset((a.name, b.name)) in names for a, b in zip(perm, perm[1:])):
            out.append(perm)
            if len(out) >= limit:
                break
    return out


def shapes_for(order: tuple[GpuGroup, ...],
               widths: dict[str, tuple[int, ...]]) -> tuple[StageShape, ...]:
    shapes = []
    for g in order:
        off = 0
        for w in widths[g.name]:
            shapes.append(StageShape(g, w, off))
            off += w
    return tuple(shapes)


def micro_batch_options(global_batch: int, widths: list[int],
                        wanted: tuple[int, ...] | None) -> list[int]:
    l = math.lcm(*widths) if widths else 1
    opts = [m for m in _divisors(global_batch) if m % l == 0]
    if wanted is not None:
        opts = [m for m in opts if m in wanted]
    return opts


# -- warm-ups --------------------------------------------------------------------------------

def hapt_warmups(shapes, cut_s: list[float], cap_s: float, num_microbatches: int,
                 schedule: str) -> tuple[int, ...]:
    """Warm-up depths: GPipe runs all forwards first; 1F1B gives stage i ``n - i``; H-1F1B adds
    1 per stage inside a group and 1, 2 or 3 across a group link whose transfer takes under a
    tenth, under a half, or more of the stage-time cap (HAPT's thresholds)."""
    n, m = len(shapes), num_microbatches
    if schedule == "gpipe":
        return (m,) * n
    warm = [1] * n
    for i in range(n - 2, -1, -1):
        inc = 1
        if schedule == "h1f1b" and shapes[i].group.name != shapes[i + 1].group.name:
            ratio = cut_s[i] / cap_s if cap_s > 0 else 1.0
            inc = 1 if ratio < 0.1 else 2 if ratio < 0.5 else 3
        warm[i] = warm[i + 1] + inc
    return tuple(min(w, m) for w in warm)


# -- layer partition -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Partition:
    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    cap_s: float


def _stage_reach(cm: CostModel, sh: StageShape, samples: int, in_flight: int, a: int, cap: float,
                 limit: int, allow_rc: bool, mem_pre, mem_pre_rc) -> tuple[int, bool]:
    """Farthest end b (<= limit) of a stage starting at a; (a, _) when nothing fits."""
    t = cm.table(sh.group, samples)
    capacity = cm.capacity_bytes(sh.group)
    best = (a, False)
    for rc in ((False, True) if allow_rc else (False,)):
        pre_t = t.fb_rc if rc else t.fb
        mp = mem_pre_rc if rc else mem_pre
        b = min(limit, cm.max_layers_fitting(pre_t, a, cap),
                cm.max_layers_fitting(mp, a, capacity))
        while b > a and mp[b] - mp[a] + cm.working_bytes(samples, a, b) > capacity:
            b -= 1
        if b > best[0]:
            best = (b, rc)
    return best


def _mem_prefix(cm: CostModel, samples: int, in_flight: int, rc: bool) -> list[float]:
    return cm.memory_prefix(samples, in_flight, rc)


def partition_layers(cm: CostModel, shapes, mbs: int, in_flight: list[int],
                     allow_recompute: bool, rel_tol: float = 1e-3,
                     lower_bound_s: float = 0.0) -> _Partition | None:
    """Min-max contiguous partition of the layers over ``shapes`` (no empty stage) under every
    stage's memory; None if no partition fits."""
    n, L = len(shapes), cm.model.num_layers
    if n > L:
        return None
    info = []
    for sh, k in zip(shapes, in_flight):
        s = mbs // sh.width
        info.append((sh, s, k, _mem_prefix(cm, s, k, False),
                     _mem_prefix(cm, s, k, True) if allow_recompute else None))

    def greedy(cap: float):
        a, bounds, rcs = 0, [], []
        for i, (sh, s, k, mp, mpr) in enumerate(info):
            limit = L - (n - i - 1)
            b, rc = _stage_reach(cm, sh, s, k, a, cap, limit, allow_recompute, mp, mpr)
            if b <= a:
                return None
            bounds.append((a, b))
            rcs.append(rc)
            a = b
        return (tuple(bounds), tuple(rcs)) if a == L else None

    # no partition beats the perfectly balanced step, so start there and double until it fits
    top = max(cm.table(sh.group, s).fb_rc[-1] for sh, s, *_ in info) * 1.001
    lo = min(lower_bound_s, top) if lower_bound_s > 0 else 0.0
    hi = max(lo * 1.25, top * 1e-3)
    got = greedy(hi)
    while got is None and hi < top:
        lo, hi = hi, min(hi * 2, top)
        got = greedy(hi)
    if got is None:
        return None
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        g = greedy(mid)
        if g is None:
            lo = mid
        else:
            hi, got = mid, g
    return _Partition(got[0], got[1], hi)


# -- scoring ---------------------------------------------------------------------------------

def _cuts(cm: CostModel, shapes, bounds, mbs: int) -> list[float]:
    return [cm.cut_s(shapes[i], shapes[i + 1], bounds[i][1] - 1, mbs)
            for i in range(len(shapes) - 1)]


def estimate_s(cm: CostModel, layout: Layout, num_microbatches: int) -> float:
    """HAPT's pipeline formula: fill and drain plus (M - 1) times the slowest stage or cut."""
    costs = cm.stage_costs(list(layout.shapes), list(layout.bounds), layout.micro_batch_size,
                           layout.recompute)
    st = costs.stages
    steps = [c.forward_s + c.backward_s for c in st]
    cuts = [c.send_forward_s for c in st[:-1]]
    period = max(steps + cuts)
    # the drain runs upstream: stage i's last backward ends the earlier by the backward and
    # cut times of the stages before it, so its all-reduce and step overlap theirs (the part
    # of its all-reduce that its own last backward hides adds nothing)
    tail, ahead = 0.0, 0.0
    for i, c in enumerate(st):
        tail = max(tail, c.allreduce_after_s + c.update_s - ahead)
        ahead += c.backward_s + (cuts[i - 1] if i > 0 else 0.0)
    return sum(steps) + 2 * sum(cuts) + (num_microbatches - 1) * period + tail


@functools.lru_cache(maxsize=64)
def _encoded(n: int, m: int, warmups: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    # the refinements replay the same action lists with other costs many times over
    return tuple(map(tuple, encode_warmup_schedule(n, m, warmups)))


def _steady_cap(layout: Layout) -> int:
    return max(STEADY_MIN_MICROBATCHES, 4 * max(layout.warmups) + 4 * layout.num_stages)


def _simulate(cm: CostModel, layout: Layout, num_microbatches: int, exact: bool = False,
              record_events: bool = False) -> SimResult:
    """Replay ``layout``. Unless ``exact``, a long iteration is replayed with fewer
    micro-batches (four times the deepest warm-up plus the pipeline depth, at least
    STEADY_MIN_MICROBATCHES) and half as many, and the time extrapolated along the steady
    state between them: the pipeline repeats the same period once it is full, so the two
    replays fix it. The period is never below the busiest stage's compute or link per
    micro-batch: behind deep warm-ups a slightly slower stage only paces the pipeline once
    their queue has filled, which can take longer than the short replays (on
    harp_3groups_1p3b the period measured between 32 and 64 micro-batches was 48.3 ms where
    the slowest stage needs 50.4 ms, and plans differing only there looked equal)."""
    costs = cm.stage_costs(list(layout.shapes), list(layout.bounds), layout.micro_batch_size,
                           layout.recompute)

    def run(m: int) -> SimResult:
        warm = layout.warmups if layout.schedule != "gpipe" else (m,) * layout.num_stages
        return replay(_encoded(layout.num_stages, m, tuple(warm)), costs, record_events)

    m = num_microbatches
    cap = _steady_cap(layout)
    if exact or m <= cap * 3 // 2 or layout.schedule == "gpipe":
        return run(m)
    m1, m2 = cap, cap // 2
    r1, r2 = run(m1), run(m2)
    if not (r1.feasible and r2.feasible) and r1.reason.startswith("deadlock"):
        return r1
    floor = max(max(c.forward_s + c.backward_s, c.send_forward_s, c.send_backward_s)
                for c in costs.stages)
    period = max((r1.iteration_s - r2.iteration_s) / (m1 - m2), floor)
    it = r1.iteration_s + (m - m1) * period
    busy = tuple(b * m / m1 for b in r1.stage_busy_s)
    bubble = 1.0 - (sum(busy) / len(busy)) / it if it > 0 else 0.0
    return replace(r1, iteration_s=it, bubble_fraction=bubble, stage_busy_s=busy, events=())


STEADY_MIN_MICROBATCHES = 64
"""Fewest micro-batches a shortened replay keeps: with fewer, the start-up transient of slow
links leaks into the extrapolated period (2% off on harp_3groups_1p3b at 32)."""


# -- plans -----------------------------------------------------------------------------------

def first_ranks(cluster: Cluster) -> dict[str, int]:
    out, start = {}, 0
    for g in cluster.groups:
        out[g.name] = start
        start += g.size
    return out


def layout_to_plan(cm: CostModel, layout: Layout, global_batch: int, sim: SimResult | None,
                   baselines: dict[str, float] | None = None) -> Plan:
    first = first_ranks(cm.cluster)
    mbs = layout.micro_batch_size
    costs = cm.stage_costs(list(layout.shapes), list(layout.bounds), mbs, layout.recompute)
    stages = []
    for i, (sh, bnd, rc, w, c) in enumerate(zip(layout.shapes, layout.bounds, layout.recompute,
                                                 layout.warmups, costs.stages)):
        r0 = first[sh.group.name] + sh.offset
        peak = sim.peak_memory_bytes[i] if sim and sim.peak_memory_bytes else 0.0
        stages.append(StagePlan(
            index=i, layers=bnd, group=sh.group.name, device_type=sh.group.gpu.name,
            ranks=tuple(range(r0, r0 + sh.width)), warmup=w, recompute=rc,
            predicted=StagePrediction(c.forward_s, c.backward_s, peak)))
    m = cm.model
    pred = PlanPrediction()
    if sim is not None and sim.feasible:
        pred = PlanPrediction(sim.iteration_s, global_batch * m.seq_len / sim.iteration_s,
                              sim.bubble_fraction)
    return Plan(model_name=m.name, num_layers=m.num_layers, seq_len=m.seq_len,
                global_batch_size=global_batch, micro_batch_size=mbs,
                num_microbatches=global_batch // mbs, schedule=layout.schedule,
                stages=tuple(stages), dtype=m.dtype, predicted=pred,
                cluster_name=cm.cluster.name, baselines=dict(baselines or {}),
                layer_unit=m.layer_unit)


def layout_of_plan(cm: CostModel, plan: Plan) -> Layout:
    return Layout(tuple(cm.shapes_of(plan)), tuple(s.layers for s in plan.stages),
                  tuple(s.recompute for s in plan.stages), plan.micro_batch_size,
                  tuple(plan.warmups()), plan.schedule)


def physical_limit_s(cm: CostModel, global_batch: int) -> float:
    """Global batch x (forward + backward time per sample) over the sum of all GPUs' speeds.

    A GPU's speed is samples per second through the whole model at its best per-replica batch:
    analytic figures do not depend on the batch; with a profile, the best of the batch sizes it
    measured for that device (and 1)."""
    rate = 0.0
    for g in cm.cluster.groups:
        sizes = {1}
        if cm.profile is not None:
            sizes.update(cm.profile.micro_batches(g.gpu.name))
        rate += g.size / cm.best_sample_time_s(g, sorted(sizes))
    return global_batch / rate


def cluster_profile(cluster: Cluster, model: ModelSpec) -> Profile | None:
    """The measured profiles a cluster file names (``profiles:``), or None."""
    if cluster.profiles is None:
        return None
    return load_sailor_profiles(cluster.profiles, model)


# -- the search ------------------------------------------------------------------------------

@dataclass(order=True)
class _Scored:
    score: float
    key: tuple
    layout: Layout = field(compare=False)


def _in_flight(shapes, mbs: int, m: int, schedule: str, cm: CostModel,
               cap_guess: float) -> list[int]:
    if schedule == "gpipe":
        return [m] * len(shapes)
    # cut times at a block boundary stand in for the real boundaries (blocks are alike)
    mid = min(1, cm.model.num_layers - 1)
    cuts = [cm.cut_s(shapes[i], shapes[i + 1], mid, mbs) for i in range(len(shapes) - 1)]
    return list(hapt_warmups(shapes, cuts, cap_guess, m, schedule))


def _balanced_step_s(cm: CostModel, shapes, mbs: int) -> float:
    """Per-micro-batch time if every stage carried work in proportion to its speed."""
    rate = sum(cm.replica_rate(sh.group, mbs // sh.width) * sh.width for sh in shapes)
    return mbs / rate


def _expand(cm: CostModel, shapes, mbs: int, m: int, options: PlannerOptions,
            key: tuple) -> _Scored | None:
    cap_guess = _balanced_step_s(cm, shapes, mbs)
    inflight = _in_flight(shapes, mbs, m, options.schedule, cm, cap_guess)
    part = partition_layers(cm, shapes, mbs, inflight, options.allow_recompute,
                            lower_bound_s=cap_guess)
    if part is None:
        return None
    cuts = _cuts(cm, shapes, part.bounds, mbs)
    warm = hapt_warmups(shapes, cuts, part.cap_s, m, options.schedule)
    layout = Layout(tuple(shapes), part.bounds, part.recompute, mbs, warm, options.schedule)
    return _Scored(estimate_s(cm, layout, m), key, layout)


def _candidates(cm: CostModel, global_batch: int, options: PlannerOptions):
    """(bound, key, widths, mbs) for every stage-shape choice, most promising first."""
    L = cm.model.num_layers
    max_n = min(L, options.max_stages or L)
    per_group = [width_options(g, global_batch, max_n) for g in cm.cluster.groups]
    if math.prod(len(o) for o in per_group) > options.max_shape_combos:
        # at scale, keep equal widths inside a group (unequal ones only where none is equal)
        per_group = [[w for w in o if len(set(w)) == 1] or o for o in per_group]
    total_static = cm.static_bytes(0, L)
    out = []
    for combo in itertools.product(*per_group):
        n = sum(len(w) for w in combo)
        if n > max_n:
            continue
        # every replica of a stage holds the stage's weights and optimizer state, so the
        # stages' memories together must hold the whole model's at least once
        if sum(cm.capacity_bytes(g) * len(ws) for g, ws in zip(cm.cluster.groups, combo)) \
                < total_static:
            continue
        widths = {g.name: w for g, w in zip(cm.cluster.groups, combo)}
        flat = [w for ws in combo for w in ws]
        for mbs in micro_batch_options(global_batch, flat, options.micro_batch_sizes):
            m = global_batch // mbs
            rate = sum(cm.replica_rate(g, mbs // w) * w
                       for g, ws in zip(cm.cluster.groups, combo) for w in ws)
            bound = (m + n - 1) * mbs / rate
            out.append((bound, (n, mbs, tuple(combo)), widths, mbs))
    out.sort(key=lambda c: (c[0], c[1]))
    return out


def _signature(cm: CostModel, layout: Layout) -> tuple:
    """What prices a layout: its GPUs, widths, places, links and cuts (not group names)."""
    sh = layout.shapes
    gpus = tuple((s.group.gpu, s.width, s.offset, s.group.gpus_per_node, s.group.intra_node,
                  s.group.inter_node) for s in sh)
    links = tuple(cm.group_link(a.group.name, b.group.name) if a.group.name != b.group.name
                  else None for a, b in zip(sh, sh[1:]))
    return gpus, links, layout.bounds, layout.micro_batch_size


def _twin(cm: CostModel, a: _Scored, b: _Scored) -> bool:
    return math.isclose(a.score, b.score, rel_tol=1e-12) and \
        _signature(cm, a.layout) == _signature(cm, b.layout)


def _search_layouts(cm: CostModel, global_batch: int, options: PlannerOptions):
    orders = group_orders(cm.cluster)
    if not orders:
        raise PlanningError("no order of the groups has a link between every pair of "
                            "neighbours; add links under 'links:' so the groups form a chain")
    best: list[_Scored] = []
    tried = expanded = last_gain = 0
    keep = max(options.simulate_top, options.simulate_top_cheap)
    order_score = [math.inf] * len(orders)
    active = list(range(len(orders)))
    for bound, key, widths, mbs in _candidates(cm, global_batch, options):
        if len(best) >= options.simulate_top and bound > best[options.simulate_top - 1].score:
            break
        if tried >= options.max_expansions or tried - last_gain > options.patience:
            break
        if expanded == options.order_probe and len(orders) > options.orders_kept:
            # the first candidates rank the orders (links and memory by position decide it);
            # later ones try only the best few orders
            ranked = sorted(range(len(orders)), key=lambda o: (order_score[o], o))
            active = sorted(ranked[:options.orders_kept])
        m = global_batch // mbs
        any_fit = False
        for oi in active:
            tried += 1
            sc = _expand(cm, shapes_for(orders[oi], widths), mbs, m, options, key + (oi,))
            if sc is None:
                continue
            any_fit = True
            order_score[oi] = min(order_score[oi], sc.score)
            if any(_twin(cm, sc, b) for b in best):
                continue  # an order of alike groups that prices the same: keep one
            if len(best) < options.simulate_top or sc < best[options.simulate_top - 1]:
                last_gain = tried
            best.append(sc)
            best.sort()
            del best[keep:]
        expanded += any_fit
    return best, tried


def _refine_warmups(cm: CostModel, layout: Layout, m: int,
                    sim: SimResult | None = None) -> tuple[Layout, SimResult]:
    """Try other warm-up steps across each group link (every cut, in short pipelines), one cut
    at a time, and keep the fastest replay that fits in memory."""
    best_l = layout
    best_r = sim if sim is not None else _simulate(cm, layout, m)
    if layout.schedule != "h1f1b":
        return best_l, best_r
    n = layout.num_stages
    cuts = [i for i in range(n - 1)
            if n <= 4 or layout.shapes[i].group.name != layout.shapes[i + 1].group.name]
    for i in cuts:
        steps = [best_l.warmups[j] - best_l.warmups[j + 1] for j in range(n - 1)]
        for step in (1, 2, 3, 4, 6, 8):
            if step == steps[i]:
                continue
            trial = list(steps)
            trial[i] = step
            warm = [1] * n
            for j in range(n - 2, -1, -1):
                warm[j] = warm[j + 1] + max(trial[j], 1)
            cand = replace(best_l, warmups=tuple(min(w, m) for w in warm))
            if cand.warmups == best_l.warmups:
                continue
            r = _simulate(cm, cand, m)
            if _better(r, best_r):
                best_l, best_r = cand, r
    return best_l, best_r


def _as_schedule(layout: Layout, schedule: str, m: int) -> Layout:
    """The same partition under the planner's schedule. 1F1B is H-1F1B with one warm-up step
    per stage, so a 1F1B baseline keeps its depths (and its replay) under H-1F1B."""
    if layout.schedule == schedule:
        return layout
    if schedule == "h1f1b" and layout.schedule == "1f1b":
        return replace(layout, schedule=schedule)
    n = layout.num_stages
    return replace(layout, schedule=schedule,
                   warmups=hapt_warmups(layout.shapes, [0.0] * (n - 1), 1.0, m, schedule))


def _better(a: SimResult, b: SimResult) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    return a.iteration_s < b.iteration_s * (1 - 1e-9)


def _fits_recompute(cm: CostModel, layout: Layout, i: int, a: int, b: int, in_flight: int,
                    allow_rc: bool) -> bool | None:
    """Recompute flag that lets stage i hold [a, b), preferring none; None if neither fits."""
    sh = layout.shapes[i]
    s = layout.micro_batch_size // sh.width
    cap = cm.capacity_bytes(sh.group)
    for rc in ((False, True) if allow_rc else (False,)):
        if cm.memory_bytes(s, a, b, in_flight, rc) <= cap:
            return rc
    return None


def _moves(n: int):
    """Boundary moves: one boundary by one layer, or two neighbouring boundaries together
    (which shifts a whole stage by one layer)."""
    for i in range(n - 1):
        for d in (-1, 1):
            yield (i,), d
    for i in range(n - 2):
        for d in (-1, 1):
            yield (i, i + 1), d


def _moved(layout: Layout, idx: tuple[int, ...], d: int):
    edges = [a for a, _ in layout.bounds] + [layout.bounds[-1][1]]
    for i in idx:
        edges[i + 1] += d
    if any(b <= a for a, b in zip(edges, edges[1:])):
        return None
    return tuple(zip(edges, edges[1:]))


def _refine_boundaries(cm: CostModel, layout: Layout, sim: SimResult, m: int,
                       options: PlannerOptions, budget: int) -> tuple[Layout, SimResult]:
    """Move layer boundaries by one while the replay improves (at most ``budget`` replays)."""
    improved = True
    while improved and budget > 0:
        improved = False
        for idx, d in _moves(layout.num_stages):
            if budget <= 0:
                break
            bounds = _moved(layout, idx, d)
            if bounds is None:
                continue
            inflight = sim.peak_in_flight or layout.warmups
            rcs = []
            for j, (a, b) in enumerate(bounds):
                rc = _fits_recompute(cm, layout, j, a, b, inflight[j], options.allow_recompute)
                if rc is None:
                    break
                rcs.append(rc)
            if len(rcs) != len(bounds):
                continue
            cand = replace(layout, bounds=bounds, recompute=tuple(rcs))
            budget -= 1
            r = _simulate(cm, cand, m)
            if _better(r, sim):
                layout, sim, improved = cand, r, True
    return layout, sim


def plan_job(model: ModelSpec, cluster: Cluster, global_batch_size: int,
             profile: Profile | None = None,
             options: PlannerOptions = PlannerOptions()) -> PlanResult:
    """Search the plan with the least simulated iteration time that fits every GPU's memory.

    ``options.layer_unit`` says whether stages may end inside a block (its attention half on one
    stage, its MLP half on the next); baselines always cut whole blocks, as frameworks do."""
    t0 = time.perf_counter()
    if global_batch_size < 1:
        raise PlanningError(f"global_batch_size {global_batch_size} must be >= 1")
    if not cluster.groups:
        raise PlanningError(f"cluster {cluster.name!r} has no groups; list at least one")
    if options.micro_batch_sizes is not None and \
            not any(global_batch_size % m == 0 for m in options.micro_batch_sizes):
        raise PlanningError(f"micro_batch_sizes {list(options.micro_batch_sizes)}: none divides "
                            f"global_batch_size {global_batch_size}; give a divisor of it")
    models = _unit_models(model, options.layer_unit)
    profile = profile if profile is not None else cluster_profile(cluster, model)
    cm = CostModel(model, cluster, profile, options.efficiency, options.memory_headroom)
    baselines: dict[str, BaselineResult] = {}
    if options.include_baselines:
        from .baselines import baseline_plans  # baselines build on this module's helpers
        baselines = baseline_plans(model, cluster, global_batch_size, profile, options, cm)
    found, tried, failure = [], 0, None
    for unit_model in models:
        unit_cm = cm if unit_model is model else CostModel(
            unit_model, cluster, profile, options.efficiency, options.memory_headroom)
        try:
            lay, final, n = _search_unit(unit_cm, global_batch_size, options, baselines)
        except PlanningError as e:  # the other unit may still fit
            failure = failure or e
            continue
        tried += n
        found.append((final.iteration_s, len(found), unit_cm, lay, final))
    if not found:
        raise failure
    _, _, unit_cm, lay, final = min(found, key=lambda f: f[:2])
    base_times = {k: b.sim.iteration_s for k, b in baselines.items()
                  if b.sim is not None and b.sim.feasible}
    plan = layout_to_plan(unit_cm, lay, global_batch_size, final, base_times).validate()
    return PlanResult(plan, final, baselines, time.perf_counter() - t0,
                      physical_limit_s(cm, global_batch_size), tried)


def _unit_models(model: ModelSpec, layer_unit: str) -> list[ModelSpec]:
    """The layer sequences to search: whole blocks, halves, or both (blocks first)."""
    if model.layer_unit == "half" or layer_unit == "block":
        return [model]
    if layer_unit == "half":
        try:
            return [model.split_blocks()]
        except ValueError as e:
            raise PlanningError(str(e)) from None
    return [model, model.split_blocks()] if model.can_split_blocks else [model]


def _in_units(cm: CostModel, plan: Plan) -> Layout:
    """A whole-block (baseline) plan as a layout over ``cm``'s layer sequence."""
    lay = layout_of_plan(cm, plan)
    if cm.model.layer_unit == plan.layer_unit:
        return lay
    last = plan.num_layers  # block boundary b > 0 ends after block b - 2's MLP half
    half = {b: 0 if b == 0 else cm.model.num_layers if b == last else 2 * b - 1
            for bnd in lay.bounds for b in bnd}
    return replace(lay, bounds=tuple((half[a], half[b]) for a, b in lay.bounds))


def _search_unit(cm: CostModel, global_batch_size: int, options: PlannerOptions,
                 baselines: dict[str, BaselineResult]) -> tuple[Layout, SimResult, int]:
    """The best layout over ``cm``'s layer sequence, never slower than a baseline's."""
    top, tried = _search_layouts(cm, global_batch_size, options)
    scored: list[tuple[SimResult, Layout]] = []
    # the analytic ranking is rough: replay more candidates when replays are cheap
    top = [sc for i, sc in enumerate(top) if i < options.simulate_top or
           sc.layout.num_stages * global_batch_size // sc.layout.micro_batch_size <= 512]
    for sc in top:
        m = global_batch_size // sc.layout.micro_batch_size
        lay, r = _refine_warmups(cm, sc.layout, m)
        scored.append((r, lay))
    for b in baselines.values():
        if b.plan is not None:
            lay = _as_schedule(_in_units(cm, b.plan), options.schedule,
                               b.plan.num_microbatches)
            scored.append((_simulate(cm, lay, b.plan.num_microbatches), lay))
    own = len(top)
    feasible = [(r.iteration_s, i, lay, r) for i, (r, lay) in enumerate(scored) if r.feasible]
    if not feasible:
        raise _does_not_fit(cm, global_batch_size, options)
    feasible.sort(key=lambda x: x[:2])
    # the partition balances compute only; moving boundaries by simulation also weighs
    # transfers, all-reduce and the optimizer step, so every finalist gets a share of it:
    # the search's own candidates and the best baseline
    finalists = [(r, lay) for _, i, lay, r in feasible if i < own]
    finalists += [(r, lay) for _, i, lay, r in feasible if i >= own][:1]
    share = max(options.max_refine_simulations // len(finalists), 8)
    refined = []
    for r, lay in finalists:
        m = global_batch_size // lay.micro_batch_size
        lay, r = _refine_boundaries(cm, lay, r, m, options, share)
        lay, r = _refine_warmups(cm, lay, m, r)
        refined.append((r.iteration_s, len(refined), lay))
    _, _, lay = min(refined)
    m = global_batch_size // lay.micro_batch_size
    final = _simulate(cm, lay, m, exact=True, record_events=True)
    if not final.feasible:  # extrapolation cannot change feasibility; guard anyway
        raise PlanningError(f"the chosen plan cannot run: {final.reason}")
    # never return a plan slower than a baseline's (the extrapolated ranking could err)
    for b in baselines.values():
        if b.sim is None or not b.sim.feasible or b.plan is None or \
                b.sim.iteration_s >= final.iteration_s:
            continue
        blay = _as_schedule(_in_units(cm, b.plan), options.schedule, b.plan.num_microbatches)
        r = _simulate(cm, blay, b.plan.num_microbatches, exact=True, record_events=True)
        if r.feasible and r.iteration_s < final.iteration_s:
            lay, final = blay, r
    return lay, final, tried


# -- when nothing fits -----------------------------------------------------------------------

def _fill(cm: CostModel, caps: list[float], extra: float = 0.0) -> int:
    """Layers that GPUs of these capacities (one stage each, one sample in flight, recompute
    on) hold when each takes as many as fit, in order."""
    L, a = cm.model.num_layers, 0
    for cap in caps:
        b = a
        while b < L and cm.memory_bytes(1, a, b + 1, 1, True) <= cap + extra:
            b += 1
        a = b
        if a == L:
            break
    return a


def _does_not_fit(cm: CostModel, global_batch: int, options: PlannerOptions) -> PlanningError:
    L = cm.model.num_layers
    caps = sorted((cm.capacity_bytes(g) for g in cm.cluster.groups for _ in range(g.size)),
                  reverse=True)
    if _fill(cm, caps) < L:
        # the bytes each GPU lacks: the least extra capacity that lets the GPUs hold it all
        lo, hi = 0.0, max(cm.memory_bytes(1, 0, L, 1, True), 1.0)
        while hi - lo > max(1e6, 1e-4 * hi):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if _fill(cm, caps, mid) == L else (mid, hi)
        big = max(cm.cluster.groups, key=lambda g: (g.gpu.memory_gb, g.name))
        cap_big = cm.capacity_bytes(big)
        done, more = _fill(cm, caps), 0
        while done < L:  # keep adding the largest GPU of the cluster, one stage each
            nxt = _fill_from(cm, done, cap_big)
            if nxt == done:
                break
            done, more = nxt, more + 1
        fix = (f"{more} more {big.gpu.name} GPUs would fit it" if done == L else
               f"a single layer needs more than one {big.gpu.name} holds; use GPUs with more "
               "memory")
        return PlanningError(
            f"model {cm.model.name!r} does not fit on cluster {cm.cluster.name!r}: even with one "
            f"GPU per stage, recompute and one sample per micro-batch, the GPUs are short by "
            f"{hi / 1e9:.2f} GB per GPU; {fix} (or raise memory_headroom, now "
            f"{options.memory_headroom})")
    return PlanningError(
        f"no plan of model {cm.model.name!r} fits cluster {cm.cluster.name!r} with global batch "
        f"{global_batch}: the micro-batch sizes allowed by the stage widths need more memory "
        "than the GPUs have; try a global batch divisible by more widths, allow_recompute=True, "
        "or more GPUs")


def _fill_from(cm: CostModel, a: int, cap: float) -> int:
    b, L = a, cm.model.num_layers
    while b < L and cm.memory_bytes(1, a, b + 1, 1, True) <= cap:
        b += 1
    return b
