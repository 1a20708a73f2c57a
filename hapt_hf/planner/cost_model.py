"""Cost model: what one stage costs per micro-batch (time, transfers, all-reduce, memory).

Times come from a measured :class:`Profile` when it has entries for a group's device type, and
otherwise from the catalogue: ``flops / (peak TFLOP/s * efficiency)`` with
:data:`DEFAULT_EFFICIENCY` (0.4: large dense transformer layers reach 35-50% of the datasheet peak
in mixed precision, so 0.4 is the usual middle figure).

Conventions:

* A stage of ``width`` replicas splits every micro-batch of ``mbs`` samples evenly, so each
  replica computes ``mbs // width`` samples and its times are for that many samples.
* A stage whose replicas differ (:attr:`StageShape.replicas`: GPUs of several groups, or uneven
  shares) is priced replica by replica: each computes its own share on its own GPU, the stage's
  forward and backward are the slowest replica's, and every replica's memory (its share's
  activations) is held against its own GPU. Its gradient all-reduce runs at the slowest link the
  ring crosses (the group links between its groups, each group's intra- or inter-node link).
* A cut between stages of different groups crosses the group link of the cluster file, which is
  one shared pipe: the whole micro-batch's activations cross it (``mbs * act_out``). A cut inside
  a group uses the GPU-to-GPU links (intra-node, or inter-node if the stages sit on different
  nodes); every rank sends only the samples the next stage's rank needs, in parallel, so the
  time is set by the busiest rank: ``max(mbs/w_left, mbs/w_right)`` samples.
* Data-parallel gradients are all-reduced with a ring: ``2(d-1)/d * bytes / bw + 2(d-1) * lat``,
  over the inter-node link when the stage spans nodes, in buckets of :data:`GRAD_BUCKET_BYTES`
  that overlap the stage's last backward as the runtime does: the gradients become final in
  reverse layer order (each layer at the end of its own backward), a bucket goes on the replica
  link once its last byte is final and the link is free, one bucket after another. Only what
  runs past the end of the last backward adds to the iteration. On CPU devices nothing
  overlaps: Gloo's copies and reductions run on the cores the backward runs on, so every
  bucket is priced after the backward.
* Memory per GPU: fp32 weights, fp32 gradients and Adam state take :data:`STATE_BYTES_PER_PARAM`
  (16) bytes per parameter in every precision (a stage whose optimizer is ``sharded``, ZeRO-1
  over its ``d`` replicas: ``8 + 8/d``, the Adam moments split, weights and gradients whole; see
  :func:`~hapt_hf.core.precision.state_bytes_per_param`), plus, for every micro-batch in
  flight, what its layers keep for the backward (``act_keep_bytes`` per sample and
  ``act_keep_fixed_bytes``: autocast's 16-bit weight copies), plus one layer's working set.
  Recompute keeps only the blocks' inputs and pays one more forward in the backward.
* A sharded stage's replicas each run the Adam step on their ``1/d`` of the parameters, then
  the updated fp32 weights go from their owners to the other replicas, priced as a ring
  all-gather ``(d-1)/d * 4 * params / bw + (d-1) * lat`` on the replica link, after the
  all-reduce and the step (nothing overlaps it).
* Activations and their gradients cross stage boundaries at the compute dtype
  (``act_out_bytes``); the data-parallel all-reduce moves the fp32 weight gradients
  (:data:`~hapt_hf.core.precision.MASTER_BYTES` per parameter).

Length: over 400 lines because every figure of a stage (time, transfer, all-reduce, memory) is
priced from the same cached per-group layer tables of one :class:`CostModel`; the conventions
above hold for all of them, so they stay in one place.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

from hapt_hf.core.defaults import GRAD_BUCKET_BYTES
from hapt_hf.core.precision import (MASTER_BYTES, REPLICATED, SHARDED, STATE_BYTES_PER_PARAM,
                                     state_bytes_per_param)
from hapt_hf.core.shares import overlaps
from hapt_hf.errors import CostModelError

from .cluster import Cluster, GpuGroup, LinkSpec
from .model_spec import LayerSpec, ModelSpec
from .plan import Plan
from .profile import LayerTiming, Profile

__all__ = ["DEFAULT_EFFICIENCY", "STATE_BYTES_PER_PARAM", "GRAD_BUCKET_BYTES", "CostModelError",
           "ReplicaSlot", "StageShape", "StageCost", "ReplicaMemory", "StageCosts",
           "AllReduceWindow", "CostModel", "overlapped_allreduce"]

DEFAULT_EFFICIENCY = 0.4
"""Fraction of a GPU's peak dense TFLOP/s that the analytic fallback assumes layers reach."""

# STATE_BYTES_PER_PARAM (hapt_hf.core.precision): fp32 weights + fp32 gradients + two fp32 Adam
# moments = 16 bytes, in every precision: 16-bit compute is autocast over the fp32 weights.

# GRAD_BUCKET_BYTES (hapt_hf.core.defaults, DDP's ``bucket_cap_mb=25``): the runtime closes a
# bucket once it holds at least this many bytes and all-reduces it as soon as the last backward
# has made all of its gradients final; the cost model prices the same buckets. Larger buckets
# pay the link latency fewer times but start later.

UPDATE_BYTES_PER_PARAM = 32
"""Bytes the Adam step reads and writes per parameter (weights, grads, master, moments)."""

FLOPS_PER_MEMORY_BYTE = 150.0
"""Peak FLOP/s over memory bandwidth of current data-centre GPUs (V100 ~140, A100 ~200): the
optimizer step is memory-bound, so its time is estimated from memory traffic at this ratio when
no profile measured it."""


@dataclass(frozen=True)
class ReplicaSlot:
    """One GPU of a stage whose replicas differ: its group, its place there, its share."""

    group: GpuGroup
    index: int
    """Index of the GPU inside its group (nodes are filled in order)."""
    samples: int
    """Samples of every micro-batch this GPU computes."""

    @property
    def node(self) -> int:
        return self.index // self.group.gpus_per_node


@dataclass(frozen=True)
class StageShape:
    """Where a stage sits: a slice of ``width`` consecutive GPUs of one group, sharing every
    micro-batch evenly, or, with ``replicas``, any GPUs of the cluster with their own shares."""

    group: GpuGroup
    width: int
    offset: int = 0
    """Index of the stage's first GPU inside its group (nodes are filled in order)."""
    replicas: tuple[ReplicaSlot, ...] = ()
    """Every GPU with its group and share where they differ (``group``, ``offset`` are then the
    first one's, ``width`` their count); empty: the even slice of one group described above."""

    @classmethod
    def of_slots(cls, slots: tuple[ReplicaSlot, ...] | list[ReplicaSlot]) -> "StageShape":
        if not slots:
            raise CostModelError("a stage needs at least one replica")
        return cls(slots[0].group, len(slots), slots[0].index, tuple(slots))

    def slots(self, mbs: int) -> tuple[ReplicaSlot, ...]:
        """Every replica with its group, place and share of a micro-batch of ``mbs``."""
        if self.replicas:
            return self.replicas
        return tuple(ReplicaSlot(self.group, self.offset + i, mbs // self.width)
                     for i in range(self.width))

    @property
    def groups(self) -> tuple[GpuGroup, ...]:
        """The groups of the stage's GPUs, in replica order, each once."""
        if not self.replicas:
            return (self.group,)
        return tuple({r.group.name: r.group for r in self.replicas}.values())

    @property
    def on_cpu(self) -> bool:
        """Whether a GPU of the stage is a CPU (its collectives share the compute's cores)."""
        return any(g.gpu.is_cpu for g in self.groups)

    @property
    def first_node(self) -> int:
        return self.offset // self.group.gpus_per_node

    @property
    def last_node(self) -> int:
        return (self.offset + self.width - 1) // self.group.gpus_per_node

    @property
    def spans_nodes(self) -> bool:
        return self.first_node != self.last_node


@dataclass(frozen=True)
class StageCost:
    """One stage, per micro-batch, on one of its GPUs."""

    forward_s: float
    backward_s: float
    """Includes the recomputed forward when ``recompute`` is set."""
    send_forward_s: float
    """Moving this stage's output activations to the next stage (0 on the last stage)."""
    send_backward_s: float
    """Moving the gradient of this stage's input to the previous stage (0 on the first)."""
    allreduce_s: float
    """Replica-link time of the gradient all-reduce (all buckets, one after another)."""
    update_s: float
    static_bytes: float
    """Weights, gradients and optimizer state on one GPU."""
    activation_bytes: float
    """Activations one GPU keeps per micro-batch in flight."""
    working_bytes: float
    capacity_bytes: float
    """Usable memory of one GPU (after the planner's headroom)."""
    recompute: bool = False
    allreduce_lead_s: float = 0.0
    """How long before the end of the stage's last backward its first gradient bucket goes on
    the replica link (0: the all-reduce starts when the backward ends)."""
    allreduce_exposed_s: float | None = None
    """How long the all-reduce runs past the end of the last backward; None: all of
    ``allreduce_s`` (nothing overlapped)."""
    allgather_s: float = 0.0
    """Sharded optimizer state: moving the updated weights from their owners to the other
    replicas, after the update (0 when the state is replicated)."""
    optimizer: str = REPLICATED
    """'replicated' or 'sharded' (ZeRO-1 over the stage's replicas)."""
    replica_memory: tuple["ReplicaMemory", ...] = ()
    """Where the stage's replicas differ: the memory of each kind of replica (GPU type and
    share); the memory fields above are then the first replica's."""
    send_forward_latency_s: float = 0.0
    """The link latency inside ``send_forward_s``: the message is in flight that long after
    the link is free for the next one (sends of one direction pipeline their latencies)."""
    send_backward_latency_s: float = 0.0
    """The same for ``send_backward_s``."""

    @property
    def send_forward_busy_s(self) -> float:
        """Seconds a forward send holds its link direction (its transfer, not its latency)."""
        return self.send_forward_s - self.send_forward_latency_s

    @property
    def send_backward_busy_s(self) -> float:
        return self.send_backward_s - self.send_backward_latency_s

    @property
    def allreduce_after_s(self) -> float:
        """Seconds the all-reduce adds after the stage's last backward, before its update."""
        return self.allreduce_s if self.allreduce_exposed_s is None else self.allreduce_exposed_s

    def memory_bytes(self, in_flight: int) -> float:
        return self.static_bytes + self.activation_bytes * in_flight + self.working_bytes

    def memory_use(self, in_flight: int) -> tuple[float, float]:
        """(peak bytes, usable bytes) of the stage's GPU with the least memory to spare."""
        if not self.replica_memory:
            return self.memory_bytes(in_flight), self.capacity_bytes
        uses = [(self.static_bytes + m.activation_bytes * in_flight + m.working_bytes,
                 m.capacity_bytes) for m in self.replica_memory]
        return min(uses, key=lambda u: u[1] - u[0])


@dataclass(frozen=True)
class ReplicaMemory:
    """One kind of replica of a stage whose replicas differ: what its share keeps, on its GPU."""

    activation_bytes: float
    working_bytes: float
    capacity_bytes: float


@dataclass(frozen=True)
class StageCosts:
    stages: tuple[StageCost, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)


@dataclass(frozen=True)
class AllReduceWindow:
    """A stage's bucketed gradient all-reduce against its last backward."""

    link_s: float
    """Time the buckets keep the replica link busy, summed."""
    lead_s: float
    """The first bucket starts this long before the last backward ends."""
    exposed_s: float
    """The last bucket ends this long after the last backward ends (0 if before)."""


def overlapped_allreduce(layers: list[tuple[float, float]], bucket_bytes: float,
                         bucket_s) -> AllReduceWindow:
    """Buckets over gradients that become final during one backward.

    ``layers``: (backward seconds, gradient bytes) of each layer in the order the backward runs
    them (last layer first). The byte stream is cut into buckets of ``bucket_bytes``, the rest
    going last; a bucket is ready when the layer holding its last byte has finished its
    backward, and starts when it is ready and the previous bucket is done. ``bucket_s(nbytes)``
    prices one bucket on the link.
    """
    t = free = busy = 0.0
    first = None
    filled = 0.0
    full_s = bucket_s(bucket_bytes)
    for dur, nbytes in layers:
        t += dur
        filled += nbytes
        k = int(filled // bucket_bytes)
        if k:  # k buckets close in this layer, all ready at its end
            start = max(t, free)
            first = start if first is None else first
            free = start + k * full_s
            busy += k * full_s
            filled -= k * bucket_bytes
    if filled > 0:
        start = max(t, free)
        first = start if first is None else first
        free = start + bucket_s(filled)
        busy += bucket_s(filled)
    if first is None:
        return AllReduceWindow(0.0, 0.0, 0.0)
    return AllReduceWindow(busy, t - first, max(0.0, free - t))


@dataclass(frozen=True)
class _LayerTable:
    """Prefix sums over the layer sequence for one device type and per-replica batch."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    upd: tuple[float, ...]
    block_fwd: tuple[float, ...]
    """Forward time of block layers only (what recompute repeats)."""
    measured_update: bool
    fb: tuple[float, ...] = ()
    """Forward + backward prefix sums."""
    fb_rc: tuple[float, ...] = ()
    """Forward + backward + recomputed block forwards."""


def _lookup(profile: Profile, device: str, layer: LayerSpec, samples: int, seq_len: int,
            dtype: str) -> LayerTiming | None:
    """The layer's measured timing; a block half without its own entry takes its FLOP share
    of the whole block's (profiles time whole blocks)."""
    hit = profile.lookup(device, layer.signature, samples, seq_len, dtype)
    if hit is not None or not layer.profile_signature:
        return hit
    whole = profile.lookup(device, layer.profile_signature, samples, seq_len, dtype)
    if whole is None:
        return None
    f = layer.profile_share
    return LayerTiming(whole.forward_s * f, whole.backward_s * f, whole.update_s * f,
                       whole.peak_memory_bytes, whole.spread)


def _prefix(values) -> tuple[float, ...]:
    return (0.0, *accumulate(values))


class CostModel:
    """Prices stages of one model on one cluster; caches per (device, samples) tables."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profile: Profile | None = None,
                 efficiency: float = DEFAULT_EFFICIENCY, memory_headroom: float = 0.9):
        if not 0 < efficiency <= 1:
            raise CostModelError(f"efficiency {efficiency} must be in (0, 1]")
        if not 0 < memory_headroom <= 1:
            raise CostModelError(f"memory_headroom {memory_headroom} must be in (0, 1]; it is "
                                 "the fraction of GPU memory the plan may use")
        self.model = model
        self.cluster = cluster
        self.profile = profile
        self.efficiency = efficiency
        self.memory_headroom = memory_headroom
        self._groups = {g.name: g for g in cluster.groups}
        self._tables: dict[tuple[str, float, int], _LayerTable] = {}
        self._rates: dict[tuple[str, float, int], float] = {}
        self._mem_prefix: dict[tuple[int, int, bool], list[float]] = {}
        self._windows: dict[tuple, AllReduceWindow] = {}
        layers = model.layers
        self._is_block = tuple(l.kind == "block" for l in layers)
        self.params = _prefix(l.params for l in layers)
        self.keep = _prefix(l.act_keep_bytes for l in layers)
        self.keep_rc = _prefix(l.act_in_bytes if b else l.act_keep_bytes
                               for l, b in zip(layers, self._is_block))
        # per micro-batch whatever its size; a recomputed block keeps no weight copies
        self.fixed = _prefix(l.act_keep_fixed_bytes for l in layers)
        self.fixed_rc = _prefix(0.0 if b else l.act_keep_fixed_bytes
                                for l, b in zip(layers, self._is_block))
        # running maximum of act_keep from each start layer: one layer's working set in O(1)
        self._keep_max = []
        for a in range(len(layers)):
            run, row = 0.0, []
            for l in layers[a:]:
                run = max(run, l.act_keep_bytes)
                row.append(run)
            self._keep_max.append(row)
        self.grad_dtype_bytes = MASTER_BYTES  # weight gradients are fp32 in every precision
        self.state_bytes = STATE_BYTES_PER_PARAM

    # -- lookups ---------------------------------------------------------------------------
    def group(self, name: str) -> GpuGroup:
        try:
            return self._groups[name]
        except KeyError:
            raise CostModelError(f"group {name!r} is not in cluster {self.cluster.name!r}; "
                                 f"its groups are {sorted(self._groups)}") from None

    def group_link(self, a: str, b: str) -> LinkSpec | None:
        for l in self.cluster.links:
            if {l.a, l.b} == {a, b}:
                return l.link
        return None

    def capacity_bytes(self, group: GpuGroup) -> float:
        return group.gpu.memory_gb * 1e9 * self.memory_headroom

    def table(self, group: GpuGroup, samples: int) -> _LayerTable:
        """Per-layer times of one replica computing ``samples`` samples on ``group``'s GPUs."""
        key = (group.gpu.name, group.gpu.tflops, samples)
        t = self._tables.get(key)
        if t is None:
            t = self._build_table(group, samples)
            self._tables[key] = t
        return t

    def _build_table(self, group: GpuGroup, samples: int) -> _LayerTable:
        m = self.model
        speed = group.gpu.tflops * 1e12 * self.efficiency
        mem_bw = group.gpu.tflops * 1e12 / FLOPS_PER_MEMORY_BYTE
        fwd, bwd, upd = [], [], []
        measured = self.profile is not None
        for layer in m.layers:
            hit = None
            if self.profile is not None:
                hit = _lookup(self.profile, group.gpu.name, layer, samples, m.seq_len, m.dtype)
            if hit is not None:
                fwd.append(hit.forward_s)
                bwd.append(hit.backward_s)
                upd.append(hit.update_s if hit.update_s > 0
                           else layer.params * UPDATE_BYTES_PER_PARAM / mem_bw)
            else:
                measured = False
                fwd.append(samples * layer.fwd_flops / speed)
                bwd.append(samples * layer.bwd_flops / speed)
                upd.append(layer.params * UPDATE_BYTES_PER_PARAM / mem_bw)
        block_fwd = [f if b else 0.0 for f, b in zip(fwd, self._is_block)]
        fb = [f + b for f, b in zip(fwd, bwd)]
        return _LayerTable(_prefix(fwd), _prefix(bwd), _prefix(upd), _prefix(block_fwd),
                           measured, _prefix(fb),
                           _prefix(x + r for x, r in zip(fb, block_fwd)))

    # -- per stage -------------------------------------------------------------------------
    def compute_s(self, group: GpuGroup, samples: int, a: int, b: int,
                  recompute: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of layers [a, b) for one replica's ``samples``."""
        t = self.table(group, samples)
        f = t.fwd[b] - t.fwd[a]
        bw = t.bwd[b] - t.bwd[a]
        if recompute:
            bw += t.block_fwd[b] - t.block_fwd[a]
        return f, bw

    def static_bytes(self, a: int, b: int, optimizer: str = REPLICATED, width: int = 1) -> float:
        """Weights, gradients and optimizer state of layers [a, b) on one GPU of a stage of
        ``width`` replicas keeping its state ``optimizer``."""
        return (self.params[b] - self.params[a]) * state_bytes_per_param(optimizer, width)

    def activation_bytes(self, samples: int, a: int, b: int, recompute: bool = False) -> float:
        """What one micro-batch of ``samples`` keeps in layers [a, b) until its backward."""
        pre = self.keep_rc if recompute else self.keep
        fixed = self.fixed_rc if recompute else self.fixed
        return samples * (pre[b] - pre[a]) + fixed[b] - fixed[a]

    def working_bytes(self, samples: int, a: int, b: int) -> float:
        return samples * self._keep_max[a][b - a - 1]

    def memory_bytes(self, samples: int, a: int, b: int, in_flight: int,
                     recompute: bool = False, optimizer: str = REPLICATED,
                     width: int = 1) -> float:
        return (self.static_bytes(a, b, optimizer, width)
                + in_flight * self.activation_bytes(samples, a, b, recompute)
                + self.working_bytes(samples, a, b))

    def memory_prefix(self, samples: int, in_flight: int, recompute: bool,
                      optimizer: str = REPLICATED, width: int = 1) -> list[float]:
        """Prefix sums of static + in-flight activation bytes (working set not included)."""
        st = state_bytes_per_param(optimizer, width)
        key = (samples, in_flight, recompute, st)
        pre = self._mem_prefix.get(key)
        if pre is None:
            keep = self.keep_rc if recompute else self.keep
            fixed = self.fixed_rc if recompute else self.fixed
            pre = [p * st + in_flight * (samples * k + f)
                   for p, k, f in zip(self.params, keep, fixed)]
            self._mem_prefix[key] = pre
        return pre

    def allreduce_s(self, shape: StageShape, a: int, b: int) -> float:
        """One ring all-reduce of all the gradients of layers [a, b) (no buckets, no overlap)."""
        d = shape.width
        if d <= 1:
            return 0.0
        link = shape.group.inter_node if shape.spans_nodes else shape.group.intra_node
        nbytes = (self.params[b] - self.params[a]) * self.grad_dtype_bytes
        bw = link.bandwidth_gbps * 1e9 / 8
        return 2 * (d - 1) / d * nbytes / bw + 2 * (d - 1) * link.latency_us * 1e-6

    def allreduce_window(self, shape: StageShape, samples: int, a: int, b: int,
                         recompute: bool = False) -> AllReduceWindow:
        """The stage's gradient all-reduce in :data:`GRAD_BUCKET_BYTES` buckets, overlapped with
        its last backward (``samples`` per replica, layers [a, b)); see
        :func:`overlapped_allreduce`."""
        d = shape.width
        if d <= 1:
            return AllReduceWindow(0.0, 0.0, 0.0)
        spans = shape.spans_nodes
        key = (shape.group.name, d, spans, samples, a, b, recompute)
        w = self._windows.get(key)
        if w is not None:
            return w
        link = shape.group.inter_node if spans else shape.group.intra_node
        w = self._ring_window(d, link, self.table(shape.group, samples), a, b, recompute,
                              overlap=not shape.on_cpu)
        self._windows[key] = w
        return w

    def _ring_window(self, d: int, link: LinkSpec, t: _LayerTable, a: int, b: int,
                     recompute: bool, overlap: bool = True) -> AllReduceWindow:
        """Ring all-reduce of ``d`` replicas over ``link``, in buckets behind the backward of
        layers [a, b) timed by ``t`` (the replica that finishes its backward last); without
        ``overlap`` (CPU devices) every bucket runs after the backward."""
        bw = link.bandwidth_gbps * 1e9 / 8
        ring, lat = 2 * (d - 1) / d, 2 * (d - 1) * link.latency_us * 1e-6
        gb = self.grad_dtype_bytes
        layers = []
        for j in range(b - 1, a - 1, -1):  # the backward runs the last layer first
            dur = t.bwd[j + 1] - t.bwd[j]
            if recompute:
                dur += t.block_fwd[j + 1] - t.block_fwd[j]
            layers.append((dur, (self.params[j + 1] - self.params[j]) * gb))
        if not overlap:  # every gradient is final, then the buckets go one after another
            layers = [(sum(x for x, _ in layers), 0.0)] + [(0.0, n) for _, n in layers]
        return overlapped_allreduce(layers, GRAD_BUCKET_BYTES, lambda n: ring * n / bw + lat)

    def replica_link(self, shape: StageShape) -> LinkSpec:
        """The slowest link a stage's gradient ring crosses: each of its groups' intra-node
        link, or inter-node link where its GPUs there span nodes, and the group links between
        its groups (bandwidth of the slowest, latency of the worst)."""
        if not shape.replicas:
            return shape.group.inter_node if shape.spans_nodes else shape.group.intra_node
        links = []
        for g in shape.groups:
            nodes = {r.node for r in shape.replicas if r.group.name == g.name}
            links.append(g.inter_node if len(nodes) > 1 else g.intra_node)
        names = [g.name for g in shape.groups]
        pairs = [(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
        linked = [(x, y) for x, y in pairs if self.group_link(x, y) is not None]
        _require_connected(names, linked)
        links += [self.group_link(x, y) for x, y in linked]
        return LinkSpec(min(l.bandwidth_gbps for l in links), max(l.latency_us for l in links))

    def update_s(self, group: GpuGroup, samples: int, a: int, b: int,
                 optimizer: str = REPLICATED, width: int = 1) -> float:
        """The optimizer step of layers [a, b) on one replica; sharded, each replica updates
        its ``1/width`` of the parameters."""
        t = self.table(group, samples)
        share = width if optimizer == SHARDED and width > 1 else 1
        return (t.upd[b] - t.upd[a]) / share

    def allgather_s(self, shape: StageShape, a: int, b: int, optimizer: str = REPLICATED) -> float:
        """Sharded state: the updated fp32 weights of layers [a, b) from their owners to every
        other replica, as a ring all-gather on the replica link; 0 when replicated."""
        d = shape.width
        if optimizer != SHARDED or d <= 1:
            return 0.0
        link = self.replica_link(shape)
        nbytes = (self.params[b] - self.params[a]) * MASTER_BYTES
        bw = link.bandwidth_gbps * 1e9 / 8
        return (d - 1) / d * nbytes / bw + (d - 1) * link.latency_us * 1e-6

    def optimizer_step_s(self, shape: StageShape, samples: int, a: int, b: int,
                         optimizer: str) -> float:
        """What the optimizer adds after the all-reduce: the update, and the all-gather of a
        sharded state."""
        return (self.update_s(shape.group, samples, a, b, optimizer, shape.width)
                + self.allgather_s(shape, a, b, optimizer))

    def _neighbour_link(self, a: str, b: str) -> LinkSpec:
        link = self.group_link(a, b)
        if link is None:
            raise CostModelError(
                f"groups {a!r} and {b!r} are neighbours in the pipeline but the cluster has no "
                "link between them; add one under 'links:' or order the stages so that "
                "neighbours are linked")
        return link

    def cut_s(self, left: StageShape, right: StageShape, last_layer: int, mbs: int) -> float:
        """Seconds to move one micro-batch's activations (or their gradients) across the cut
        after layer ``last_layer`` between two neighbouring stages: its slowest route."""
        return self._cut(left, right, last_layer, mbs)[0]

    def cut_latency_s(self, left: StageShape, right: StageShape, mbs: int) -> float:
        """The part of :meth:`cut_s` that is the link's latency rather than its transfer: a
        link carries the next message while the last one is still in flight. Where the cut
        takes several links, the least of their latencies (the link is never taken for freer
        than it is)."""
        return self._cut(left, right, 0, mbs)[1]

    def _cut(self, left: StageShape, right: StageShape, last_layer: int,
             mbs: int) -> tuple[float, float]:
        """(:meth:`cut_s`, :meth:`cut_latency_s`) from one walk of the cut's routes."""
        nbytes = lambda n: self.model.boundary_bytes(last_layer, n)  # noqa: E731
        routes = self._cut_routes(left, right, mbs)
        return (max(sum(link.transfer_s(nbytes(n)) for link, n in route) for route in routes),
                min(link.latency_us for route in routes for link, _ in route) * 1e-6)

    def _cut_routes(self, left: StageShape, right: StageShape,
                    mbs: int) -> list[list[tuple[LinkSpec, int]]]:
        """The cut as routes, each a list of (link, samples) moved one after another; routes
        run side by side. Between two groups of even stages: the whole micro-batch over the
        group link. Inside a group: each rank its share, over the intra- or inter-node link
        (the busiest rank sets the cut). Where a stage's replicas differ, the pieces each pair
        of replicas shares (:func:`~hapt_hf.core.shares.overlaps`): all pieces between two
        groups share their group link as one route; inside a group each GPU moves its own
        pieces, one after another, to its peers."""
        if not (left.replicas or right.replicas):
            if left.group.name != right.group.name:
                return [[(self._neighbour_link(left.group.name, right.group.name), mbs)]]
            g = left.group
            same_node = (left.first_node == left.last_node == right.first_node
                         == right.last_node)
            link = g.intra_node if same_node else g.inter_node
            return [[(link, max(mbs // left.width, mbs // right.width))]]
        ls, rs = left.slots(mbs), right.slots(mbs)
        pipes: dict[tuple[str, str], int] = {}
        per_gpu: dict[tuple[int, int], dict[LinkSpec, int]] = {}
        for i, j, n in overlaps([r.samples for r in ls], [r.samples for r in rs]):
            x, y = ls[i], rs[j]
            if x.group.name != y.group.name:
                pipes[(x.group.name, y.group.name)] = pipes.get((x.group.name, y.group.name), 0) + n
                continue
            link = x.group.intra_node if x.node == y.node else x.group.inter_node
            for gpu in ((0, i), (1, j)):
                mine = per_gpu.setdefault(gpu, {})
                mine[link] = mine.get(link, 0) + n
        return ([[(self._neighbour_link(a, b), n)] for (a, b), n in pipes.items()]
                + [list(mine.items()) for mine in per_gpu.values()])

    # -- whole plans -----------------------------------------------------------------------
    def used_groups(self, plan: Plan) -> list[str]:
        """The cluster's groups but those the plan leaves idle (which the cluster must have)."""
        unknown = sorted(set(plan.idle_groups) - set(self.cluster.group_names))
        if unknown:
            raise CostModelError(f"the plan leaves idle group(s) {unknown}, which cluster "
                                 f"{self.cluster.name!r} does not have (groups: "
                                 f"{', '.join(self.cluster.group_names)}); re-plan on this "
                                 "cluster")
        return [n for n in self.cluster.group_names if n not in plan.idle_groups]

    def shapes_of(self, plan: Plan) -> list[StageShape]:
        """Each stage's group slice, from its ranks (numbered group by group in file order,
        over the groups the plan does not leave idle)."""
        first_rank = self.cluster.subset(self.used_groups(plan)).first_ranks()
        shapes = []
        for s in plan.stages:
            if s.replicas:
                shapes.append(self._shape_of_replicas(s, first_rank))
                continue
            g = self.group(s.group)
            off = min(s.ranks) - first_rank[g.name]
            if off < 0 or max(s.ranks) - first_rank[g.name] >= g.size:
                raise CostModelError(
                    f"stage {s.index} lists ranks {list(s.ranks)} but group {g.name!r} holds "
                    f"ranks {first_rank[g.name]}..{first_rank[g.name] + g.size - 1}; give the "
                    "stage ranks of its own group")
            shapes.append(StageShape(g, s.dp, off))
        return shapes

    def _shape_of_replicas(self, stage, first_rank: dict[str, int]) -> StageShape:
        slots = []
        for r in stage.replicas:
            g = self.group(r.group)
            idx = r.rank - first_rank.get(g.name, r.rank + 1)  # an idle group: out of range
            if not 0 <= idx < g.size:
                raise CostModelError(
                    f"stage {stage.index}: replica rank {r.rank} is said to be in group "
                    f"{g.name!r}, which holds ranks {first_rank.get(g.name, '?')}.. (ranks are "
                    "numbered group by group, in file order, over the groups the plan uses); "
                    "give each replica a rank of its own group")
            slots.append(ReplicaSlot(g, idx, r.samples))
        return StageShape.of_slots(slots)

    def stage_costs(self, shapes: list[StageShape], bounds: list[tuple[int, int]], mbs: int,
                    recompute: list[bool] | tuple[bool, ...],
                    optimizers: list[str] | tuple[str, ...] = ()) -> StageCosts:
        """Costs of a pipeline given its stage shapes, layer ranges and micro-batch size;
        ``optimizers``: each stage's optimizer state (empty: every stage replicated)."""
        opts = tuple(optimizers) or (REPLICATED,) * len(shapes)
        n = len(shapes)
        if self.model.num_layers and bounds and bounds[-1][1] > self.model.num_layers:
            raise CostModelError(f"the stages reach layer {bounds[-1][1]} but the model has "
                                 f"{self.model.num_layers} layers")
        # each cut's (seconds, latency); nothing leaves the first stage backward or the last
        # forward
        cuts = [self._cut(shapes[i], shapes[i + 1], bounds[i][1] - 1, mbs)
                for i in range(n - 1)]
        fwd, bwd = cuts + [(0.0, 0.0)], [(0.0, 0.0)] + cuts
        out = []
        for i, (sh, (a, b), rc, opt) in enumerate(zip(shapes, bounds, recompute, opts)):
            if sh.replicas:
                out.append(self._mixed_stage(sh, a, b, rc, fwd[i][0], bwd[i][0], opt,
                                             fwd[i][1], bwd[i][1]))
                continue
            samples = mbs // sh.width
            f, bw = self.compute_s(sh.group, samples, a, b, rc)
            ar = self.allreduce_window(sh, samples, a, b, rc)
            out.append(StageCost(
                forward_s=f, backward_s=bw,
                send_forward_s=fwd[i][0], send_backward_s=bwd[i][0],
                send_forward_latency_s=fwd[i][1], send_backward_latency_s=bwd[i][1],
                allreduce_s=ar.link_s,
                update_s=self.update_s(sh.group, samples, a, b, opt, sh.width),
                static_bytes=self.static_bytes(a, b, opt, sh.width),
                activation_bytes=self.activation_bytes(samples, a, b, rc),
                working_bytes=self.working_bytes(samples, a, b),
                capacity_bytes=self.capacity_bytes(sh.group),
                recompute=rc, allreduce_lead_s=ar.lead_s, allreduce_exposed_s=ar.exposed_s,
                allgather_s=self.allgather_s(sh, a, b, opt), optimizer=opt))
        return StageCosts(tuple(out))

    def _mixed_stage(self, sh: StageShape, a: int, b: int, rc: bool, send_f: float,
                     send_b: float, opt: str = REPLICATED, lat_f: float = 0.0,
                     lat_b: float = 0.0) -> StageCost:
        """A stage whose replicas differ: the slowest replica's times, every kind's memory."""
        kinds = {(r.group.gpu.name, r.group.gpu.tflops, r.samples): r for r in sh.replicas}
        times = {k: self.compute_s(r.group, r.samples, a, b, rc) for k, r in kinds.items()}
        slow = kinds[max(times, key=lambda k: sum(times[k]))]
        ar = AllReduceWindow(0.0, 0.0, 0.0) if sh.width <= 1 else self._ring_window(
            sh.width, self.replica_link(sh), self.table(slow.group, slow.samples), a, b, rc,
            overlap=not sh.on_cpu)
        first = sh.replicas[0]
        return StageCost(
            forward_s=max(f for f, _ in times.values()),
            backward_s=max(bw for _, bw in times.values()),
            send_forward_s=send_f, send_backward_s=send_b, send_forward_latency_s=lat_f,
            send_backward_latency_s=lat_b, allreduce_s=ar.link_s,
            update_s=max(self.update_s(r.group, r.samples, a, b, opt, sh.width)
                         for r in kinds.values()),
            static_bytes=self.static_bytes(a, b, opt, sh.width),
            activation_bytes=self.activation_bytes(first.samples, a, b, rc),
            working_bytes=self.working_bytes(first.samples, a, b),
            capacity_bytes=self.capacity_bytes(first.group),
            recompute=rc, allreduce_lead_s=ar.lead_s, allreduce_exposed_s=ar.exposed_s,
            allgather_s=self.allgather_s(sh, a, b, opt), optimizer=opt,
            replica_memory=tuple(ReplicaMemory(self.activation_bytes(r.samples, a, b, rc),
                                               self.working_bytes(r.samples, a, b),
                                               self.capacity_bytes(r.group))
                                 for r in kinds.values()))

    def plan_costs(self, plan: Plan) -> StageCosts:
        shapes = self.shapes_of(plan)
        for s, sh in zip(plan.stages, shapes):
            if not sh.replicas and plan.micro_batch_size % sh.width:
                raise CostModelError(f"stage {s.index} has {sh.width} replicas but "
                                     f"micro_batch_size is {plan.micro_batch_size}; make it a "
                                     "multiple of every stage's width")
        return self.stage_costs(shapes, [s.layers for s in plan.stages], plan.micro_batch_size,
                                [s.recompute for s in plan.stages],
                                [s.optimizer for s in plan.stages])

    def sample_time_s(self, group: GpuGroup, samples: int) -> float:
        """Forward + backward seconds per sample of the whole model on one GPU of ``group``,
        when it computes ``samples`` samples at a time."""
        t = self.table(group, samples)
        return (t.fwd[-1] + t.bwd[-1]) / samples

    def replica_rate(self, group: GpuGroup, samples: int) -> float:
        """Samples per second one GPU of ``group`` puts through the whole model (fwd + bwd)."""
        key = (group.gpu.name, group.gpu.tflops, samples)
        r = self._rates.get(key)
        if r is None:
            r = self._rates[key] = 1.0 / self.sample_time_s(group, samples)
        return r

    def best_sample_time_s(self, group: GpuGroup, batch_sizes: list[int]) -> float:
        """The GPU's best per-sample time over the given per-replica batch sizes (its speed in
        the profile-or-analytic sense, used for the physical limit)."""
        return min(self.sample_time_s(group, s) for s in batch_sizes)

    def max_layers_fitting(self, pre: tuple[float, ...], a: int, limit: float) -> int:
        """Largest b with pre[b] - pre[a] <= limit (prefix sums are non-decreasing)."""
        return bisect_right(pre, pre[a] + limit) - 1


def _require_connected(names: list[str], linked: list[tuple[str, str]]) -> None:
    """Raise unless the group links among ``names`` join them all (a ring can cross them)."""
    reach, todo = {names[0]}, [names[0]]
    while todo:
        x = todo.pop()
        for a, b in linked:
            for u, v in ((a, b), (b, a)):
                if u == x and v not in reach:
                    reach.add(v)
                    todo.append(v)
    if len(reach) != len(names):
        raise CostModelError(f"a stage spans groups {names} but the cluster links only "
                             f"{sorted(reach)} among them; add links under 'links:' so its "
                             "replicas can all-reduce, or keep the stage to linked groups")
