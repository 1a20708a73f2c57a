"""The search's settings and records: what the user asks for, a candidate, the result."""
from __future__ import annotations

from dataclasses import dataclass, field

from hapt_hf.core.defaults import DEFAULT_MEMORY_HEADROOM
from hapt_hf.core.layers import BLOCK, HALF
from hapt_hf.core.precision import REPLICATED
from hapt_hf.core.schedules import SCHEDULES, ScheduleKind
from hapt_hf.core.tp import TP_DEGREES
from hapt_hf.errors import PlanningError

from ..cost_model import DEFAULT_EFFICIENCY
from ..plan import Plan, Replica, Stage
from ..simulate import SimResult

__all__ = ["LAYER_UNIT_OPTIONS", "PlanningError", "PlannerOptions", "Layout", "BaselineResult",
           "GroupChoice", "PlanResult"]


LAYER_UNIT_OPTIONS = ("auto", BLOCK, HALF)
"""What the search may cut between: whole blocks, block halves, or both (keep the faster)."""


@dataclass(frozen=True)
class PlannerOptions:
    """What the search may choose and how long it may look (validated on creation)."""

    schedule: str = ScheduleKind.H1F1B.value
    """'gpipe', '1f1b' or 'h1f1b' (1F1B with per-stage warm-up depths)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batch sizes to consider; None: every size the widths and global batch allow."""
    allow_recompute: bool = True
    """Let a stage recompute its blocks' activations when that is the only way it fits."""
    allow_partial_recompute: bool = True
    """Where a stage must recompute, let only its first blocks recompute, as few as let it
    fit (``Stage.recompute_layers``), instead of all of them."""
    allow_sharded_optimizer: bool = True
    """Let a stage of several replicas shard its Adam moments among them (ZeRO-1, as
    ``torch.distributed.optim.ZeroRedundancyOptimizer``): where only that fits, or fits with
    less recompute, or where its step (update of 1/d, then all-gather of the weights) is the
    faster. False: every stage keeps its whole optimizer state on every replica."""
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
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
    all_groups: bool = False
    """Use every group of the cluster. By default the search also weighs leaving whole groups
    idle (a slow group behind a slow link can cost more than it gives) and keeps the faster."""
    weigh_groups_max_gpus: int = 128
    """Above this many GPUs every group is used without weighing sets of groups: each set costs
    a search of its own (about 10 s each at 256 GPUs, 0.1 to 1 s at 16)."""
    allow_uneven_dp: bool = True
    """Weigh plain data parallelism too: one stage holding the whole model on every GPU, each
    GPU's share of every micro-batch in proportion to its speed (where the model fits every
    GPU); kept when the simulator finds it faster than every pipeline."""
    allow_mixed_stages: bool = True
    """Weigh pipeline stages that hold GPUs of several linked groups, each GPU's share of every
    micro-batch by its speed (:mod:`~hapt_hf.planner.search.mixed`: the search's best pipeline
    with a group boundary's two stages merged, and layouts whose every stage takes a slice of
    every group); kept when the simulator finds them faster. False: every pipeline stage sits
    on one group with even shares."""
    max_tp: int = 8
    """Largest tensor-parallel degree a stage's replicas may have (1, 2, 4 or 8; each group's
    replicas of ``t`` GPUs of one node, ``t`` dividing the model's attention heads, key/value
    heads and MLP width). 1: every replica is one GPU, as without tensor parallelism. The
    search keeps a degree above 1 only where the simulator finds it faster, or where nothing
    fits without it."""
    tp_screens: int = 6
    """At most this many assignments of tensor-parallel degrees to the groups are weighed
    (each a shortened search of its own; :mod:`~hapt_hf.planner.search.tensor_parallel`):
    every group at 2, 4 and 8 first, then one group at a time moved to a neighbouring
    degree."""
    tp_stage_rounds: int = 4
    """Rounds of giving the stages of one group degrees of their own after the screen
    (:func:`~hapt_hf.planner.search.tensor_parallel.refine_stage_degrees`); 0: every stage of
    a group at the group's degree."""
    weigh_kinds: bool = True
    """Under ``schedule`` 'h1f1b', also replay the search's best pipeline under
    ``zero_bubble`` (deferrals cut to each stage's memory) and ``interleaved`` (``v`` chunks
    per rank, :data:`~hapt_hf.planner.search.kinds.VIRTUAL_STAGES` or ``virtual_stages``) and
    keep the fastest that fits (:mod:`~hapt_hf.planner.search.kinds`). False: the plan keeps
    the schedule asked for."""
    allow_sequence_parallel: bool = True
    """Let a stage of replicas of several GPUs run its blocks sequence parallel (each rank
    keeps ``(34/t) / 34`` of a block's activations instead of ``(10 + 24/t) / 34``, for one
    all-gather of the stage's output forward and one backward) where the model allows it
    (:func:`~hapt_hf.core.tp.sp_refusal`: whole blocks) and it lets the stage hold more
    layers or recompute less."""
    virtual_stages: int | None = None
    """Chunks per pipeline rank of an ``interleaved`` plan (None: weigh 2 and 3)."""
    layer_unit: str = LAYER_UNIT_OPTIONS[0]
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
        if self.weigh_groups_max_gpus < 0:
            raise PlanningError(f"weigh_groups_max_gpus {self.weigh_groups_max_gpus} must be "
                                ">= 0 (0: never leave a group idle, like all_groups)")
        if self.max_tp not in TP_DEGREES:
            raise PlanningError(f"max_tp {self.max_tp!r} must be one of {TP_DEGREES} (1: no "
                                "tensor parallelism)")
        if self.tp_screens < 0:
            raise PlanningError(f"tp_screens {self.tp_screens} must be >= 0 (0: never weigh "
                                "tensor parallelism, like max_tp 1)")
        if self.tp_stage_rounds < 0:
            raise PlanningError(f"tp_stage_rounds {self.tp_stage_rounds} must be >= 0 (0: one "
                                "tensor-parallel degree per group)")
        if self.virtual_stages is not None and self.virtual_stages < 2:
            raise PlanningError(f"virtual_stages {self.virtual_stages} must be >= 2 (chunks per "
                                "pipeline rank of an interleaved plan), or None to weigh 2 and 3")
        if self.layer_unit not in LAYER_UNIT_OPTIONS:
            raise PlanningError(f"layer_unit {self.layer_unit!r} is unknown; use one of "
                                f"{LAYER_UNIT_OPTIONS}")


@dataclass(frozen=True)
class Layout:
    """A candidate pipeline before it becomes a Plan: the plan's own stages (replicas, layers,
    warm-ups, recompute, optimizer state; ranks numbered over the search's cluster), the
    micro-batch size and the schedule."""

    stages: tuple[Stage, ...]
    micro_batch_size: int
    schedule: str

    @classmethod
    def build(cls, shapes, bounds, recompute, micro_batch_size: int, warmups, schedule: str,
              optimizers=(), sequence_parallel=(), recompute_layers=()) -> "Layout":
        """A layout of stages on the replica tuples ``shapes`` with these layer ranges,
        recompute flags, warm-ups, optimizer states (empty: every stage replicated),
        sequence parallelism (empty: none) and partial recompute (empty: none)."""
        opts = tuple(optimizers) or (REPLICATED,) * len(shapes)
        sps = tuple(sequence_parallel) or (False,) * len(shapes)
        ks = tuple(recompute_layers) or (0,) * len(shapes)
        return cls(tuple(Stage(i, tuple(bnd), reps, w, rc, opt, sequence_parallel=sp,
                               recompute_layers=k)
                         for i, (reps, bnd, rc, w, opt, sp, k)
                         in enumerate(zip(shapes, bounds, recompute, warmups, opts, sps, ks))),
                   micro_batch_size, schedule)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def shapes(self) -> tuple[tuple[Replica, ...], ...]:
        """Each stage's replicas."""
        return tuple(s.replicas for s in self.stages)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return tuple(s.layers for s in self.stages)

    @property
    def recompute(self) -> tuple[bool, ...]:
        return tuple(s.recompute for s in self.stages)

    @property
    def recompute_layers(self) -> tuple[int, ...]:
        return tuple(s.recompute_layers for s in self.stages)

    @property
    def warmups(self) -> tuple[int, ...]:
        return tuple(s.warmup for s in self.stages)

    @property
    def optimizers(self) -> tuple[str, ...]:
        return tuple(s.optimizer for s in self.stages)

    @property
    def sequence_parallel(self) -> tuple[bool, ...]:
        return tuple(s.sequence_parallel for s in self.stages)

    def with_warmups(self, warmups) -> "Layout":
        # built directly, not with dataclasses.replace: the refinements make thousands
        return Layout(tuple(Stage(s.index, s.layers, s.replicas, w, s.recompute, s.optimizer,
                                  s.predicted, s.deferral, s.sequence_parallel,
                                  s.recompute_layers)
                            for s, w in zip(self.stages, warmups)),
                      self.micro_batch_size, self.schedule)

    def with_layers(self, bounds, recompute, optimizers, sequence_parallel=None,
                    recompute_layers=None) -> "Layout":
        """The same replicas and warm-ups over other layer ranges and states (sequence
        parallelism as before where ``sequence_parallel`` is None; no partial recompute where
        ``recompute_layers`` is None)."""
        sps = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        ks = (0,) * len(self.stages) if recompute_layers is None else recompute_layers
        return Layout(tuple(Stage(s.index, tuple(bnd), s.replicas, s.warmup, rc, opt, s.predicted,
                                  s.deferral, sp, k)
                            for s, bnd, rc, opt, sp, k in zip(self.stages, bounds, recompute,
                                                              optimizers, sps, ks)),
                      self.micro_batch_size, self.schedule)


@dataclass(frozen=True)
class BaselineResult:
    """One baseline split scored by the same simulator, or why it has no plan."""

    name: str
    plan: Plan | None
    sim: SimResult | None
    reason: str = ""
    """Why the baseline has no plan (e.g. it does not fit in memory)."""


@dataclass(frozen=True)
class GroupChoice:
    """One set of groups the search weighed using alone, and what it found on it."""

    kept: tuple[str, ...]
    """The groups used, in file order (the others idle)."""
    iteration_s: float | None
    """The best plan's simulated iteration time on these groups; None when not planned."""
    note: str = ""
    """Why there is no time: no plan fits, no chain of links, or a bound ruled it out."""


@dataclass(frozen=True)
class PlanResult:
    """The search's plan, its full replay, the baselines and what the search cost."""

    plan: Plan
    sim: SimResult
    baselines: dict[str, BaselineResult]
    search_time_s: float
    physical_limit_s: float
    """Forward + backward work of the global batch over the sum of every GPU's speed."""
    candidates_tried: int = 0
    group_choices: tuple[GroupChoice, ...] = ()
    """Every set of groups weighed (the whole cluster first); empty with one group."""
    sharding: dict[int, str] = field(default_factory=dict)
    """Stage index -> why that stage shards its optimizer state (sharded stages only)."""
    schedule_kinds: tuple[tuple[str, float | None], ...] = ()
    """The schedule kinds replayed on the best pipeline (name: 'h1f1b' for the search's own,
    'zero_bubble', 'interleaved v=2'...; its iteration seconds, None where it does not fit or
    cannot be built); empty where none was weighed."""

    @property
    def all_groups_s(self) -> float | None:
        """The best plan's time on every group (the first choice weighed), where one was found."""
        return self.group_choices[0].iteration_s if self.group_choices else None
