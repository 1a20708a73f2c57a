"""Cost model: what one stage costs per micro-batch (time, transfers, all-reduce, memory).

Times come from a measured :class:`Profile` when it has entries for a group's device type, and
otherwise from the catalogue: ``flops / (peak TFLOP/s * efficiency)`` with
:data:`DEFAULT_EFFICIENCY` (0.4: large dense transformer layers reach 35-50% of the datasheet peak
in mixed precision, so 0.4 is the usual middle figure).

Conventions:

* A stage is priced from its :class:`~hapt_hf.planner.plan.Replica` s (the plan's own record):
  each replica's group is found by name and its place there from its rank (ranks are numbered
  group by group, in file order; see :meth:`CostModel.placement`). Replicas that are alike (one
  group, equal shares of ``mbs // width`` samples) are the common case; where they differ (GPUs
  of several groups, or uneven shares) each computes its own share on its own GPU, the stage's
  forward and backward are the slowest replica's, and every replica's memory (its share's
  activations) is held against its own GPU. The gradient all-reduce runs at the slowest link
  the ring crosses (the group links between its groups, each group's intra- or inter-node link).
* A cut between stages of different groups crosses the group link of the cluster file, which is
  one shared pipe: the whole micro-batch's activations cross it (``mbs * act_out``). A cut inside
  a group uses the GPU-to-GPU links (intra-node, or inter-node if the stages sit on different
  nodes); every rank sends only the samples the next stage's rank needs, in parallel, so the
  time is set by the busiest rank: ``max(mbs/w_left, mbs/w_right)`` samples. Where a stage's
  replicas differ, each pair of replicas trades the samples their slices share.
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
"""
from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Sequence

from hapt_hf.core.defaults import DEFAULT_MEMORY_HEADROOM, GRAD_BUCKET_BYTES
from hapt_hf.core.precision import (MASTER_BYTES, REPLICATED, SHARDED, STATE_BYTES_PER_PARAM,
                                     state_bytes_per_param)
from hapt_hf.core.shares import overlaps
from hapt_hf.errors import CostModelError

from .cluster import Cluster, GpuGroup, LinkSpec
from .model_spec import LayerSpec, ModelSpec
from .plan import Plan, Replica, Stage, even_replicas
from .profile import LayerTiming, Profile

__all__ = ["DEFAULT_EFFICIENCY", "STATE_BYTES_PER_PARAM", "GRAD_BUCKET_BYTES", "CostModelError",
           "Placement", "StageCost", "ReplicaMemory", "StageCosts", "AllReduceWindow",
           "CostModel", "overlapped_allreduce"]

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


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a stage's replicas sit on the cluster a :class:`CostModel` prices, derived once
    from the replica tuple (:meth:`CostModel.placement` caches it: the search prices the same
    replicas many times). A replica is placed by its first rank."""

    replicas: tuple[Replica, ...]
    width: int
    group: GpuGroup
    """The first replica's group."""
    group_of: tuple[GpuGroup, ...]
    """Each replica's group."""
    index: tuple[int, ...]
    """Each replica's GPU index inside its group (nodes are filled in order)."""
    node: tuple[int, ...]
    """Each replica's node inside its group."""
    groups: tuple[GpuGroup, ...]
    """The groups of the stage's GPUs, in replica order, each once."""
    alike: bool
    """One group, equal shares: every replica computes the same samples on the same GPU."""
    kinds: tuple[tuple[GpuGroup, int], ...]
    """(group, samples) of each kind of replica (GPU type and share), in replica order."""
    on_cpu: bool
    """Whether a GPU of the stage is a CPU (its collectives share the compute's cores)."""
    link: LinkSpec | None
    """The slowest link the stage's gradient ring crosses (see :meth:`CostModel.replica_link`);
    None where its groups have no links joining them (``link_error`` says so)."""
    link_error: str = ""


@functools.lru_cache(maxsize=1 << 16)
def _slice(group: str, device_type: str, width: int, first: int,
           samples: int) -> tuple[Replica, ...]:
    # one tuple object per slice: the cost model caches what it derives from it by identity
    return even_replicas(group, device_type, range(first, first + width), samples)


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
                 efficiency: float = DEFAULT_EFFICIENCY,
                 memory_headroom: float = DEFAULT_MEMORY_HEADROOM):
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
        self._first = cluster.first_ranks()
        self._placements: dict[int, Placement] = {}
        self._cuts: dict[tuple[Placement, Placement, int, int], tuple[float, float]] = {}
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

    # -- replicas --------------------------------------------------------------------------
    def slice_replicas(self, group: GpuGroup, width: int, offset: int,
                       mbs: int) -> tuple[Replica, ...]:
        """``width`` GPUs of ``group`` from its ``offset``-th, splitting a micro-batch of
        ``mbs`` evenly (ranks numbered over this cost model's cluster)."""
        return _slice(group.name, group.gpu.name, width, self._first[group.name] + offset,
                      mbs // width)

    def gpu_replicas(self, gpus, shares) -> tuple[Replica, ...]:
        """One replica per ``(group, index in group)`` of ``gpus`` with its share."""
        return tuple(Replica(g.name, g.gpu.name, s, (self._first[g.name] + i,))
                     for (g, i), s in zip(gpus, shares))

    def placement(self, replicas: tuple[Replica, ...]) -> Placement:
        """Where ``replicas`` sit: each one's group (by name) and GPU index there (its rank less
        the group's first rank on this cost model's cluster). Cached per tuple."""
        p = self._placements.get(id(replicas))
        if p is None or p.replicas is not replicas:  # the entry holds its tuple: ids stay unique
            p = self._placements[id(replicas)] = self._place(replicas)
        return p

    def _place(self, replicas: tuple[Replica, ...]) -> Placement:
        if not replicas:
            raise CostModelError("a stage needs at least one replica")
        group_of = tuple(self.group(r.group) for r in replicas)
        index = tuple(r.ranks[0] - self._first[g.name] for r, g in zip(replicas, group_of))
        node = tuple(i // g.gpus_per_node for i, g in zip(index, group_of))
        groups = tuple({g.name: g for g in group_of}.values())
        kinds = {(g.gpu.name, g.gpu.tflops, r.samples): (g, r.samples)
                 for r, g in zip(replicas, group_of)}
        alike = len(groups) == 1 and len({r.samples for r in replicas}) == 1
        on_cpu = any(g.gpu.is_cpu for g in groups)

        def placed(link: LinkSpec | None, error: str = "") -> Placement:
            return Placement(replicas, len(replicas), group_of[0], group_of, index, node, groups,
                             alike, tuple(kinds.values()), on_cpu, link, error)

        links = []
        for g in groups:
            nodes = {n for h, n in zip(group_of, node) if h.name == g.name}
            links.append(g.inter_node if len(nodes) > 1 else g.intra_node)
        if len(groups) == 1:
            return placed(links[0])
        names = [g.name for g in groups]
        pairs = [(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
        linked = [(x, y) for x, y in pairs if self.group_link(x, y) is not None]
        try:
            _require_connected(names, linked)
        except CostModelError as e:
            return placed(None, str(e))
        links += [self.group_link(x, y) for x, y in linked]
        return placed(LinkSpec(min(l.bandwidth_gbps for l in links),
                               max(l.latency_us for l in links)))

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

    def allreduce_s(self, replicas: tuple[Replica, ...], a: int, b: int) -> float:
        """One ring all-reduce of all the gradients of layers [a, b) (no buckets, no overlap)."""
        d = len(replicas)
        if d <= 1:
            return 0.0
        link = self.replica_link(replicas)
        nbytes = (self.params[b] - self.params[a]) * self.grad_dtype_bytes
        bw = link.bandwidth_gbps * 1e9 / 8
        return 2 * (d - 1) / d * nbytes / bw + 2 * (d - 1) * link.latency_us * 1e-6

    def allreduce_window(self, replicas: tuple[Replica, ...], a: int, b: int,
                         recompute: bool = False) -> AllReduceWindow:
        """The stage's gradient all-reduce in :data:`GRAD_BUCKET_BYTES` buckets, overlapped with
        the last backward of layers [a, b) on its slowest replica; see
        :func:`overlapped_allreduce`."""
        p = self.placement(replicas)
        return self._window(p, self._slowest(p, a, b, recompute)[2], a, b, recompute)

    def _slowest(self, p: Placement, a: int, b: int,
                 recompute: bool) -> tuple[float, float, tuple[GpuGroup, int]]:
        """(forward, backward, kind) of the stage's slowest replicas on layers [a, b): the
        longest forward and backward of its kinds, and the kind slowest in both together."""
        if len(p.kinds) == 1:
            f, bw = self.compute_s(*p.kinds[0], a, b, recompute)
            return f, bw, p.kinds[0]
        times = [self.compute_s(g, s, a, b, recompute) for g, s in p.kinds]
        slow = max(range(len(times)), key=lambda k: sum(times[k]))
        return max(f for f, _ in times), max(bw for _, bw in times), p.kinds[slow]

    def _window(self, p: Placement, slow: tuple[GpuGroup, int], a: int, b: int,
                recompute: bool) -> AllReduceWindow:
        """Ring all-reduce of the stage's gradients behind the backward of its ``slow`` kind."""
        d = p.width
        if d <= 1:
            return AllReduceWindow(0.0, 0.0, 0.0)
        link = self._link(p)
        g, samples = slow
        overlap = not p.on_cpu
        key = (link, d, g.gpu.name, g.gpu.tflops, samples, a, b, recompute, overlap)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = self._ring_window(d, link, self.table(g, samples), a, b,
                                                       recompute, overlap)
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

    def replica_link(self, replicas: tuple[Replica, ...]) -> LinkSpec:
        """The slowest link a stage's gradient ring crosses: each of its groups' intra-node
        link, or inter-node link where its GPUs there span nodes, and the group links between
        its groups (bandwidth of the slowest, latency of the worst)."""
        return self._link(self.placement(replicas))

    @staticmethod
    def _link(p: Placement) -> LinkSpec:
        if p.link is None:
            raise CostModelError(p.link_error)
        return p.link

    def update_s(self, group: GpuGroup, samples: int, a: int, b: int,
                 optimizer: str = REPLICATED, width: int = 1) -> float:
        """The optimizer step of layers [a, b) on one replica; sharded, each replica updates
        its ``1/width`` of the parameters."""
        t = self.table(group, samples)
        share = width if optimizer == SHARDED and width > 1 else 1
        return (t.upd[b] - t.upd[a]) / share

    def allgather_s(self, replicas: tuple[Replica, ...], a: int, b: int,
                    optimizer: str = REPLICATED) -> float:
        """Sharded state: the updated fp32 weights of layers [a, b) from their owners to every
        other replica, as a ring all-gather on the replica link; 0 when replicated."""
        return self._allgather(self.placement(replicas), a, b, optimizer)

    def _allgather(self, p: Placement, a: int, b: int, optimizer: str) -> float:
        d = p.width
        if optimizer != SHARDED or d <= 1:
            return 0.0
        link = self._link(p)
        nbytes = (self.params[b] - self.params[a]) * MASTER_BYTES
        bw = link.bandwidth_gbps * 1e9 / 8
        return (d - 1) / d * nbytes / bw + (d - 1) * link.latency_us * 1e-6

    def optimizer_step_s(self, replicas: tuple[Replica, ...], samples: int, a: int, b: int,
                         optimizer: str) -> float:
        """What the optimizer adds after the all-reduce: the update (on the first replica's
        GPU, ``samples`` per replica), and the all-gather of a sharded state."""
        p = self.placement(replicas)
        return (self.update_s(p.group, samples, a, b, optimizer, p.width)
                + self._allgather(p, a, b, optimizer))

    def _neighbour_link(self, a: str, b: str) -> LinkSpec:
        link = self.group_link(a, b)
        if link is None:
            raise CostModelError(
                f"groups {a!r} and {b!r} are neighbours in the pipeline but the cluster has no "
                "link between them; add one under 'links:' or order the stages so that "
                "neighbours are linked")
        return link

    def cut_s(self, left: tuple[Replica, ...], right: tuple[Replica, ...], last_layer: int,
              mbs: int) -> float:
        """Seconds to move one micro-batch's activations (or their gradients) across the cut
        after layer ``last_layer`` between two neighbouring stages: its slowest route."""
        return self._cut(self.placement(left), self.placement(right), last_layer, mbs)[0]

    def cut_latency_s(self, left: tuple[Replica, ...], right: tuple[Replica, ...],
                      mbs: int) -> float:
        """The part of :meth:`cut_s` that is the link's latency rather than its transfer: a
        link carries the next message while the last one is still in flight. Where the cut
        takes several links, the least of their latencies (the link is never taken for freer
        than it is)."""
        return self._cut(self.placement(left), self.placement(right), 0, mbs)[1]

    def _cut(self, left: Placement, right: Placement, last_layer: int,
             mbs: int) -> tuple[float, float]:
        """(:meth:`cut_s`, :meth:`cut_latency_s`) from one walk of the cut's routes."""
        key = (left, right, last_layer, mbs)
        got = self._cuts.get(key)
        if got is None:
            nbytes = lambda n: self.model.boundary_bytes(last_layer, n)  # noqa: E731
            routes = self._cut_routes(left, right, mbs)
            got = self._cuts[key] = (
                max(sum(link.transfer_s(nbytes(n)) for link, n in route) for route in routes),
                min(link.latency_us for route in routes for link, _ in route) * 1e-6)
        return got

    def _cut_routes(self, left: Placement, right: Placement,
                    mbs: int) -> list[list[tuple[LinkSpec, int]]]:
        """The cut as routes, each a list of (link, samples) moved one after another; routes
        run side by side. Between two stages of alike replicas: in different groups, the whole
        micro-batch over the group link; inside a group, each rank its share over the intra- or
        inter-node link (the busiest rank sets the cut). Where a stage's replicas differ, the
        pieces each pair of replicas shares (:func:`~hapt_hf.core.shares.overlaps`): all pieces
        between two groups share their group link as one route; inside a group each GPU moves
        its own pieces, one after another, to its peers."""
        if left.alike and right.alike:
            if left.group.name != right.group.name:
                return [[(self._neighbour_link(left.group.name, right.group.name), mbs)]]
            g = left.group
            same_node = len(set(left.node) | set(right.node)) == 1
            link = g.intra_node if same_node else g.inter_node
            return [[(link, max(mbs // left.width, mbs // right.width))]]
        pipes: dict[tuple[str, str], int] = {}
        per_gpu: dict[tuple[int, int], dict[LinkSpec, int]] = {}
        for i, j, n in overlaps([r.samples for r in left.replicas],
                                [r.samples for r in right.replicas]):
            x, y = left.group_of[i], right.group_of[j]
            if x.name != y.name:
                pipes[(x.name, y.name)] = pipes.get((x.name, y.name), 0) + n
                continue
            link = x.intra_node if left.node[i] == right.node[j] else x.inter_node
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

    def stages_of(self, plan: Plan) -> tuple[Stage, ...]:
        """The plan's stages with their ranks checked against their groups and numbered as
        this cost model numbers them. A plan numbers its ranks group by group in file order
        over the groups it uses; where it leaves groups idle, the ranks are renumbered over
        every group of the cluster (the same stages otherwise)."""
        first_rank = self.cluster.subset(self.used_groups(plan)).first_ranks()
        out = []
        for s in plan.stages:
            reps = tuple(self._renumbered(s.index, r, first_rank) for r in s.replicas)
            same = all(x is y for x, y in zip(reps, s.replicas))
            out.append(s if same else replace(s, replicas=reps))
        return tuple(out)

    def _renumbered(self, index: int, r: Replica, first_rank: dict[str, int]) -> Replica:
        g = self.group(r.group)
        ranks = []
        for rank in r.ranks:
            idx = rank - first_rank.get(g.name, rank + 1)  # an idle group: out of range
            if not 0 <= idx < g.size:
                raise CostModelError(
                    f"stage {index}: replica rank {rank} is said to be in group {g.name!r}, "
                    f"which holds ranks {first_rank.get(g.name, '?')}.. (ranks are numbered "
                    "group by group, in file order, over the groups the plan uses); give each "
                    "replica a rank of its own group")
            ranks.append(self._first[g.name] + idx)
        return r if tuple(ranks) == r.ranks else replace(r, ranks=tuple(ranks))

    def stage_costs(self, stages: Sequence[Stage], mbs: int) -> StageCosts:
        """Costs of a pipeline of ``stages`` (their replicas, layer ranges, recompute flags and
        optimizer states; ranks numbered as :meth:`placement` reads them) at micro-batch size
        ``mbs``."""
        n = len(stages)
        if self.model.num_layers and stages and stages[-1].layers[1] > self.model.num_layers:
            raise CostModelError(f"the stages reach layer {stages[-1].layers[1]} but the model "
                                 f"has {self.model.num_layers} layers")
        places = [self.placement(s.replicas) for s in stages]
        # each cut's (seconds, latency); nothing leaves the first stage backward or the last
        # forward
        cuts = [self._cut(places[i], places[i + 1], stages[i].layers[1] - 1, mbs)
                for i in range(n - 1)]
        fwd, bwd = cuts + [(0.0, 0.0)], [(0.0, 0.0)] + cuts
        return StageCosts(tuple(self._stage_cost(p, s, fwd[i], bwd[i])
                                for i, (p, s) in enumerate(zip(places, stages))))

    def _stage_cost(self, p: Placement, stage: Stage, send_f: tuple[float, float],
                    send_b: tuple[float, float]) -> StageCost:
        """One stage: its slowest replica's times, the first replica's memory and, where the
        replicas differ, every kind's."""
        (a, b), rc, opt, d = stage.layers, stage.recompute, stage.optimizer, p.width
        f, bw, slow = self._slowest(p, a, b, rc)
        ar = self._window(p, slow, a, b, rc)
        first_samples = p.replicas[0].samples
        return StageCost(
            forward_s=f, backward_s=bw,
            send_forward_s=send_f[0], send_backward_s=send_b[0],
            send_forward_latency_s=send_f[1], send_backward_latency_s=send_b[1],
            allreduce_s=ar.link_s,
            update_s=max(self.update_s(g, s, a, b, opt, d) for g, s in p.kinds),
            static_bytes=self.static_bytes(a, b, opt, d),
            activation_bytes=self.activation_bytes(first_samples, a, b, rc),
            working_bytes=self.working_bytes(first_samples, a, b),
            capacity_bytes=self.capacity_bytes(p.group),
            recompute=rc, allreduce_lead_s=ar.lead_s, allreduce_exposed_s=ar.exposed_s,
            allgather_s=self._allgather(p, a, b, opt), optimizer=opt,
            replica_memory=() if p.alike else tuple(
                ReplicaMemory(self.activation_bytes(s, a, b, rc), self.working_bytes(s, a, b),
                              self.capacity_bytes(g)) for g, s in p.kinds))

    def plan_costs(self, plan: Plan) -> StageCosts:
        stages = self.stages_of(plan)
        mbs = plan.micro_batch_size
        for s in stages:
            if not s.uneven and mbs % s.width:
                raise CostModelError(f"stage {s.index} has {s.width} replicas but "
                                     f"micro_batch_size is {mbs}; make it a multiple of every "
                                     "stage's width")
            if sum(s.shares()) != mbs:
                raise CostModelError(f"stage {s.index}: replica samples {list(s.shares())} sum "
                                     f"to {sum(s.shares())}, but micro_batch_size is {mbs}; "
                                     "they must sum to it")
        return self.stage_costs(stages, mbs)

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
