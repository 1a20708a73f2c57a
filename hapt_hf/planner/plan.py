"""The Plan: the one artefact everything downstream of the planner reads (plan.json).

A plan says, for every pipeline stage, which half-open range of the layer sequence
``[embedding, block_0 .. block_{N-1}, head]`` it holds, on which group and ranks, how wide it is
(data-parallel replicas), and how many forward micro-batches it runs before its first backward.
It can be written by the planner or by hand; :func:`Plan.validate` checks it either way.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.core.files import write_atomic
from hapt_hf.core.layers import BLOCK, HALF, LAYER_UNITS, num_blocks
from hapt_hf.core.precision import DTYPES, Precision
from hapt_hf.core.schedules import SCHEDULES, ScheduleKind, default_warmups, warmup_rule
from hapt_hf.errors import PlanError

__all__ = ["PlanError", "StagePrediction", "StagePlan", "PlanPrediction", "Plan", "SCHEDULES",
           "LAYER_UNITS"]

PLAN_VERSION = 1


@dataclass(frozen=True)
class StagePrediction:
    """What the cost model expects of one stage, per micro-batch, on one of its GPUs."""

    forward_s: float = 0.0
    """Forward time of one micro-batch on one replica of the stage, seconds."""
    backward_s: float = 0.0
    """Backward time of one micro-batch on one replica of the stage, seconds."""
    peak_memory_bytes: float = 0.0
    """Peak memory of one GPU of the stage under the plan's schedule, bytes."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous layer range on ``dp`` GPUs of one group."""

    index: int
    """Position along the pipeline, 0 = holds the embedding."""
    layers: tuple[int, int]
    """Half-open range over the layer sequence (0 = embedding, last = head)."""
    group: str
    """Name of a group of the cluster file."""
    device_type: str
    """Catalogue name of the GPUs of that group (``V100-32``, ``A100-40``, ``cpu``...)."""
    ranks: tuple[int, ...]
    """Global ranks that hold this stage; ``len(ranks) == dp``."""
    warmup: int
    """Forward micro-batches this stage runs before its first backward (1F1B: stages - index)."""
    recompute: bool = False
    """Activation checkpointing for this stage's blocks (trades compute for memory)."""
    predicted: StagePrediction = field(default_factory=StagePrediction)

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas: every micro-batch is split among them."""
        return len(self.ranks)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["ranks"] = list(self.ranks)
        d["dp"] = self.dp
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StagePlan":
        where = f"stage {d.get('index', '?')}"
        try:
            layers = tuple(int(x) for x in d["layers"])
            ranks = tuple(int(r) for r in d["ranks"])
            stage = cls(
                index=int(d["index"]),
                layers=(layers[0], layers[1]),
                group=str(d.get("group", "")),
                device_type=str(d.get("device_type", "")),
                ranks=ranks,
                warmup=int(d.get("warmup", 1)),
                recompute=bool(d.get("recompute", False)),
                predicted=StagePrediction(**d.get("predicted", {})),
            )
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}; every stage needs "
                            "'index', 'layers' [start, end) and 'ranks'") from None
        except (TypeError, ValueError, IndexError) as e:
            raise PlanError(f"{where}: malformed field ({e}); 'layers' is [start, end), "
                            "'ranks' a list of integers") from None
        if "dp" in d and int(d["dp"]) != stage.dp:
            raise PlanError(f"{where}: dp is {d['dp']} but ranks lists {stage.dp} ranks "
                            f"{list(stage.ranks)}; make them agree")
        return stage


@dataclass(frozen=True)
class PlanPrediction:
    """Whole-iteration figures from the simulator."""

    iteration_s: float = 0.0
    tokens_per_s: float = 0.0
    bubble_fraction: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A complete pipeline plan. See docs/architecture.md for the JSON format."""

    model_name: str
    num_layers: int
    """Length of the layer sequence: blocks + 2 (embedding and head)."""
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    """Samples in one micro-batch as it enters the pipeline (split among a stage's replicas)."""
    num_microbatches: int
    schedule: str
    stages: tuple[StagePlan, ...]
    dtype: str = "fp32"
    predicted: PlanPrediction = field(default_factory=PlanPrediction)
    cluster_name: str = ""
    baselines: dict[str, float] = field(default_factory=dict)
    """Predicted iteration seconds of each baseline split on the same input (informative)."""
    layer_unit: str = BLOCK
    """'block': ``num_layers = blocks + 2``; 'half': each block is two layers (attention half,
    then MLP half), ``num_layers = 2 * blocks + 2``."""
    loss_scaling: str | None = None
    """'dynamic' (fp16 compute) or None; with ``dtype`` it is the plan's ``precision``."""
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    """'eager' | 'sdpa': the attention the plan's memory was budgeted for; the runtime builds
    its stages with it."""
    idle_groups: tuple[str, ...] = ()
    """Groups of the cluster the plan leaves idle (the planner found it faster without them).
    The stages' ranks are numbered over the other groups only, in file order, so the job is
    launched on those groups alone, ``world_size`` processes."""

    @property
    def precision(self) -> Precision:
        """Compute dtype and loss scaling (fp32 master weights and Adam state in every one)."""
        return Precision(self.dtype, self.loss_scaling)

    # -- derived -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return sum(s.dp for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_rank(self, rank: int) -> StagePlan:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise PlanError(f"rank {rank} holds no stage; the plan covers ranks "
                        f"{sorted(r for s in self.stages for r in s.ranks)}")

    def warmups(self) -> list[int]:
        return [s.warmup for s in self.stages]

    def with_schedule(self, schedule: str, warmups: list[int] | None = None) -> "Plan":
        """The same partition under another schedule (default warm-ups for gpipe/1f1b)."""
        if warmups is None:
            fixed = schedule in SCHEDULES and not warmup_rule(schedule).per_stage
            warmups = (default_warmups(schedule, self.num_stages, self.num_microbatches)
                       if fixed else self.warmups())
        stages = tuple(replace(s, warmup=w) for s, w in zip(self.stages, warmups))
        return replace(self, schedule=schedule, stages=stages)

    # -- checks --------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Plan":
        """Raise PlanError naming the field if the plan is inconsistent; return self."""
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule {self.schedule!r} is unknown; use one of {SCHEDULES}")
        if self.layer_unit not in LAYER_UNITS:
            raise PlanError(f"layer_unit {self.layer_unit!r} is unknown; use one of {LAYER_UNITS} "
                            "('block' when the field is left out)")
        if self.layer_unit == HALF and self.num_layers % 2:
            raise PlanError(f"layer_unit 'half' needs an even num_layers (2 * blocks + 2), got "
                            f"{self.num_layers}; fix model.num_layers or use layer_unit 'block'")
        self._validate_precision()
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise PlanError(f"attn_implementation {self.attn_implementation!r} is unknown; use "
                            f"one of {ATTN_IMPLEMENTATIONS}")
        if not self.stages:
            raise PlanError("the plan has no stages; it needs at least one")
        if self.micro_batch_size < 1 or self.num_microbatches < 1:
            raise PlanError("micro_batch_size and num_microbatches must be >= 1, got "
                            f"{self.micro_batch_size} and {self.num_microbatches}")
        if self.micro_batch_size * self.num_microbatches != self.global_batch_size:
            raise PlanError(
                f"micro_batch_size ({self.micro_batch_size}) x num_microbatches "
                f"({self.num_microbatches}) = {self.micro_batch_size * self.num_microbatches}, "
                f"but global_batch_size is {self.global_batch_size}; make the product equal it")
        expect = 0
        seen_ranks: set[int] = set()
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise PlanError(f"stage at position {i} has index {s.index}; indices must be "
                                "0, 1, 2... in pipeline order")
            if s.layers[0] != expect:
                what = "leaves out" if s.layers[0] > expect else "overlaps"
                raise PlanError(f"stage {i} starts at layer {s.layers[0]} but the previous stage "
                                f"ends at {expect}: the plan {what} layers; stage ranges must "
                                "tile [0, num_layers) with no gap")
            if s.layers[1] <= s.layers[0]:
                raise PlanError(f"stage {i} has an empty layer range {list(s.layers)}; "
                                "every stage needs at least one layer")
            expect = s.layers[1]
            if s.dp < 1:
                raise PlanError(f"stage {i} lists no ranks; give it at least one")
            dup = seen_ranks.intersection(s.ranks)
            if dup or len(set(s.ranks)) != len(s.ranks):
                raise PlanError(f"stage {i}: rank(s) {sorted(dup) or list(s.ranks)} appear twice; "
                                "each rank holds exactly one stage")
            seen_ranks.update(s.ranks)
            if self.micro_batch_size % s.dp:
                raise PlanError(f"stage {i} has {s.dp} replicas but micro_batch_size is "
                                f"{self.micro_batch_size}; it must be a multiple of every "
                                "stage's width")
            if s.warmup < 1:
                raise PlanError(f"stage {i} has warmup {s.warmup}; it must be >= 1")
        if expect != self.num_layers:
            raise PlanError(f"the stages cover layers [0, {expect}) but the model has "
                            f"{self.num_layers}; the last stage must end at {self.num_layers}")
        if sorted(seen_ranks) != list(range(len(seen_ranks))):
            raise PlanError(f"ranks {sorted(seen_ranks)} are not 0..{len(seen_ranks) - 1}; "
                            "number the ranks without gaps")
        busy = sorted({s.group for s in self.stages} & set(self.idle_groups))
        if busy:
            raise PlanError(f"idle_groups lists {busy}, which hold stages; remove them from "
                            "idle_groups or move their stages")
        if world_size is not None and world_size != self.world_size:
            raise PlanError(self._world_mismatch(world_size))
        return self

    def _world_mismatch(self, world_size: int) -> str:
        if not self.idle_groups:
            return (f"the plan needs {self.world_size} processes but {world_size} were started; "
                    f"launch with --num_processes {self.world_size} or re-plan for {world_size}")
        kept = sorted({s.group for s in self.stages})
        return (f"the plan leaves group(s) {', '.join(self.idle_groups)} idle (it predicts a "
                f"faster iteration without them) and needs {self.world_size} processes, but "
                f"{world_size} were started; launch only the {self.world_size} processes of "
                f"group(s) {', '.join(kept)} (--num_processes {self.world_size} on their nodes), "
                "or re-plan with every group (`hapt-hf plan --all-groups`, planner option "
                "all_groups: true)")

    def _validate_precision(self) -> None:
        if self.dtype not in DTYPES:
            raise PlanError(f"precision.compute (dtype) {self.dtype!r} is unknown; use one of "
                            f"{DTYPES}")
        needed = Precision.of(self.dtype).loss_scaling
        if self.loss_scaling != needed:
            raise PlanError(f"precision: compute {self.dtype} with loss_scaling "
                            f"{self.loss_scaling!r}; {self.dtype} trains with loss_scaling "
                            f"{needed!r} (dynamic for fp16 only: bf16 and fp32 need none)")

    # -- serialisation -------------------------------------------------------------------
    def num_blocks(self) -> int:
        """Transformer blocks of the model the plan cuts (from num_layers and layer_unit)."""
        return num_blocks(self.num_layers, self.layer_unit)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": PLAN_VERSION,
            "model": {"name": self.model_name, "num_layers": self.num_layers},
            "cluster": self.cluster_name,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "dtype": self.dtype,
            "precision": self.precision.to_dict(),
            "attn_implementation": self.attn_implementation,
            "schedule": self.schedule,
            "stages": [s.to_dict() for s in self.stages],
            "predicted": asdict(self.predicted),
            "baselines": dict(self.baselines),
        }
        if self.layer_unit != BLOCK:  # absent means "block": older readers and files agree
            d["layer_unit"] = self.layer_unit
        if self.idle_groups:  # absent means every group of the cluster is used
            d["idle_groups"] = list(self.idle_groups)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("a plan must be a JSON object; see docs/architecture.md for the format")
        try:
            version = int(d.get("version", PLAN_VERSION))
            if version != PLAN_VERSION:
                raise PlanError(f"plan version {version} is not supported; this hapt_hf reads "
                                f"version {PLAN_VERSION}")
            model = d["model"]
            plan = cls(
                model_name=str(model.get("name", "")),
                num_layers=int(model["num_layers"]),
                seq_len=int(d["seq_len"]),
                global_batch_size=int(d["global_batch_size"]),
                micro_batch_size=int(d["micro_batch_size"]),
                num_microbatches=int(d["num_microbatches"]),
                schedule=str(d.get("schedule", ScheduleKind.ONE_F_ONE_B.value)),
                stages=tuple(StagePlan.from_dict(s) for s in d["stages"]),
                predicted=PlanPrediction(**d.get("predicted", {})),
                cluster_name=str(d.get("cluster", "")),
                baselines={str(k): float(v) for k, v in d.get("baselines", {}).items()},
                layer_unit=str(d.get("layer_unit", BLOCK)),
                idle_groups=tuple(str(g) for g in d.get("idle_groups", ())),
                attn_implementation=str(d.get("attn_implementation",
                                              DEFAULT_ATTN_IMPLEMENTATION)),
                **_precision_fields(d),
            )
        except KeyError as e:
            raise PlanError(f"plan is missing field {e.args[0]!r}; see docs/architecture.md") from None
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"plan has a malformed field: {e}") from None
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: a crash never leaves a half-written plan.json."""
        return write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist; write one with "
                            "`hapt-hf plan ... -o plan.json`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {str(path)!r} is not valid JSON (line {e.lineno}: "
                            f"{e.msg})") from None
        return cls.from_dict(data)


def _precision_fields(d: dict[str, Any]) -> dict[str, Any]:
    """``dtype`` and ``loss_scaling`` from a plan's ``precision`` block; a plan written before
    it existed takes them from ``dtype`` (fp32 if absent) and the loss scaling it needs."""
    dtype = str(d.get("dtype", "fp32"))
    p = d.get("precision")
    if p is None:
        return {"dtype": dtype, "loss_scaling": Precision.of(dtype).loss_scaling}
    if not isinstance(p, dict) or "compute" not in p:
        raise PlanError("precision must be a mapping {compute: bf16|fp16|fp32, loss_scaling: "
                        "dynamic|null}")
    compute = str(p["compute"])
    if "dtype" in d and str(d["dtype"]) != compute:
        raise PlanError(f"dtype {d['dtype']!r} and precision.compute {compute!r} disagree; "
                        "make them equal (dtype is kept for older readers)")
    scaling = p.get("loss_scaling")
    return {"dtype": compute, "loss_scaling": None if scaling is None else str(scaling)}
