"""The Plan: the one artefact everything downstream of the planner reads (plan.json).

A plan says, for every pipeline stage, which half-open range of the layer sequence
``[embedding, block_0 .. block_{N-1}, head]`` it holds and on which replicas: each replica one
GPU, or the GPUs of a tensor-parallel group (their ranks, group and device type), with its share
of every micro-batch. It also says whether a stage's optimizer state is replicated or sharded
among its replicas, and how many forward micro-batches the stage runs before its first
backward.
It can be written by the planner or by hand; :func:`Plan.validate` checks it either way.

Under an ``interleaved`` schedule each *pipeline rank* (the ranks holding one position of the
pipeline) holds ``v`` stages, ``k, k + p, k + 2p...`` of ``v p``: the plan lists every such
virtual stage as a :class:`Stage` (each with its own layers), and the stages of one pipeline
rank list the same replicas. Every other schedule places one stage per pipeline rank.

One record, :class:`Stage` of :class:`Replica` s, describes every stage: the planner's search
and cost model build and price the same record the runtime reads. A stage whose replicas are
alike (one group, equal shares) is the special case of equal ``samples``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.core.files import write_atomic
from hapt_hf.core.layers import BLOCK, HALF, LAYER_UNITS, num_blocks
from hapt_hf.core.precision import DTYPES, OPTIMIZER_STATES, REPLICATED, SHARDED, Precision
from hapt_hf.core.schedules import (SCHEDULES, ScheduleKind, default_warmups, plan_sets_warmups,
                                    schedule_generator)
from hapt_hf.errors import PlanError, ScheduleError

__all__ = ["PlanError", "StagePrediction", "Replica", "Stage", "PlanPrediction", "Plan",
           "even_replicas", "SCHEDULES", "LAYER_UNITS"]

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
class Replica:
    """One replica of a stage: the ranks that hold it together and its share of every
    micro-batch."""

    group: str
    """Group of the cluster file the replica's GPUs belong to."""
    device_type: str
    """Catalogue name of those GPUs."""
    samples: int
    """How many samples of each micro-batch this replica computes (a stage's replicas sum to
    ``micro_batch_size``; unlike GPUs take shares in proportion to their speed)."""
    ranks: tuple[int, ...]
    """Global ranks holding the replica together, in tensor-parallel order: one GPU, or the
    ``t`` GPUs of its tensor-parallel group (they shard the blocks' projections and compute the
    same samples; see :mod:`hapt_hf.core.tp`)."""

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: how many ranks hold the replica together."""
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "device_type": self.device_type, "samples": self.samples,
                "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "Replica":
        try:
            ranks = tuple(int(r) for r in d["ranks"])
            samples = int(d["samples"])
        except KeyError as e:
            raise PlanError(f"{where}: a replica is missing field {e.args[0]!r}; each "
                            "replica needs 'ranks' ([rank]), 'samples', 'group' and "
                            "'device_type'") from None
        except (TypeError, ValueError) as e:
            raise PlanError(f"{where}: malformed replica ({e}); 'ranks' is a list of integers, "
                            "'samples' an integer") from None
        return cls(str(d.get("group", "")), str(d.get("device_type", "")), samples, ranks)


def even_replicas(group: str, device_type: str, ranks: Sequence[int],
                  samples: int) -> tuple[Replica, ...]:
    """One replica per rank, all of one group, each computing ``samples`` of every micro-batch."""
    return tuple(Replica(group, device_type, samples, (r,)) for r in ranks)


def _uneven_width(index: int, width: int, micro_batch_size: int) -> PlanError:
    return PlanError(f"stage {index} has {width} replicas but micro_batch_size is "
                     f"{micro_batch_size}; it must be a multiple of the stage's width, or give the "
                     "stage's replicas their own 'samples'")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous layer range on ``width`` data-parallel replicas, each
    computing its share of every micro-batch.

    A stage whose replicas are alike (one group, equal shares) is simply one whose replicas
    have equal ``samples``; build it with :meth:`even`. The search, the cost model and the
    runtime read this same record."""

    index: int
    """Position along the pipeline, 0 = holds the embedding."""
    layers: tuple[int, int]
    """Half-open range over the layer sequence (0 = embedding, last = head)."""
    replicas: tuple[Replica, ...]
    """The stage's data-parallel replicas in rank order: replica ``r`` computes the samples
    after those of replicas ``0..r-1`` of every micro-batch."""
    warmup: int = 1
    """Forward micro-batches this stage runs before its first backward (1F1B: stages - index);
    under an interleaved schedule, the forwards its pipeline rank runs, over all its stages,
    before its first backward (the same on each of them)."""
    recompute: bool = False
    """Activation checkpointing for this stage's blocks (trades compute for memory)."""
    optimizer: str = REPLICATED
    """``replicated`` (every replica holds the whole Adam state) or ``sharded`` (ZeRO-1)."""
    predicted: StagePrediction = field(default_factory=StagePrediction)
    deferral: int | None = None
    """``zero_bubble`` only: by how many micro-batches the stage defers its weight gradients
    (None: the first stage's warm-up less its own; see
    :func:`hapt_hf.core.schedules.zero_bubble_deferrals`). Each deferred one keeps its
    micro-batch's activations."""
    sequence_parallel: bool = False
    """Sequence parallelism inside each replica (plan.json ``"sp"``; only where ``tp`` > 1):
    the blocks' residual stream split on the sequence over the replica's ranks, its input and
    output whole activations as without it (see :func:`hapt_hf.core.tp.sp_refusal` for what it
    moves and which models run it)."""
    recompute_layers: int = 0
    """Partial recompute (plan.json ``"recompute_layers"``, written only when non-zero): the
    stage's first ``k`` block units, in the plan's ``layer_unit`` and counting only transformer
    block units (not the embedding or the head), recompute their activations in the backward;
    the rest keep them. 0 with ``recompute`` false: none recompute; ``recompute`` true means all
    of them (and ``recompute_layers`` stays 0). Under an interleaved schedule each stage record
    (chunk) has its own ``k``. Read it through :meth:`recomputed_units`."""

    @classmethod
    def even(cls, index: int, layers: tuple[int, int], group: str, device_type: str,
             ranks: Sequence[int], warmup: int = 1, *, micro_batch_size: int,
             **kw: Any) -> "Stage":
        """A stage on ``ranks`` of one group that split every micro-batch evenly."""
        if ranks and micro_batch_size % len(ranks):
            raise _uneven_width(index, len(ranks), micro_batch_size)
        samples = micro_batch_size // len(ranks) if ranks else 0
        return cls(index, tuple(layers), even_replicas(group, device_type, ranks, samples),
                   warmup, **kw)

    # -- derived -------------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the stage, in replica order."""
        return tuple(r for rep in self.replicas for r in rep.ranks)

    @property
    def width(self) -> int:
        """Number of data-parallel replicas: every micro-batch is split among them."""
        return len(self.replicas)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree of the stage: the ranks of each of its replicas (equal for
        every replica; 1 = each replica is one GPU)."""
        return self.replicas[0].tp if self.replicas else 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def group(self) -> str:
        """The first replica's group (the stage's group where its replicas are alike)."""
        return self.replicas[0].group if self.replicas else ""

    @property
    def device_type(self) -> str:
        """The first replica's device type."""
        return self.replicas[0].device_type if self.replicas else ""

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups the stage's GPUs belong to, in replica order, each once."""
        return tuple(dict.fromkeys(r.group for r in self.replicas))

    @property
    def uneven(self) -> bool:
        """Whether the replicas differ in group, device type or share."""
        return len({(r.group, r.device_type, r.samples) for r in self.replicas}) > 1

    def block_units(self, num_layers: int) -> int:
        """Transformer block units (blocks, or halves under ``layer_unit`` 'half') the stage
        holds, of a plan whose layer sequence is ``num_layers`` long: its layer range less the
        embedding and the head."""
        return max(min(self.layers[1], num_layers - 1) - max(self.layers[0], 1), 0)

    def recomputed_units(self, num_layers: int) -> int:
        """How many of the stage's block units, from its first, recompute in the backward
        (all of them under ``recompute``, else ``recompute_layers``): the one reading of the
        stage's recompute that the cost model and the runtime share. Units ``j`` of the stage
        with ``j < recomputed_units`` keep only their input per micro-batch in flight."""
        return self.block_units(num_layers) if self.recompute else self.recompute_layers

    def shares(self, micro_batch_size: int | None = None) -> tuple[int, ...]:
        """Samples of each micro-batch each replica computes, in replica order; given the
        plan's ``micro_batch_size``, PlanError where they do not sum to it."""
        out = tuple(r.samples for r in self.replicas)
        if micro_batch_size is not None and sum(out) != micro_batch_size:
            raise PlanError(f"stage {self.index}: replica samples {list(out)} sum to "
                            f"{sum(out)}, but micro_batch_size is {micro_batch_size}; they must "
                            "sum to it")
        return out

    # -- plan.json -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "layers": list(self.layers),
                             "replicas": [r.to_dict() for r in self.replicas],
                             "warmup": self.warmup, "recompute": self.recompute}
        if self.optimizer != REPLICATED:  # absent means replicated: older files agree
            d["optimizer"] = self.optimizer
        d["predicted"] = asdict(self.predicted)
        if self.deferral is not None:  # absent means the schedule's rule
            d["deferral"] = self.deferral
        d["dp"] = self.width  # written for readers; checked on load
        d["tp"] = self.tp  # likewise
        d["sp"] = self.sequence_parallel  # absent in older files: False
        if self.recompute_layers:  # absent means 0: older files agree
            d["recompute_layers"] = self.recompute_layers
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], micro_batch_size: int) -> "Stage":
        """A stage of plan.json. Besides the form :meth:`to_dict` writes, the older forms load:
        an even stage as ``group``, ``device_type`` and ``ranks`` (each rank an equal share of
        ``micro_batch_size``), and ``replicas`` beside the stage's ``group``, ``device_type``
        and ``ranks`` (which must then be those of its replicas)."""
        where = f"stage {d.get('index', '?')}"
        try:
            index = int(d["index"])
            layers = tuple(int(x) for x in d["layers"])
            replicas = tuple(Replica.from_dict(r, where) for r in d.get("replicas") or ())
            if replicas:
                _check_listed(d, replicas, where)
            else:
                ranks = tuple(int(r) for r in d["ranks"])
                if ranks and micro_batch_size % len(ranks):
                    raise _uneven_width(index, len(ranks), micro_batch_size)
                replicas = even_replicas(str(d.get("group", "")), str(d.get("device_type", "")),
                                         ranks, micro_batch_size // len(ranks) if ranks else 0)
            stage = cls(
                index=index,
                layers=(layers[0], layers[1]),
                replicas=replicas,
                warmup=int(d.get("warmup", 1)),
                recompute=bool(d.get("recompute", False)),
                optimizer=str(d.get("optimizer", REPLICATED)),
                predicted=StagePrediction(**d.get("predicted", {})),
                deferral=None if d.get("deferral") is None else int(d["deferral"]),
                sequence_parallel=_flag(d.get("sp", False), f"{where}: sp"),
                recompute_layers=_count(d.get("recompute_layers", 0),
                                        f"{where}: recompute_layers"),
            )
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}; every stage needs "
                            "'index', 'layers' [start, end) and 'replicas' (or 'ranks')") from None
        except (TypeError, ValueError, IndexError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"{where}: malformed field ({e}); 'layers' is [start, end), "
                            "'ranks' a list of integers") from None
        if "dp" in d and int(d["dp"]) != stage.width:
            raise PlanError(f"{where}: dp is {d['dp']} but the stage lists {stage.width} "
                            f"replicas (ranks {list(stage.ranks)}); make them agree")
        if "tp" in d and any(int(d["tp"]) != r.tp for r in stage.replicas):
            raise PlanError(f"{where}: tp is {d['tp']} but its replicas hold ranks "
                            f"{[list(r.ranks) for r in stage.replicas]}; each replica lists "
                            "its tp ranks: make them agree")
        return stage

    def validate(self, micro_batch_size: int) -> None:
        """Raise PlanError naming what is wrong with this stage's replicas or optimizer."""
        i = self.index
        if not self.replicas:
            raise PlanError(f"stage {i} lists no replicas (no ranks); give it at least one")
        if self.optimizer not in OPTIMIZER_STATES:
            raise PlanError(f"stage {i}: optimizer {self.optimizer!r} is unknown; use one of "
                            f"{OPTIMIZER_STATES}")
        if self.optimizer == SHARDED and self.width < 2:
            raise PlanError(f"stage {i}: optimizer 'sharded' needs at least 2 replicas to shard "
                            "the state among, it has 1; use 'replicated'")
        degrees = [r.tp for r in self.replicas]
        if min(degrees) < 1:
            raise PlanError(f"stage {i}: a replica lists no ranks; give each replica its rank "
                            "(or its tensor-parallel group's ranks)")
        if len(set(degrees)) > 1:
            raise PlanError(f"stage {i}: its replicas hold {degrees} ranks each "
                            f"({[list(r.ranks) for r in self.replicas]}); every replica of a "
                            "stage has the same tensor-parallel degree: give each the same "
                            "number of ranks")
        if self.sequence_parallel and self.tp < 2:
            raise PlanError(f"stage {i} sets sp (sequence parallelism) but its replicas hold "
                            f"{self.tp} rank each; sequence parallelism splits the sequence over "
                            "a replica's tensor-parallel ranks: set \"sp\" to false or give the "
                            "stage's replicas several ranks (tp > 1)")
        if self.recompute_layers < 0:
            raise PlanError(f"stage {i} has recompute_layers {self.recompute_layers}; it must be "
                            ">= 0 (how many of the stage's first block units recompute)")
        if self.recompute_layers and self.recompute:
            raise PlanError(f"stage {i} sets recompute true and recompute_layers "
                            f"{self.recompute_layers}; recompute true already recomputes every "
                            "block: set recompute_layers to 0, or recompute to false")
        shares = self.shares()
        if min(shares) < 1:
            raise PlanError(f"stage {i}: replica samples {list(shares)} include a replica with "
                            "none; leave that GPU out of the stage instead")
        self.shares(micro_batch_size)


def _count(value: Any, where: str) -> int:
    """A plan.json integer count (not a boolean), PlanError for anything else."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where} is {value!r}; it must be an integer (how many of the stage's "
                        "first block units recompute)")
    return value


def _flag(value: Any, where: str) -> bool:
    """A plan.json boolean (true/false), PlanError for anything else."""
    if not isinstance(value, bool):
        raise PlanError(f"{where} is {value!r}; it must be true or false")
    return value


def _check_listed(d: dict[str, Any], replicas: tuple[Replica, ...], where: str) -> None:
    """The stage-level ``ranks``, ``group`` and ``device_type`` an older file lists beside
    ``replicas`` must be those of the replicas."""
    ranks = [r for rep in replicas for r in rep.ranks]
    if "ranks" in d and [int(r) for r in d["ranks"]] != ranks:
        raise PlanError(f"{where}: ranks {list(d['ranks'])} but its replicas list ranks "
                        f"{ranks}; make them agree")
    first = (replicas[0].group, replicas[0].device_type)
    listed = (str(d.get("group", first[0])), str(d.get("device_type", first[1])))
    if listed != first:
        raise PlanError(f"{where}: group/device_type {listed[0]}/{listed[1]} are not those of "
                        f"its first replica ({first[0]}/{first[1]}); make them agree")


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
    stages: tuple[Stage, ...]
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
        """Processes the plan runs on: every rank of every replica of every stage (a rank
        holding several stages counted once)."""
        return len({r for s in self.stages for r in s.ranks})

    @property
    def num_stages(self) -> int:
        """Stages, virtual ones included (``virtual_stages`` per pipeline rank)."""
        return len(self.stages)

    @property
    def num_pipeline_ranks(self) -> int:
        """Positions along the pipeline: the distinct sets of ranks holding stages."""
        return len({frozenset(s.ranks) for s in self.stages}) or 1

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank: ``v`` of an interleaved plan, 1 otherwise."""
        return max(self.num_stages // self.num_pipeline_ranks, 1)

    def stages_of_rank(self, rank: int) -> tuple[Stage, ...]:
        """Every stage global rank ``rank`` holds, in pipeline order (several under an
        interleaved schedule)."""
        held = tuple(s for s in self.stages if rank in s.ranks)
        if not held:
            raise PlanError(f"rank {rank} holds no stage; the plan covers ranks "
                            f"{sorted({r for s in self.stages for r in s.ranks})}")
        return held

    def stage_of_rank(self, rank: int) -> Stage:
        """The one stage ``rank`` holds; PlanError where it holds several (interleaved:
        use :meth:`stages_of_rank`)."""
        held = self.stages_of_rank(rank)
        if len(held) > 1:
            raise PlanError(f"rank {rank} holds stages {[s.index for s in held]} (schedule "
                            f"{self.schedule!r}); ask stages_of_rank for every stage of a rank")
        return held[0]

    def warmups(self) -> list[int]:
        return [s.warmup for s in self.stages]

    def deferrals(self) -> tuple[int | None, ...] | None:
        """Each stage's ``zero_bubble`` deferral as the plan sets it (None where it leaves it
        to the schedule's rule), or None where no stage sets one."""
        if all(s.deferral is None for s in self.stages):
            return None
        return tuple(s.deferral for s in self.stages)

    def with_schedule(self, schedule: str, warmups: list[int] | None = None) -> "Plan":
        """The same partition under another schedule (default warm-ups for gpipe/1f1b)."""
        if warmups is None:
            fixed = schedule in SCHEDULES and not plan_sets_warmups(schedule)
            warmups = (default_warmups(schedule, self.num_stages, self.num_microbatches,
                                       self.num_pipeline_ranks)
                       if fixed else self.warmups())
        keep = schedule == ScheduleKind.ZERO_BUBBLE  # deferrals belong to zero_bubble only
        stages = tuple(replace(s, warmup=w, deferral=s.deferral if keep else None)
                       for s, w in zip(self.stages, warmups))
        return replace(self, schedule=schedule, stages=stages)

    def interleave(self, virtual: int, warmups: Sequence[int] | None = None,
                   chunk_layers: Sequence[Sequence[int]] | None = None) -> "Plan":
        """This plan (one stage per pipeline rank) as an interleaved one of ``virtual`` chunks
        per rank: every rank keeps its replicas and its number of layers, split into
        ``virtual`` chunks as evenly as they go (the first chunks one layer larger) or as
        ``chunk_layers`` says (one list of ``virtual`` layer counts per rank, each at least 1
        and summing to the rank's layers), and the chunks tile the model in the order ``rank
        0 chunk 0, rank 1 chunk 0, ..., rank 0 chunk 1...`` (stage ``c p + k`` on rank
        ``k``). ``warmups``: one per rank (default: the interleaved schedule's own). A stage's
        ``recompute_layers`` go to its chunks in chunk order (a chunk given all its block
        units recomputes them all)."""
        p, v = self.num_stages, int(virtual)
        if self.virtual_stages != 1:
            raise PlanError(f"the plan already holds {self.virtual_stages} stages per rank; "
                            "interleave a plan of one stage per pipeline rank")
        if v < 1:
            raise PlanError(f"virtual stages must be at least 1, got {virtual}")
        short = [s.index for s in self.stages if s.num_layers < v]
        if short:
            raise PlanError(f"stage(s) {short} hold fewer than {v} layers and cannot be cut into "
                            f"{v} chunks; interleave fewer chunks or give them more layers")
        if chunk_layers is None:
            chunks = [[s.num_layers // v + (1 if c < s.num_layers % v else 0) for c in range(v)]
                      for s in self.stages]
        else:
            chunks = [[int(n) for n in row] for row in chunk_layers]
            bad = [s.index for s, row in zip(self.stages, chunks)
                   if len(row) != v or min(row) < 1 or sum(row) != s.num_layers]
            if len(chunks) != p or bad:
                raise PlanError(f"chunk_layers must give each of the {p} pipeline ranks {v} "
                                "layer counts of at least 1 that sum to its stage's layers; "
                                f"they do not for stage(s) {bad or list(range(len(chunks), p))}")
        if warmups is None:
            warmups = default_warmups(ScheduleKind.INTERLEAVED, p * v, self.num_microbatches,
                                      p)[:p]
        if len(warmups) != p:
            raise PlanError(f"{len(warmups)} warm-ups given for {p} pipeline ranks; give one "
                            "per rank")
        stages, start = [], 0
        left = [s.recompute_layers for s in self.stages]  # partial recompute, chunk by chunk
        for c in range(v):
            for k, base in enumerate(self.stages):
                end = start + chunks[k][c]
                chunk = replace(base, index=c * p + k, layers=(start, end),
                                warmup=int(warmups[k]), predicted=StagePrediction(),
                                deferral=None, recompute_layers=0)
                if left[k]:  # the earliest chunks, which hold the most in flight, take them
                    units = chunk.block_units(self.num_layers)
                    take = min(left[k], units)
                    left[k] -= take
                    chunk = replace(chunk, recompute=take == units > 0,
                                    recompute_layers=take if take < units else 0)
                stages.append(chunk)
                start = end
        return replace(self, schedule=ScheduleKind.INTERLEAVED.value, stages=tuple(stages),
                       predicted=PlanPrediction())

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
            if s.width < 1:
                raise PlanError(f"stage {i} lists no replicas (no ranks); give it at least one")
            if len(set(s.ranks)) != len(s.ranks):
                raise PlanError(f"stage {i}: rank(s) {list(s.ranks)} appear twice; each rank "
                                "holds a stage once")
            seen_ranks.update(s.ranks)
            s.validate(self.micro_batch_size)
            units = s.block_units(self.num_layers)
            if s.recompute_layers and s.recompute_layers >= units:
                raise PlanError(f"stage {i} has recompute_layers {s.recompute_layers} but holds "
                                f"{units} block unit(s) ({self.layer_unit}); it must be fewer "
                                "than them: to recompute all of them set recompute true and "
                                "recompute_layers 0")
            if s.warmup < 1:
                raise PlanError(f"stage {i} has warmup {s.warmup}; it must be >= 1")
            if s.deferral is not None and self.schedule != ScheduleKind.ZERO_BUBBLE:
                raise PlanError(f"stage {i} sets deferral {s.deferral}, which only schedule "
                                f"'zero_bubble' runs (the plan's is {self.schedule!r}); remove "
                                "it or use zero_bubble")
            if s.deferral is not None and s.deferral < 0:
                raise PlanError(f"stage {i} has deferral {s.deferral}; it must be >= 0 (0: "
                                "each weight gradient right after its input gradient)")
        self._validate_placement()
        if expect != self.num_layers:
            raise PlanError(f"the stages cover layers [0, {expect}) but the model has "
                            f"{self.num_layers}; the last stage must end at {self.num_layers}")
        if sorted(seen_ranks) != list(range(len(seen_ranks))):
            raise PlanError(f"ranks {sorted(seen_ranks)} are not 0..{len(seen_ranks) - 1}; "
                            "number the ranks without gaps")
        busy = sorted({g for s in self.stages for g in s.groups} & set(self.idle_groups))
        if busy:
            raise PlanError(f"idle_groups lists {busy}, which hold stages; remove them from "
                            "idle_groups or move their stages")
        if world_size is not None and world_size != self.world_size:
            raise PlanError(self._world_mismatch(world_size))
        return self

    def _validate_placement(self) -> None:
        """Several stages on one rank exactly where the schedule places them so: under
        ``interleaved``, stage ``s`` on the pipeline rank of stage ``s mod p``, with the same
        replicas and warm-up; elsewhere each rank holds one stage."""
        interleaved = self.schedule == ScheduleKind.INTERLEAVED
        firsts: list[Stage] = []  # the first stage of each pipeline rank, in order
        rank_of: list[int] = []
        for s in self.stages:
            j = next((k for k, f in enumerate(firsts) if set(f.ranks) & set(s.ranks)), None)
            if j is None:
                firsts.append(s)
                rank_of.append(len(firsts) - 1)
                continue
            f = firsts[j]
            shared = sorted(set(f.ranks) & set(s.ranks))
            if not interleaved:
                raise PlanError(f"stages {f.index} and {s.index} both hold rank(s) {shared}; "
                                f"under schedule {self.schedule!r} each rank holds exactly one "
                                "stage (schedule 'interleaved' places several on one rank)")
            if s.replicas != f.replicas:
                raise PlanError(f"stages {f.index} and {s.index} share rank(s) {shared} but not "
                                "their replicas; the stages of one pipeline rank list the same "
                                "replicas (ranks, samples, group, device_type)")
            if s.warmup != f.warmup:
                raise PlanError(f"stages {f.index} and {s.index} sit on one pipeline rank but "
                                f"have warm-ups {f.warmup} and {s.warmup}; an interleaved "
                                "rank's warm-up counts its forwards over all its stages: give "
                                "them one value")
            rank_of.append(j)
        if not interleaved:
            return
        try:
            want = schedule_generator(self.schedule).place(self.num_stages, len(firsts))
        except ScheduleError as e:
            raise PlanError(f"{e} (the plan's stages sit on {len(firsts)} pipeline ranks)") \
                from None
        for s, got, w in zip(self.stages, rank_of, want):
            if got != w:
                raise PlanError(f"stage {s.index} sits on the pipeline rank of stage "
                                f"{firsts[got].index}, but an interleaved schedule over "
                                f"{len(firsts)} pipeline ranks places it with stage {w} (stage "
                                f"s with stage s mod {len(firsts)}); give it stage {w}'s "
                                "replicas")

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
                micro_batch_size=(mbs := int(d["micro_batch_size"])),
                num_microbatches=int(d["num_microbatches"]),
                schedule=str(d.get("schedule", ScheduleKind.ONE_F_ONE_B.value)),
                stages=tuple(Stage.from_dict(s, mbs) for s in d["stages"]),
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
            raise PlanError(f"plan is missing field {e.args[0]!r}; see "
                            "docs/architecture.md") from None
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
