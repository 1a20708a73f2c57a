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
  flight, what its layers keep for the backward (``act_keep_bytes`` per sample), plus once
  for the step ``act_keep_fixed_bytes`` (autocast's 16-bit weight copies, which the runtime
  shares among a step's micro-batches in flight: ``pipeline.precision.SharedWeightCasts``),
  plus one layer's working set. Recompute keeps only the blocks' inputs and no weight copies,
  and pays one more forward in the backward.
* A sharded stage's replicas each run the Adam step on their ``1/d`` of the parameters, then
  the updated fp32 weights go from their owners to the other replicas, priced as a ring
  all-gather ``(d-1)/d * 4 * params / bw + (d-1) * lat`` on the replica link, after the
  all-reduce and the step (nothing overlaps it).
* Activations and their gradients cross stage boundaries at the compute dtype
  (``act_out_bytes``); the data-parallel all-reduce moves the fp32 weight gradients
  (:data:`~hapt_hf.core.precision.MASTER_BYTES` per parameter).
* Tensor parallelism (a replica held by ``t`` ranks of one node, ``Replica.ranks``): the
  blocks' compute splits ``t`` ways at :func:`tp_efficiency` (a profile's timing at degree
  ``t`` where it has one), plus per block two all-reduces of its activations (``samples x seq x
  hidden`` at the compute dtype) forward and two backward, ring-priced on the group's
  intra-node link, or at a profile's measured figures for ``t`` of its ranks
  (``Profile.tp_link``), ``2(t-1)/t * bytes / bw + 2(t-1) * lat`` (a profile timing that
  includes them adds none); the embedding and the head stay whole on every rank and run at one GPU's
  speed. Per rank: the blocks' sharded projections' weights, gradients and optimizer state
  divide by ``t`` (norms and row-wise biases whole: :meth:`ModelSpec.tp_whole_params`), a
  block's kept activations are ``(10 + 24/t) / 34`` of one GPU's (Korthikanti et al., no
  sequence parallelism; ``(34/t) / 34`` on a stage that runs its blocks sequence
  parallel, which pays one all-gather of its output forward and one backward), autocast's
  weight copies ``1/t``, and the data-parallel all-reduce
  and the optimizer step move and update the rank's shard. ``t`` is read off the replicas;
  for the search, :class:`CostModel` takes a degree per group (``tp``) and shows it
  :attr:`CostModel.cluster` with each group's ``t`` GPUs as one (its sizes divided by ``t``),
  building replicas of ``t`` consecutive ranks.
"""
from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Mapping, Sequence

from hapt_hf.core.defaults import DEFAULT_MEMORY_HEADROOM, GRAD_BUCKET_BYTES
from hapt_hf.core.precision import (DTYPE_BYTES, MASTER_BYTES, REPLICATED, SHARDED,
                                     STATE_BYTES_PER_PARAM, state_bytes_per_param)
from hapt_hf.core.shares import overlaps
from hapt_hf.core.tp import (TP_DEGREES, block_activation_parts, head_sharded, sp_refusal,
                             tp_refusal)
from hapt_hf.errors import CostModelError

from .cluster import Cluster, GpuGroup, LinkSpec
from .model_spec import LayerSpec, ModelSpec
from .plan import Plan, Replica, Stage, even_replicas
from .profile import LayerTiming, Profile

__all__ = ["DEFAULT_EFFICIENCY", "STATE_BYTES_PER_PARAM", "GRAD_BUCKET_BYTES", "CostModelError",
           "Placement", "StageCost", "ReplicaMemory", "StageCosts", "AllReduceWindow",
           "CostModel", "overlapped_allreduce", "tp_efficiency", "tp_unfit", "TP_ACT_KEPT",
           "sp_unfit", "head_split"]

DEFAULT_EFFICIENCY = 0.4
"""Fraction of a GPU's peak dense TFLOP/s that the analytic fallback assumes layers reach."""

_TP_EFFICIENCY_WIDE = {1: 1.0, 2: 0.97, 4: 0.94, 8: 0.90}
_TP_EFFICIENCY_NARROW = {1: 1.0, 2: 0.90, 4: 0.75, 8: 0.60}
TP_WIDE_HIDDEN = 4096
"""From this hidden size up a block's shards stay wide GEMMs (the wide efficiencies apply)."""


def tp_efficiency(t: int, hidden_size: int) -> float:
    """Where no profile timed a block at degree ``t``: the fraction of ``t`` times one GPU's
    speed its shards reach together (smaller GEMMs run less efficiently). From the Sailor
    measurements (A100-40, V100-16, timed at degrees 1, 2, 4, 8 with their all-reduces, so
    these figures err low): OPT-30 (hidden 7168) 0.97-0.98 at 2 and 0.93-0.96 at 4, the basis
    of 0.97 / 0.94 / 0.90 from hidden 4096 up; OPT-350 and GPT-Neo-2.7 (hidden 1024-2560, four
    samples) 0.85-0.97 at 2, 0.65-0.90 at 4, 0.63-0.83 at 8, the basis of 0.90 / 0.75 / 0.60
    below it."""
    table = _TP_EFFICIENCY_WIDE if hidden_size >= TP_WIDE_HIDDEN else _TP_EFFICIENCY_NARROW
    return table[t]


TP_ACT_KEPT = (10, 24, 34)
"""Korthikanti et al. (2022), without sequence parallelism: of the 34 parts of ``s*b*h`` a
block keeps, 10 (its inputs, norms, dropout masks) stay whole on each rank and 24 split ``t``
ways: a rank keeps ``(10 + 24/t) / 34`` of one GPU's. With sequence parallelism, what the
runtime keeps: ``(34/t) / 34`` (:func:`~hapt_hf.core.tp.block_activation_parts`: the
attention's and the MLP's gathered inputs kept split and gathered again in the backward, as
Megatron-LM does)."""


def tp_unfit(model: ModelSpec, t: int) -> str | None:
    """Why replicas of ``t`` ranks cannot hold ``model``'s blocks, or None where they can: the
    degrees the planner searches (:data:`~hapt_hf.core.tp.TP_DEGREES`), dividing the attention
    heads, key/value heads and MLP width (:func:`~hapt_hf.core.tp.tp_refusal`)."""
    if t == 1:
        return None
    if t not in TP_DEGREES:
        return f"tensor-parallel degree {t} is not one of {TP_DEGREES}"
    if model.tp_plan_refusal:
        return model.tp_plan_refusal
    if not model.num_heads or not model.intermediate_size:
        return (f"model {model.name!r} gives no attention heads or MLP width, so no "
                "tensor-parallel degree above 1 can be checked against them")
    return tp_refusal(t, model.num_heads, model.num_kv_heads or None, model.intermediate_size)


def sp_unfit(model: ModelSpec, t: int) -> str | None:
    """Why a stage of ``model`` held by ``t`` ranks cannot run its blocks sequence parallel,
    or None where it can: :func:`tp_unfit`, then the runtime's rule
    (:func:`~hapt_hf.core.tp.sp_refusal`: the model type, its tensor-parallel plan, ``t`` above
    1, whole blocks)."""
    return tp_unfit(model, t) or sp_refusal(model.family, dict(model.tp_plan) or None, t,
                                            model.layer_unit)


def head_split(model: ModelSpec, t: int) -> bool:
    """Whether a last stage of ``t`` ranks splits the LM head by vocabulary rows over them, as
    the runtime does (:func:`~hapt_hf.core.tp.head_sharded`)."""
    return tp_unfit(model, t) is None and \
        head_sharded(t, dict(model.head_tp_plan) or None, model.tied_embeddings)

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
    tp: int = 1
    """Ranks of each replica (its tensor-parallel degree), equal for every replica."""


@functools.lru_cache(maxsize=1 << 16)
def _slice(group: str, device_type: str, width: int, first: int,
           samples: int, tp: int = 1) -> tuple[Replica, ...]:
    # one tuple object per slice: the cost model caches what it derives from it by identity
    if tp == 1:
        return even_replicas(group, device_type, range(first, first + width), samples)
    return tuple(Replica(group, device_type, samples,
                         tuple(range(first + i * tp, first + (i + 1) * tp)))
                 for i in range(width))


@dataclass(frozen=True)
class _Shard:
    """Per-rank prefix sums over the layer sequence at one tensor-parallel degree."""

    params: tuple[float, ...]
    keep: tuple[float, ...]
    keep_rc: tuple[float, ...]
    fixed: tuple[float, ...]
    fixed_rc: tuple[float, ...]
    keep_max: tuple[tuple[float, ...], ...]
    """keep_max[a][k]: the most one of layers [a, a + k] keeps per sample (a working set)."""


def _shard(model: ModelSpec, t: int, sp: bool = False) -> _Shard:
    layers = model.layers
    is_block = [l.kind == "block" for l in layers]
    kept = block_activation_parts(t, sp) / TP_ACT_KEPT[2]  # of one GPU's, a block
    if t == 1:
        params = [l.params for l in layers]
        keep = [l.act_keep_bytes for l in layers]
        fixed = [l.act_keep_fixed_bytes for l in layers]
    else:
        params = [(w := model.tp_whole_params(l)) + (l.params - w) / t if b else l.params
                  for l, b in zip(layers, is_block)]
        keep = [l.act_keep_bytes * kept if b else l.act_keep_bytes
                for l, b in zip(layers, is_block)]
        if head_split(model, t):
            params[-1], keep[-1] = head_rank_params(model, t), head_rank_keep_bytes(model, t)
        fixed = [l.act_keep_fixed_bytes / t if b else l.act_keep_fixed_bytes
                 for l, b in zip(layers, is_block)]
    # a recomputed block keeps only its input (whole on every rank; split on the sequence
    # under sequence parallelism) and no weight copies
    keep_rc = [l.act_in_bytes / (t if sp else 1) if b else k
               for l, k, b in zip(layers, keep, is_block)]
    fixed_rc = [0.0 if b else f for f, b in zip(fixed, is_block)]
    keep_max = []
    for a in range(len(layers)):
        run, row = 0.0, []
        for k in keep[a:]:
            run = max(run, k)
            row.append(run)
        keep_max.append(tuple(row))
    return _Shard(_prefix(params), _prefix(keep), _prefix(keep_rc), _prefix(fixed),
                  _prefix(fixed_rc), tuple(keep_max))


def head_rank_params(model: ModelSpec, t: int) -> float:
    """Parameters of the LM head on each of ``t`` ranks that split it by vocabulary rows: the
    final norm whole, ``ceil(V / t)`` rows of the ``V x hidden`` matrix (torch's chunks)."""
    head = model.layers[-1]
    matrix = model.vocab_size * model.hidden_size
    return head.params - matrix + -(-model.vocab_size // t) * model.hidden_size


def loss_softmax_bytes(model: ModelSpec, t: int = 1) -> float:
    """The fp32 softmax the loss keeps a sample on each of ``t`` ranks: ``ceil(V / t)``
    columns of the logits (:mod:`hapt_hf.pipeline.vocab_parallel`; ``t = 1``: the whole
    vocabulary, the part of the head's ``act_keep_bytes`` that is the loss's)."""
    return MASTER_BYTES * model.seq_len * -(-model.vocab_size // t)


def head_rank_keep_bytes(model: ModelSpec, t: int) -> float:
    """What the LM head keeps a sample on each of ``t`` ranks that split it by vocabulary rows:
    the loss is taken on each rank's ``ceil(V / t)`` columns of the logits, so its fp32
    softmax is that many columns wide (:func:`loss_softmax_bytes`); the head's input, the
    final norm's and the labels stay whole."""
    return model.layers[-1].act_keep_bytes - loss_softmax_bytes(model) \
        + loss_softmax_bytes(model, t)


def _fat_cluster(cluster: Cluster, tp: Mapping[str, int]) -> Cluster:
    """The cluster as the search sees it: each group's ``t`` GPUs of a replica as one."""
    groups = tuple(replace(g, gpus_per_node=g.gpus_per_node // tp[g.name]) if tp[g.name] > 1
                   else g for g in cluster.groups)
    return Cluster(cluster.name, groups, cluster.links, cluster.job, cluster.profiles)


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
    """One layer's working set, plus the step's 16-bit weight copies its micro-batches in
    flight share (:meth:`CostModel.weight_copy_bytes`)."""
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
    recompute_s: float = 0.0
    """Partial recompute (``Stage.recompute_layers``): the seconds of ``backward_s`` that
    recompute the forward of the stage's first blocks (under ``recompute`` the whole forward,
    ``forward_s``, stands for it)."""
    split_ratios: tuple[float, float] | None = None
    """(``I / B``, ``W / B``): the split backward's parts over the fused backward, measured on
    the stage's device (``Profile.step_overheads``); None where not measured (the replay then
    divides ``backward_s`` by a share, ``I + W = B``)."""

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

    def most_held(self, num_microbatches: int) -> int:
        """The most micro-batches' activations the stage's GPU holds within its usable memory
        (``num_microbatches`` where the cost model knows no capacity): the bound a schedule
        kind that holds more than its warm-up (``zero_bubble``'s deferred weight gradients)
        is cut to."""
        k = 0
        while k < num_microbatches:
            use, usable = self.memory_use(k + 1)
            if usable > 0 and use > usable:
                break
            k += 1
        return k


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
            dtype: str, tp: int = 1) -> LayerTiming | None:
    """The layer's measured timing; a block half without its own entry takes its FLOP share
    of the whole block's (profiles time whole blocks)."""
    hit = profile.lookup(device, layer.signature, samples, seq_len, dtype, tp)
    if hit is not None or not layer.profile_signature:
        return hit
    whole = profile.lookup(device, layer.profile_signature, samples, seq_len, dtype, tp)
    if whole is None:
        return None
    f = layer.profile_share
    return LayerTiming(whole.forward_s * f, whole.backward_s * f, whole.update_s * f,
                       whole.peak_memory_bytes, whole.spread,
                       tp_comm_included=whole.tp_comm_included)


def _prefix(values) -> tuple[float, ...]:
    return (0.0, *accumulate(values))


class CostModel:
    """Prices stages of one model on one cluster; caches per (device, samples) tables.

    ``tp``: the tensor-parallel degree the search gives each group's replicas (absent: 1).
    :attr:`cluster` is the cluster as the search sees it, each replica's GPUs as one (a group
    of ``n`` GPUs at degree ``t`` shows ``n / t``), :attr:`hardware` the cluster itself;
    :meth:`slice_replicas` and :meth:`gpu_replicas` build replicas of ``t`` ranks. Stages are
    priced at the degree their replicas hold, whatever ``tp`` says."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profile: Profile | None = None,
                 efficiency: float = DEFAULT_EFFICIENCY,
                 memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                 tp: Mapping[str, int] | None = None):
        if not 0 < efficiency <= 1:
            raise CostModelError(f"efficiency {efficiency} must be in (0, 1]")
        if not 0 < memory_headroom <= 1:
            raise CostModelError(f"memory_headroom {memory_headroom} must be in (0, 1]; it is "
                                 "the fraction of GPU memory the plan may use")
        self.model = model
        self.hardware = cluster
        self.tp = {g.name: 1 for g in cluster.groups}
        for name, t in (tp or {}).items():
            g = next((g for g in cluster.groups if g.name == name), None)
            if g is None:
                raise CostModelError(f"tp names group {name!r}, which cluster {cluster.name!r} "
                                     f"does not have (groups: {', '.join(cluster.group_names)})")
            why = tp_unfit(model, t) or (
                f"group {name!r} has {g.gpus_per_node} GPUs per node, which {t} does not "
                "divide (a replica's ranks sit in one node)" if g.gpus_per_node % t else None)
            if why:
                raise CostModelError(f"tensor-parallel degree {t} for group {name!r}: {why}")
            self.tp[name] = t
        self.cluster = cluster if all(t == 1 for t in self.tp.values()) \
            else _fat_cluster(cluster, self.tp)
        self.profile = profile
        self.efficiency = efficiency
        self.memory_headroom = memory_headroom
        self._groups = {g.name: g for g in cluster.groups}
        self._tables: dict[tuple, _LayerTable] = {}
        self._rates: dict[tuple, float] = {}
        self._mem_prefix: dict[tuple, list[float]] = {}
        self._windows: dict[tuple, AllReduceWindow] = {}
        self._first = cluster.first_ranks()
        self._placements: dict[int, Placement] = {}
        self._cuts: dict[tuple[Placement, Placement, int, int], tuple[float, float]] = {}
        self._is_block = tuple(l.kind == "block" for l in model.layers)
        self._shards: dict[tuple[int, bool], _Shard] = {}
        one = self.shard(1)
        self.params, self.keep, self.keep_rc = one.params, one.keep, one.keep_rc
        # per micro-batch whatever its size; a recomputed block keeps no weight copies
        self.fixed, self.fixed_rc = one.fixed, one.fixed_rc
        self.grad_dtype_bytes = MASTER_BYTES  # weight gradients are fp32 in every precision
        self.state_bytes = STATE_BYTES_PER_PARAM

    def shard(self, tp: int, sp: bool = False) -> _Shard:
        """Per-rank prefix sums of the layers at tensor-parallel degree ``tp`` (its blocks
        sequence parallel where ``sp``)."""
        key = (tp, sp and tp > 1)
        got = self._shards.get(key)
        if got is None:
            got = self._shards[key] = _shard(self.model, *key)
        return got

    def sp_allowed(self, tp: int) -> bool:
        """Whether a stage of replicas of ``tp`` ranks may run its blocks sequence parallel
        (:func:`sp_unfit`)."""
        return tp > 1 and sp_unfit(self.model, tp) is None

    def tp_of(self, group: GpuGroup) -> int:
        """The tensor-parallel degree the search gives ``group``'s replicas."""
        return self.tp[group.name]

    def with_tp(self, tp: Mapping[str, int]) -> "CostModel":
        """The same model, cluster and profile priced for a search at these degrees."""
        return CostModel(self.model, self.hardware, self.profile, self.efficiency,
                         self.memory_headroom, tp)

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
        t = self.tp[group.name]
        return _slice(group.name, group.gpu.name, width, self._first[group.name] + offset * t,
                      mbs // width, t)

    def replicas_at(self, group: GpuGroup, first_gpu: int, width: int, tp: int,
                    mbs: int) -> tuple[Replica, ...]:
        """``width`` replicas of ``tp`` consecutive GPUs of ``group`` from its GPU
        ``first_gpu`` (an index of :attr:`hardware`, whatever degree ``self.tp`` gives the
        group), splitting a micro-batch of ``mbs`` evenly: a stage at a degree of its own."""
        return _slice(group.name, group.gpu.name, width, self._first[group.name] + first_gpu,
                      mbs // width, tp)

    def first_gpu(self, replicas: tuple[Replica, ...]) -> int:
        """The index, inside its group of :attr:`hardware`, of the first GPU of ``replicas``."""
        return replicas[0].ranks[0] - self._first[replicas[0].group]

    def gpu_replicas(self, gpus, shares) -> tuple[Replica, ...]:
        """One replica per ``(group, index in group)`` of ``gpus`` with its share (an index of
        :attr:`cluster`: at degree ``t``, replica ``i`` holds the group's GPUs ``i*t`` on)."""
        out = []
        for (g, i), s in zip(gpus, shares):
            t, first = self.tp[g.name], self._first[g.name]
            out.append(Replica(g.name, g.gpu.name, s,
                               tuple(range(first + i * t, first + (i + 1) * t))))
        return tuple(out)

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
        tp = replicas[0].tp
        if tp > 1:
            self._check_tp(replicas, group_of, tp)
        groups = tuple({g.name: g for g in group_of}.values())
        kinds = {(g.gpu.name, g.gpu.tflops, r.samples): (g, r.samples)
                 for r, g in zip(replicas, group_of)}
        alike = len(groups) == 1 and len({r.samples for r in replicas}) == 1
        on_cpu = any(g.gpu.is_cpu for g in groups)

        def placed(link: LinkSpec | None, error: str = "") -> Placement:
            return Placement(replicas, len(replicas), group_of[0], group_of, index, node, groups,
                             alike, tuple(kinds.values()), on_cpu, link, error, tp)

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

    def _check_tp(self, replicas: tuple[Replica, ...], group_of: tuple[GpuGroup, ...],
                  tp: int) -> None:
        """A replica of ``tp`` ranks: as many for every replica, inside one node of its group,
        a degree the model allows."""
        why = tp_unfit(self.model, tp)
        if why:
            raise CostModelError(f"replicas of {tp} ranks: {why}")
        for r, g in zip(replicas, group_of):
            idx = [rank - self._first[g.name] for rank in r.ranks]
            if r.tp != tp:
                raise CostModelError(f"a stage's replicas hold {[x.tp for x in replicas]} ranks; "
                                     "give every replica of a stage the same number")
            if not all(0 <= i < g.size for i in idx) or \
                    len({i // g.gpus_per_node for i in idx}) != 1:
                raise CostModelError(
                    f"replica ranks {list(r.ranks)} are not {tp} GPUs of one node of group "
                    f"{g.name!r} (ranks {self._first[g.name]}.."
                    f"{self._first[g.name] + g.size - 1}, {g.gpus_per_node} a node); a "
                    "tensor-parallel replica's ranks sit in one node")

    def table(self, group: GpuGroup, samples: int, tp: int = 1) -> _LayerTable:
        """Per-layer times of one replica computing ``samples`` samples on ``group``'s GPUs,
        held by ``tp`` of them together."""
        key = (group.gpu.name, group.gpu.tflops, samples) if tp == 1 else \
            (group.gpu.name, group.gpu.tflops, samples, tp, group.name, group.intra_node)
        t = self._tables.get(key)
        if t is None:
            t = self._build_table(group, samples, tp)
            self._tables[key] = t
        return t

    def tp_allreduce_s(self, group: GpuGroup, samples: int, tp: int, layer: int) -> float:
        """The tensor-parallel all-reduces one forward (or one backward) of ``layer`` runs on
        a replica of ``tp`` ranks of ``group`` computing ``samples``: ring all-reduces of the
        layer's output activations on the group's intra-node link, or at the figures the
        profile measured for ``tp`` of the group's ranks (``Profile.tp_link``)."""
        spec = self.model.layers[layer]
        n = self.model.tp_allreduces(spec)
        if tp == 1 or not n:
            return 0.0
        return n * self._tp_ring_allreduce_s(group, tp, samples * spec.act_out_bytes)

    def _tp_ring_allreduce_s(self, group: GpuGroup, tp: int, nbytes: float) -> float:
        """One ring all-reduce of ``nbytes`` over a replica's ``tp`` ranks:
        ``2 (t-1)/t * bytes / bw + 2 (t-1) * lat``."""
        link = self._tp_link(group, tp)
        return (2 * (tp - 1) / tp * nbytes * 8 / (link.bandwidth_gbps * 1e9)
                + 2 * (tp - 1) * link.latency_us * 1e-6)

    def _tp_link(self, group: GpuGroup, tp: int) -> LinkSpec:
        """The link a replica's collectives run on: the group's intra-node link, or what the
        profile measured for ``tp`` of its ranks."""
        measured = self.profile.tp_link(group.name, tp) if self.profile is not None else None
        if measured is not None:
            return LinkSpec(measured.bandwidth_gbps, measured.latency_us)
        return group.intra_node

    def tp_allgather_s(self, group: GpuGroup, tp: int, nbytes: float) -> float:
        """A ring all-gather over a replica's ``tp`` ranks that leaves ``nbytes`` on each (each
        rank contributing ``1/tp``): ``(t-1)/t * bytes / bw + (t-1) * lat``."""
        if tp == 1:
            return 0.0
        link = self._tp_link(group, tp)
        return ((tp - 1) / tp * nbytes * 8 / (link.bandwidth_gbps * 1e9)
                + (tp - 1) * link.latency_us * 1e-6)

    def sp_edge_s(self, group: GpuGroup, samples: int, tp: int, a: int, b: int) -> float:
        """What sequence parallelism adds to a stage of layers [a, b) on a replica of ``tp``
        ranks, once forward and once backward per micro-batch: the all-gather on the sequence
        of its last block's output forward (and of its first block's input gradient backward),
        ``samples x seq x hidden`` at the compute dtype; 0 without a block."""
        blocks = [j for j in range(a, b) if self._is_block[j]]
        if not blocks:
            return 0.0
        return self.tp_allgather_s(group, tp, samples * self.model.layers[blocks[-1]].act_out_bytes)

    def sp_regather_s(self, group: GpuGroup, samples: int, tp: int, a: int, b: int) -> float:
        """What sequence parallelism adds to the backward of layers [a, b) beyond plain tensor
        parallelism's, unless the stage recomputes: the attention's and the MLP's inputs
        all-gathered again on the sequence for the projections' weight gradients (their
        slices were kept), one all-gather of ``samples x seq x hidden`` each."""
        m = self.model
        return sum(m.tp_allreduces(m.layers[j])
                   * self.tp_allgather_s(group, tp, samples * m.layers[j].act_out_bytes)
                   for j in range(a, b) if self._is_block[j])

    def head_comm_s(self, group: GpuGroup, samples: int, tp: int) -> tuple[float, float]:
        """(forward, backward) collectives of an LM head split by vocabulary rows over a
        replica of ``tp`` ranks: the loss's two all-reduces of fp32 numbers a token (the
        largest logit; the sum of the exponentials with the target's logit) on the logits
        left split (:mod:`hapt_hf.pipeline.vocab_parallel`), and the all-reduce of the head
        input's gradient (``samples x seq x hidden`` at the compute dtype)."""
        m = self.model
        tokens = samples * m.seq_len
        ring = lambda nbytes: self._tp_ring_allreduce_s(group, tp, nbytes)  # noqa: E731
        return (ring(tokens * MASTER_BYTES) + ring(2 * tokens * MASTER_BYTES),
                ring(tokens * m.hidden_size * DTYPE_BYTES[m.dtype]))

    def _build_table(self, group: GpuGroup, samples: int, tp: int = 1) -> _LayerTable:
        m = self.model
        speed = group.gpu.tflops * 1e12 * self.efficiency
        mem_bw = group.gpu.tflops * 1e12 / FLOPS_PER_MEMORY_BYTE
        fwd, bwd, upd = [], [], []
        measured = self.profile is not None
        per_rank = self.shard(tp).params
        eff = tp_efficiency(tp, m.hidden_size) if tp > 1 else 1.0
        split_head = tp > 1 and head_split(m, tp)
        for j, layer in enumerate(m.layers):
            hit = None
            if self.profile is not None:
                hit = _lookup(self.profile, group.gpu.name, layer, samples, m.seq_len, m.dtype)
            if hit is not None:
                f, b = hit.forward_s, hit.backward_s
                u = hit.update_s if hit.update_s > 0 \
                    else layer.params * UPDATE_BYTES_PER_PARAM / mem_bw
            else:
                measured = False
                f, b = samples * layer.fwd_flops / speed, samples * layer.bwd_flops / speed
                u = layer.params * UPDATE_BYTES_PER_PARAM / mem_bw
            if tp > 1 and self._is_block[j]:
                f, b, u = self._tp_times(group, samples, tp, j, (f, b, u), eff,
                                         per_rank[j + 1] - per_rank[j])
            elif tp > 1 and split_head and j == len(m.layers) - 1:
                # the head's matmul split by vocabulary rows at the blocks' efficiency, plus
                # its collectives (the loss on each rank's columns); its norm stays whole
                hf, hb = self.head_comm_s(group, samples, tp)
                u = u * (per_rank[j + 1] - per_rank[j]) / layer.params if layer.params else u
                f, b = f / (tp * eff) + hf, b / (tp * eff) + hb
            fwd.append(f)
            bwd.append(b)
            upd.append(u)
        block_fwd = [f if b else 0.0 for f, b in zip(fwd, self._is_block)]
        fb = [f + b for f, b in zip(fwd, bwd)]
        return _LayerTable(_prefix(fwd), _prefix(bwd), _prefix(upd), _prefix(block_fwd),
                           measured, _prefix(fb),
                           _prefix(x + r for x, r in zip(fb, block_fwd)))

    def _tp_times(self, group: GpuGroup, samples: int, tp: int, j: int,
                  one: tuple[float, float, float], eff: float,
                  rank_params: float) -> tuple[float, float, float]:
        """(forward, backward, update) of block ``j`` on a replica of ``tp`` ranks, from its
        times on one GPU (``one``): a profile's timing at degree ``tp`` where it has one, else
        the compute split ``tp`` ways at ``eff``; plus the all-reduces a timing does not
        include; the update of the rank's share of the parameters."""
        layer, m = self.model.layers[j], self.model
        f, b, u = one
        u = u * rank_params / layer.params if layer.params else u
        ar = self.tp_allreduce_s(group, samples, tp, j)
        hit = None
        if self.profile is not None:
            hit = _lookup(self.profile, group.gpu.name, layer, samples, m.seq_len, m.dtype, tp)
        if hit is not None:
            # never faster than a t-th of one GPU's time (a profile's noise could say so), so
            # the physical limit, which counts every GPU alone, stays a bound
            extra = 0.0 if hit.tp_comm_included else ar
            return (max(hit.forward_s, f / tp) + extra, max(hit.backward_s, b / tp) + extra, u)
        return f / (tp * eff) + ar, b / (tp * eff) + ar, u

    # -- per stage -------------------------------------------------------------------------
    def recompute_end(self, a: int, b: int, recompute: bool, units: int = 0) -> int:
        """Where the recomputed run of a stage of layers [a, b) ends: ``b`` under
        ``recompute``, else after its first ``units`` block units (``Stage.recompute_layers``;
        the embedding, layer 0, is no block), ``a`` where none recompute. Layers [a, end)
        recompute, [end, b) keep their activations."""
        if recompute:
            return b
        if units <= 0:
            return a
        return min(max(a, 1) + units, b)

    def compute_s(self, group: GpuGroup, samples: int, a: int, b: int,
                  recompute: bool = False, tp: int = 1, units: int = 0) -> tuple[float, float]:
        """(forward, backward) seconds of layers [a, b) for one replica's ``samples`` (held by
        ``tp`` GPUs); the backward repeats the forward of the blocks that recompute (all of
        them under ``recompute``, else the first ``units``)."""
        t = self.table(group, samples, tp)
        f = t.fwd[b] - t.fwd[a]
        bw = t.bwd[b] - t.bwd[a]
        e = self.recompute_end(a, b, recompute, units)
        if e > a:
            bw += t.block_fwd[e] - t.block_fwd[a]
        return f, bw

    def static_bytes(self, a: int, b: int, optimizer: str = REPLICATED, width: int = 1,
                     tp: int = 1) -> float:
        """Weights, gradients and optimizer state of layers [a, b) on one GPU of a stage of
        ``width`` replicas of ``tp`` ranks keeping its state ``optimizer``."""
        params = self.shard(tp).params
        return (params[b] - params[a]) * state_bytes_per_param(optimizer, width)

    def activation_bytes(self, samples: int, a: int, b: int, recompute: bool = False,
                         tp: int = 1, sp: bool = False, units: int = 0) -> float:
        """What one micro-batch of ``samples`` keeps in layers [a, b) until its backward, on
        each of a replica's ``tp`` ranks (sequence parallel where ``sp``); a recomputed block
        (all under ``recompute``, else the first ``units``) keeps only its input. The weight
        copies every micro-batch in flight shares are :meth:`weight_copy_bytes`."""
        sh = self.shard(tp, sp)
        if units and not recompute:
            e = self.recompute_end(a, b, False, units)
            return samples * (sh.keep_rc[e] - sh.keep_rc[a] + sh.keep[b] - sh.keep[e])
        pre = sh.keep_rc if recompute else sh.keep
        return samples * (pre[b] - pre[a])

    def weight_copy_bytes(self, a: int, b: int, recompute: bool = False, tp: int = 1,
                          units: int = 0) -> float:
        """What layers [a, b) keep once for a step's micro-batches in flight, whatever their
        number and size, on each of a replica's ``tp`` ranks: autocast's 16-bit copies of the
        matmul weights (``act_keep_fixed_bytes``), which the runtime shares among the step's
        micro-batches (``pipeline.precision.SharedWeightCasts``); none for a recomputed block
        (its recomputed forward casts them again)."""
        sh = self.shard(tp)
        e = self.recompute_end(a, b, recompute, units)
        return sh.fixed_rc[e] - sh.fixed_rc[a] + sh.fixed[b] - sh.fixed[e]

    def working_bytes(self, samples: int, a: int, b: int, tp: int = 1,
                      sp: bool = False) -> float:
        return samples * self.shard(tp, sp).keep_max[a][b - a - 1]

    def memory_bytes(self, samples: int, a: int, b: int, in_flight: int,
                     recompute: bool = False, optimizer: str = REPLICATED,
                     width: int = 1, tp: int = 1, sp: bool = False, units: int = 0) -> float:
        return (self.static_bytes(a, b, optimizer, width, tp)
                + in_flight * self.activation_bytes(samples, a, b, recompute, tp, sp, units)
                + (self.weight_copy_bytes(a, b, recompute, tp, units) if in_flight else 0.0)
                + self.working_bytes(samples, a, b, tp, sp))

    def memory_prefix(self, samples: int, in_flight: int, recompute: bool,
                      optimizer: str = REPLICATED, width: int = 1,
                      tp: int = 1, sp: bool = False) -> list[float]:
        """Prefix sums of static + in-flight activation bytes + the step's weight copies
        (working set not included)."""
        st = state_bytes_per_param(optimizer, width)
        key = (samples, in_flight, recompute, st, tp, sp and tp > 1)
        pre = self._mem_prefix.get(key)
        if pre is None:
            sh = self.shard(tp, sp)
            keep = sh.keep_rc if recompute else sh.keep
            fixed = sh.fixed_rc if recompute else sh.fixed
            once = 1 if in_flight else 0  # the step's weight copies, while any is in flight
            pre = [p * st + in_flight * samples * k + once * f
                   for p, k, f in zip(sh.params, keep, fixed)]
            self._mem_prefix[key] = pre
        return pre

    def allreduce_s(self, replicas: tuple[Replica, ...], a: int, b: int) -> float:
        """One ring all-reduce of all the gradients of layers [a, b) (no buckets, no overlap)."""
        d = len(replicas)
        if d <= 1:
            return 0.0
        link = self.replica_link(replicas)
        params = self.shard(replicas[0].tp).params
        nbytes = (params[b] - params[a]) * self.grad_dtype_bytes
        bw = link.bandwidth_gbps * 1e9 / 8
        return 2 * (d - 1) / d * nbytes / bw + 2 * (d - 1) * link.latency_us * 1e-6

    def allreduce_window(self, replicas: tuple[Replica, ...], a: int, b: int,
                         recompute: bool = False, units: int = 0) -> AllReduceWindow:
        """The stage's gradient all-reduce in :data:`GRAD_BUCKET_BYTES` buckets, overlapped with
        the last backward of layers [a, b) on its slowest replica; see
        :func:`overlapped_allreduce`."""
        p = self.placement(replicas)
        return self._window(p, self._slowest(p, a, b, recompute, units)[2], a, b,
                            self.recompute_end(a, b, recompute, units))

    def _slowest(self, p: Placement, a: int, b: int, recompute: bool,
                 units: int = 0) -> tuple[float, float, tuple[GpuGroup, int]]:
        """(forward, backward, kind) of the stage's slowest replicas on layers [a, b): the
        longest forward and backward of its kinds, and the kind slowest in both together."""
        if len(p.kinds) == 1:
            f, bw = self.compute_s(*p.kinds[0], a, b, recompute, p.tp, units)
            return f, bw, p.kinds[0]
        times = [self.compute_s(g, s, a, b, recompute, p.tp, units) for g, s in p.kinds]
        slow = max(range(len(times)), key=lambda k: sum(times[k]))
        return max(f for f, _ in times), max(bw for _, bw in times), p.kinds[slow]

    def _window(self, p: Placement, slow: tuple[GpuGroup, int], a: int, b: int,
                rc_end: int) -> AllReduceWindow:
        """Ring all-reduce of the stage's gradients behind the backward of its ``slow`` kind
        (layers [a, rc_end) recomputing)."""
        d = p.width
        if d <= 1:
            return AllReduceWindow(0.0, 0.0, 0.0)
        link = self._link(p)
        g, samples = slow
        overlap = not p.on_cpu
        key = (link, d, g.gpu.name, g.gpu.tflops, samples, a, b, rc_end, overlap, p.tp,
               g.name if p.tp > 1 else "", g.intra_node)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = self._ring_window(d, link, self.table(g, samples, p.tp),
                                                       a, b, rc_end, overlap, p.tp)
        return w

    def _ring_window(self, d: int, link: LinkSpec, t: _LayerTable, a: int, b: int,
                     rc_end: int, overlap: bool = True, tp: int = 1) -> AllReduceWindow:
        """Ring all-reduce of ``d`` replicas over ``link``, in buckets behind the backward of
        layers [a, b) timed by ``t`` (the replica that finishes its backward last; layers
        [a, rc_end) recompute their forward in it); without ``overlap`` (CPU devices) every
        bucket runs after the backward."""
        bw = link.bandwidth_gbps * 1e9 / 8
        ring, lat = 2 * (d - 1) / d, 2 * (d - 1) * link.latency_us * 1e-6
        gb = self.grad_dtype_bytes
        params = self.shard(tp).params  # each rank all-reduces its shard with its peers'
        layers = []
        for j in range(b - 1, a - 1, -1):  # the backward runs the last layer first
            dur = t.bwd[j + 1] - t.bwd[j]
            if j < rc_end:
                dur += t.block_fwd[j + 1] - t.block_fwd[j]
            layers.append((dur, (params[j + 1] - params[j]) * gb))
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
                 optimizer: str = REPLICATED, width: int = 1, tp: int = 1) -> float:
        """The optimizer step of layers [a, b) on one replica (each of its ``tp`` ranks its
        shard); sharded, each replica updates its ``1/width`` of the parameters."""
        t = self.table(group, samples, tp)
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
        params = self.shard(p.tp).params
        nbytes = (params[b] - params[a]) * MASTER_BYTES
        bw = link.bandwidth_gbps * 1e9 / 8
        return (d - 1) / d * nbytes / bw + (d - 1) * link.latency_us * 1e-6

    def optimizer_step_s(self, replicas: tuple[Replica, ...], samples: int, a: int, b: int,
                         optimizer: str) -> float:
        """What the optimizer adds after the all-reduce: the update (on the first replica's
        GPU, ``samples`` per replica), and the all-gather of a sharded state."""
        p = self.placement(replicas)
        return (self.update_s(p.group, samples, a, b, optimizer, p.width, p.tp)
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
            over = self.transfer_overhead_s(left, right)
            got = self._cuts[key] = (
                max(sum(link.transfer_s(nbytes(n)) + over for link, n in route)
                    for route in routes),
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
        first_rank = self.hardware.subset(self.used_groups(plan)).first_ranks()
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
        return StageCosts(tuple(self._stage_cost(p, s, fwd[i], bwd[i], (i > 0) + (i < n - 1))
                                for i, (p, s) in enumerate(zip(places, stages))))

    def _stage_cost(self, p: Placement, stage: Stage, send_f: tuple[float, float],
                    send_b: tuple[float, float], cuts: int = 0) -> StageCost:
        """One stage with ``cuts`` stage boundaries (0 to 2): its slowest replica's times, the
        first replica's memory and, where the replicas differ, every kind's."""
        (a, b), rc, opt, d = stage.layers, stage.recompute, stage.optimizer, p.width
        sp, k = stage.sequence_parallel, 0 if stage.recompute else stage.recompute_layers
        e = self.recompute_end(a, b, rc, k)
        if sp and not self.sp_allowed(p.tp):
            raise CostModelError(f"stage {stage.index} sets sp (sequence parallelism), which "
                                 f"its replicas of {p.tp} rank(s) cannot run: "
                                 f"{sp_unfit(self.model, p.tp) or 'tp is 1'}")
        f, bw, slow = self._slowest(p, a, b, rc, k)
        # a partial recompute's recomputed forward: the slow kind's blocks [a, e)
        again_f = 0.0
        if k:
            t = self.table(slow[0], slow[1], p.tp)
            again_f = t.block_fwd[e] - t.block_fwd[a]
        if sp:
            # the recomputed blocks' forward gathers their inputs again; the others' backward
            edge = max(self.sp_edge_s(g, s, p.tp, a, b) for g, s in p.kinds)
            again = 0.0 if rc else max(self.sp_regather_s(g, s, p.tp, e, b) for g, s in p.kinds)
            f, bw = f + edge, bw + edge + again
        ar = self._window(p, slow, a, b, e)
        copies = self.weight_copy_bytes(a, b, rc, p.tp, k)
        first_samples = p.replicas[0].samples
        action = self.action_overhead_s(p, a, b) + cuts * self.transfer_cpu_s(p)
        return StageCost(
            forward_s=f + action, backward_s=bw + action, split_ratios=self.split_ratios(p),
            send_forward_s=send_f[0], send_backward_s=send_b[0],
            send_forward_latency_s=send_f[1], send_backward_latency_s=send_b[1],
            allreduce_s=ar.link_s,
            update_s=max(self.update_s(g, s, a, b, opt, d, p.tp) for g, s in p.kinds),
            static_bytes=self.static_bytes(a, b, opt, d, p.tp),
            activation_bytes=self.activation_bytes(first_samples, a, b, rc, p.tp, sp, k),
            working_bytes=self.working_bytes(first_samples, a, b, p.tp, sp) + copies,
            capacity_bytes=self.capacity_bytes(p.group),
            recompute=rc, recompute_s=again_f,
            allreduce_lead_s=ar.lead_s, allreduce_exposed_s=ar.exposed_s,
            allgather_s=self._allgather(p, a, b, opt), optimizer=opt,
            replica_memory=() if p.alike else tuple(
                ReplicaMemory(self.activation_bytes(s, a, b, rc, p.tp, sp, k),
                              self.working_bytes(s, a, b, p.tp, sp) + copies,
                              self.capacity_bytes(g)) for g, s in p.kinds))

    # -- the runtime's overheads, measured by the profiler ----------------------------------
    def action_overhead_s(self, p: Placement, a: int, b: int) -> float:
        """Seconds one compute action of the stage of layers [a, b) takes beyond its layers'
        times: its device's fixed cost per action, and for each layer beyond the first what a
        stage's further layer costs beyond its profiled time (``StepOverheads.layer_s``;
        layers counted as the profile timed them: a block's halves as one block). The largest
        over the stage's device types; 0 where the profile measured none."""
        if self.profile is None:
            return 0.0
        calls = self._profiled_calls()
        extra = max(calls[b] - calls[a] - 1.0, 0.0)
        found = [o.action_s + extra * o.layer_s for g in p.groups
                 if (o := self.profile.step_overheads(g.gpu.name)) is not None]
        return max(found, default=0.0)

    def transfer_cpu_s(self, p: Placement) -> float:
        """Seconds one stage-boundary transfer takes from the compute of a rank of the stage
        (``Profile.transfer_cpu_s``, the largest over its groups): each micro-batch sends and
        receives one transfer at each of the stage's boundaries, one in its forward's turn,
        one in its backward's, so every compute action pays one per boundary. 0 where the
        profile measured none."""
        if self.profile is None:
            return 0.0
        return max((self.profile.transfer_cpu_s(g.name) for g in p.groups), default=0.0)

    def _profiled_calls(self) -> tuple[float, ...]:
        """Prefix sums of the layers as the profile timed them (a block half: its share)."""
        got = getattr(self, "_calls", None)
        if got is None:
            got = self._calls = _prefix(l.profile_share if l.profile_signature else 1.0
                                        for l in self.model.layers)
        return got

    def split_ratios(self, p: Placement) -> tuple[float, float] | None:
        """(``I / B``, ``W / B``) of the split backward on the stage's GPUs (the costliest
        split where its device types differ), or None where the profile measured none."""
        if self.profile is None:
            return None
        found = [(o.input_grad_ratio, o.weight_grad_ratio) for g in p.groups
                 if (o := self.profile.step_overheads(g.gpu.name)) is not None
                 and o.split_measured]
        return max(found, key=sum, default=None)

    def transfer_overhead_s(self, left: Placement, right: Placement) -> float:
        """Fixed seconds of one transfer across the cut between two stages beyond the link's
        ``latency + bytes / bandwidth``: the largest the profile measured on the links the cut
        takes (a group to itself: inside it); 0 where none was."""
        if self.profile is None:
            return 0.0
        return max((self.profile.transfer_overhead_s(x.name, y.name)
                    for x in left.groups for y in right.groups), default=0.0)

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

    def sample_time_s(self, group: GpuGroup, samples: int, tp: int = 1) -> float:
        """Forward + backward seconds per sample of the whole model on one GPU of ``group``
        (on a replica of ``tp`` of them), when it computes ``samples`` samples at a time."""
        t = self.table(group, samples, tp)
        return (t.fwd[-1] + t.bwd[-1]) / samples

    def replica_rate(self, group: GpuGroup, samples: int, tp: int | None = None) -> float:
        """Samples per second one replica of ``group`` (``tp`` GPUs; None: the degree the
        search gives the group) puts through the whole model (fwd + bwd)."""
        tp = self.tp[group.name] if tp is None else tp
        key = (group.gpu.name, group.gpu.tflops, samples, tp, group.name, group.intra_node)
        r = self._rates.get(key)
        if r is None:
            r = self._rates[key] = 1.0 / self.sample_time_s(group, samples, tp)
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
