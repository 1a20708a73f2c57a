"""Profile: measured per-layer times, per device type; the cost model prefers it to the catalogue.

A profile is plain data: ``ProfileKey -> LayerTiming`` plus measured links. It is saved as
readable JSON (one record per timing) and can be built from our profiler or from published
measurements (:func:`load_sailor_profiles`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hapt_hf.core.files import write_atomic
from hapt_hf.errors import ProfileError

from .catalogue import device_names
from .cluster import Cluster, GpuGroup, GroupLink, LinkSpec
from .model_spec import ModelSpec

__all__ = ["ProfileKey", "LayerTiming", "LinkMeasurement", "StepOverheads", "Profile",
           "ProfileError",
           "load_sailor_profiles", "link_pair", "cluster_with_links"]

PROFILE_VERSION = 1


@dataclass(frozen=True, order=True)
class ProfileKey:
    device: str
    """Device type name as in the cluster (catalogue name), e.g. 'A100-40' or 'cpu-slow'."""
    layer_signature: str
    """LayerSpec.signature."""
    micro_batch: int
    """Samples per forward on ONE device."""
    seq_len: int
    dtype: str
    tp: int = 1
    """Tensor-parallel degree the layer ran at: ``micro_batch`` samples on each of ``tp``
    devices, each holding a ``1/tp`` shard of the block's projections (1: one device, the
    whole layer)."""


@dataclass(frozen=True)
class LayerTiming:
    forward_s: float
    backward_s: float
    update_s: float = 0.0
    """Optimizer step time of the layer's parameters (0 if not measured)."""
    peak_memory_bytes: float = 0.0
    spread: float = 0.0
    """Relative spread of the repeated measurements (e.g. IQR / median)."""
    kept_bytes: float = 0.0
    """Bytes autograd saved for the backward of one micro-batch (saved-tensor hooks, weights
    excluded): what ``LayerSpec.act_keep_bytes`` and ``act_keep_fixed_bytes`` predict; 0 if not
    measured."""
    tp_comm_included: bool = False
    """For a timing at ``tp`` > 1: whether ``forward_s`` and ``backward_s`` include the
    tensor-parallel all-reduces of the layer's activations, run on the measuring node's own
    links (the Sailor measurements), or are one rank's compute of its shard alone (a profile
    timed on one device: the cost model adds the all-reduces on the cluster's link)."""


@dataclass(frozen=True)
class LinkMeasurement:
    a: str
    b: str
    bandwidth_gbps: float
    latency_us: float
    tp: int = 1
    """Above 1: a tensor-parallel all-reduce (``a == b``: ``tp`` ranks of group ``a``
    all-reducing one block activation at a time, on the link inside the group), the figure a
    ``tp``-way stage's all-reduces are priced on; 1: a link between two groups, or a group's
    gradient all-reduce among its ranks."""
    overhead_us: float = 0.0
    """Fixed cost of one point-to-point transfer beyond ``latency + bytes / bandwidth``: a
    tiny tensor sent and waited for as the runtime does it (``isend``/``irecv``), less what
    the fitted link gives for its bytes (0: not measured, or nothing beyond the fit). On a
    link from a group to itself, measured between the group's first two ranks. The cost model
    adds it to every stage-boundary transfer on the link, as time the link is busy."""
    transfer_cpu_us: float = 0.0
    """On a link from a group to itself: microseconds one transfer of an activation takes from
    the compute of the rank at each end, the mean of the sender's and the receiver's (a fixed
    compute timed with the transfer in flight, against alone, between the group's first two
    ranks; 0: not measured). The backend moves the bytes on the cores the rank computes on.
    Unlike ``overhead_us`` it holds the ranks, not the link: the cost model adds it to each
    compute action of a stage once per stage boundary the stage has, on the stage's own group
    (each micro-batch sends and receives one transfer at each boundary)."""


@dataclass(frozen=True)
class StepOverheads:
    """What a device's pipeline steps cost beyond the sum of their layers' profiled times,
    measured by the profiler on a stage of blocks as the runtime runs it
    (:mod:`hapt_hf.profiling.overheads`). A profile written before these were measured has
    none for its devices: the defaults (no overhead, the split backward priced as the fused
    one by :data:`hapt_hf.planner.simulate.WEIGHT_GRADIENT_SHARE`) apply."""

    action_s: float = 0.0
    """Fixed seconds of one compute action of a stage (``F``, ``B``, ``I`` or ``W``) beyond
    its layers' profiled times: the intercept, over micro-batch sizes, of one block run as the
    runtime runs an action (the received input made a leaf, the output and the input's
    gradient copied out as sends copy them) less the block timed as a layer."""
    input_grad_ratio: float = 0.0
    """The split backward's input-gradient part ``I`` over the fused backward ``B`` of the same
    stage and micro-batch (0: not measured)."""
    weight_grad_ratio: float = 0.0
    """The weight-gradient part ``W`` over ``B`` (0: not measured). ``I + W`` can exceed ``B``:
    the split walks the graph twice and keeps it alive between."""
    layer_s: float = 0.0
    """Seconds each layer of a stage beyond its first adds to an action beyond its profiled
    time: the intercept of a three-block stage's action less a one-block action, over its two
    further blocks, less the block timed alone. Below 0 where a layer timed alone pays
    per-call costs (the autograd engine's start) that a stage of several layers pays once."""

    @property
    def split_measured(self) -> bool:
        return self.input_grad_ratio > 0 and self.weight_grad_ratio > 0


@dataclass
class Profile:
    timings: dict[ProfileKey, LayerTiming] = field(default_factory=dict)
    links: list[LinkMeasurement] = field(default_factory=list)
    source: str = ""
    overheads: dict[str, StepOverheads] = field(default_factory=dict)
    """Device type name -> its measured step overheads (absent: none measured)."""

    def step_overheads(self, device: str) -> StepOverheads | None:
        """The overheads measured on ``device`` under any of its names, or None."""
        for name in device_names(device):
            if name in self.overheads:
                return self.overheads[name]
        return None

    def transfer_overhead_s(self, a: str, b: str) -> float:
        """Seconds one transfer on the link between groups ``a`` and ``b`` (``a == b``: inside
        the group) costs beyond the link's fit: its measured ``overhead_us``, 0 if none."""
        pair = link_pair(a, b)
        return next((l.overhead_us * 1e-6 for l in self.links
                     if l.tp == 1 and link_pair(l.a, l.b) == pair), 0.0)

    def transfer_cpu_s(self, group: str) -> float:
        """Seconds one transfer takes from the compute of a rank of ``group`` at either end,
        measured inside the group (``LinkMeasurement.transfer_cpu_us``); 0 if not measured."""
        return next((l.transfer_cpu_us * 1e-6 for l in self.links
                     if l.tp == 1 and l.a == l.b == group), 0.0)

    def lookup(self, device: str, layer_signature: str, micro_batch: int, seq_len: int,
               dtype: str, tp: int = 1) -> LayerTiming | None:
        """Exact entry, or one interpolated/extrapolated linearly in micro_batch from the
        entries of the same (device, signature, seq_len, dtype, tp); None if there are none.

        ``device`` may be any name of the device (catalogue name, alias or profile name, e.g.
        'GH200' finds entries stored as 'GH-96')."""
        for name in device_names(device):
            points = sorted((k.micro_batch, t) for k, t in self.timings.items()
                            if k.device == name and k.layer_signature == layer_signature
                            and k.seq_len == seq_len and k.dtype == dtype and k.tp == tp)
            if points:
                return _estimate(points, micro_batch)
        return None

    def devices(self) -> set[str]:
        return {k.device for k in self.timings}

    def micro_batches(self, device: str) -> list[int]:
        """Measured micro-batch sizes of a device at one rank per layer (tensor-parallel
        degree 1), under any of its names (as ``lookup``)."""
        names = set(device_names(device))
        return sorted({k.micro_batch for k in self.timings if k.device in names and k.tp == 1})

    def tp_degrees(self, device: str) -> list[int]:
        """Tensor-parallel degrees measured for a device, under any of its names."""
        names = set(device_names(device))
        return sorted({k.tp for k in self.timings if k.device in names})

    def tp_link(self, group: str, tp: int) -> LinkMeasurement | None:
        """The tensor-parallel all-reduce of ``tp`` ranks measured inside ``group``, if any."""
        return next((l for l in self.links if l.tp == tp > 1 and l.a == l.b == group), None)

    def merge(self, other: "Profile") -> "Profile":
        """A new profile with both sets of entries; ``other`` wins where both measured."""
        links = {(l.a, l.b, l.tp): l for l in self.links}
        links.update({(l.a, l.b, l.tp): l for l in other.links})
        source = " + ".join(s for s in (self.source, other.source) if s)
        return Profile({**self.timings, **other.timings}, list(links.values()), source,
                       {**self.overheads, **other.overheads})

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "source": self.source,
                "timings": [_as_record(k, t) for k, t in sorted(self.timings.items())],
                "links": [_link_record(l) for l in self.links],
                **({"overheads": {d: asdict(o) for d, o in sorted(self.overheads.items())}}
                   if self.overheads else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        if not isinstance(d, dict) or "timings" not in d:
            raise ProfileError("a profile must be a mapping with 'timings' (and 'links')")
        if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ProfileError(f"profile version {d.get('version')!r} is not supported; "
                               f"re-measure or convert it to version {PROFILE_VERSION}")
        timings = {}
        for i, rec in enumerate(d["timings"]):
            key, timing = _record(rec, f"timings[{i}]")
            timings[key] = timing
        try:
            links = [LinkMeasurement(str(l["a"]), str(l["b"]), float(l["bandwidth_gbps"]),
                                     float(l["latency_us"]), int(l.get("tp", 1)),
                                     float(l.get("overhead_us", 0.0)),
                                     float(l.get("transfer_cpu_us", 0.0)))
                     for l in d.get("links", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"links: each entry needs a, b, bandwidth_gbps, latency_us "
                               f"(and tp, 1 when left out; overhead_us and transfer_cpu_us, 0 "
                               f"when left out) "
                               f"({e!r})") from None
        bad = next((l for l in links if l.tp < 1 or (l.tp > 1 and l.a != l.b)), None)
        if bad is not None:
            raise ProfileError(f"links: the entry {bad.a}-{bad.b} has tp {bad.tp}; tp is 1, or "
                               "the degree of an all-reduce inside one group (a == b)")
        return cls(timings, links, str(d.get("source", "")), _overheads(d.get("overheads", {})))

    def save(self, path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"profile file {path} cannot be read as JSON ({e})") from None
        return cls.from_dict(d)


_KEY_FIELDS = tuple(f.name for f in fields(ProfileKey) if f.name != "tp")
_TIMING_FIELDS = tuple(f.name for f in fields(LayerTiming) if f.name != "tp_comm_included")


def _record(rec: dict, where: str) -> tuple[ProfileKey, LayerTiming]:
    if not isinstance(rec, dict):
        raise ProfileError(f"{where} must be a mapping")
    missing = [k for k in (*_KEY_FIELDS, "forward_s", "backward_s") if k not in rec]
    if missing:
        raise ProfileError(f"{where} is missing {missing}")
    try:
        key = ProfileKey(str(rec["device"]), str(rec["layer_signature"]),
                         int(rec["micro_batch"]), int(rec["seq_len"]), str(rec["dtype"]),
                         int(rec.get("tp", 1)))
        timing = LayerTiming(**{k: float(rec[k]) for k in _TIMING_FIELDS if k in rec},
                             tp_comm_included=_flag(rec.get("tp_comm_included", False), where))
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where} has a value of the wrong type ({e})") from None
    if key.tp < 1:
        raise ProfileError(f"{where}: tp {key.tp} must be >= 1 (the tensor-parallel degree the "
                           "layer was timed at)")
    if timing.forward_s < 0 or timing.backward_s < 0:
        raise ProfileError(f"{where}: forward_s/backward_s must be >= 0")
    return key, timing


def _overheads(d: Any) -> dict[str, StepOverheads]:
    names = tuple(f.name for f in fields(StepOverheads))
    if not isinstance(d, dict) or not all(isinstance(o, dict) for o in d.values()):
        raise ProfileError("overheads must map each device name to a mapping of "
                           f"{', '.join(names)}")
    out = {}
    for device, rec in d.items():
        unknown = sorted(set(rec) - set(names))
        if unknown:
            raise ProfileError(f"overheads[{device!r}] has unknown fields {unknown}; it takes "
                               f"{', '.join(names)}")
        try:
            o = StepOverheads(**{k: float(v) for k, v in rec.items()})
        except (TypeError, ValueError) as e:
            raise ProfileError(f"overheads[{device!r}] has a value of the wrong type "
                               f"({e})") from None
        if o.input_grad_ratio < 0 or o.weight_grad_ratio < 0:
            raise ProfileError(f"overheads[{device!r}]: the split ratios must be >= 0 (0: not "
                               "measured)")
        out[str(device)] = o
    return out


def _link_record(link: LinkMeasurement) -> dict[str, Any]:
    rec = asdict(link)
    if link.tp == 1:  # written as before tensor parallelism existed
        del rec["tp"]
    if not link.overhead_us:  # as before the per-transfer overhead was measured
        del rec["overhead_us"]
    if not link.transfer_cpu_us:  # as before it was measured
        del rec["transfer_cpu_us"]
    return rec


def _as_record(key: ProfileKey, timing: LayerTiming) -> dict[str, Any]:
    rec = {**asdict(key), **asdict(timing)}
    if key.tp == 1:  # one-device timings are written as before tensor parallelism existed
        del rec["tp"], rec["tp_comm_included"]
    return rec


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{where}: tp_comm_included must be true or false, got {value!r}")
    return value


def _scale(t: LayerTiming, f: float) -> LayerTiming:
    # the optimizer step touches the same parameters whatever the micro-batch
    return LayerTiming(t.forward_s * f, t.backward_s * f, t.update_s, t.peak_memory_bytes * f,
                       t.spread, t.kept_bytes * f, t.tp_comm_included)


def _line(mb: int, p: tuple[int, LayerTiming], q: tuple[int, LayerTiming]) -> LayerTiming:
    (m0, a), (m1, b) = p, q
    w = (mb - m0) / (m1 - m0)

    def at(x: float, y: float) -> float:
        return x + w * (y - x)

    return LayerTiming(at(a.forward_s, b.forward_s), at(a.backward_s, b.backward_s),
                       at(a.update_s, b.update_s),
                       at(a.peak_memory_bytes, b.peak_memory_bytes), max(a.spread, b.spread),
                       at(a.kept_bytes, b.kept_bytes), a.tp_comm_included or b.tp_comm_included)


def _floor(t: LayerTiming, low: LayerTiming) -> LayerTiming:
    return LayerTiming(*(max(x, y) for x, y in zip(
        (t.forward_s, t.backward_s, t.update_s, t.peak_memory_bytes),
        (low.forward_s, low.backward_s, low.update_s, low.peak_memory_bytes))), spread=t.spread,
        kept_bytes=max(t.kept_bytes, low.kept_bytes),
        tp_comm_included=t.tp_comm_included or low.tp_comm_included)


def _estimate(points: list[tuple[int, LayerTiming]], mb: int) -> LayerTiming:
    """Exact point, linear between the two neighbours, or extrapolated from the nearest two.

    Below the smallest measured size a straight line can reach zero or less, so the result is
    kept at least at the per-sample share of the smallest point (a smaller batch is never more
    efficient per sample); above the largest it is kept at least at the largest point's time.
    """
    for m, t in points:
        if m == mb:
            return t
    if len(points) == 1:
        m, t = points[0]
        return _scale(t, mb / m)
    if mb < points[0][0]:
        return _floor(_line(mb, points[0], points[1]), _scale(points[0][1], mb / points[0][0]))
    if mb > points[-1][0]:
        return _floor(_line(mb, points[-2], points[-1]), points[-1][1])
    hi = next(i for i, (m, _) in enumerate(points) if m > mb)
    return _line(mb, points[hi - 1], points[hi])


# --- published measurements --------------------------------------------------------------------

_SAILOR_SEQ_LEN = 2048  # the data's README: all models were measured at sequence length 2048


def _sailor_seq_len(directory: Path, model_name: str) -> int:
    """Sequence length from a ``model_*.json`` training config naming this model, if any."""
    for p in sorted(directory.glob("model_*.json")):
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if cfg.get("model") == model_name and "sequence_length" in cfg:
            return int(cfg["sequence_length"])
    return _SAILOR_SEQ_LEN


def load_sailor_profiles(directory, model: ModelSpec) -> Profile:
    """Per-layer times measured by the Sailor planner's authors (``layer_times.json``:
    model -> gpu -> micro-batch -> tensor-parallel degree -> layer -> [fwd, bwd, update]).

    Every tensor-parallel degree is kept (``ProfileKey.tp``); the authors timed a layer at
    degree ``t`` on ``t`` GPUs of one node, so those timings include the layer's all-reduces
    (``LayerTiming.tp_comm_included``). Profile layer ``i`` is ``model.layers[i]``; layers
    sharing a signature (the blocks) get the mean of their measured times. Devices keep the
    file's names ('A100-40', 'V100-16', 'GH-96', ...).
    """
    directory = Path(directory)
    path = directory / "layer_times.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"cannot read {path} ({e}); give the directory holding the Sailor "
                           f"profiles' layer_times.json") from None
    name = model.profile_name or model.name
    if name not in data:
        raise ProfileError(f"{path} has no model {name!r}; it has {', '.join(sorted(data))}. "
                           f"Set the job model's profile_name to one of them")
    seq = _sailor_seq_len(directory, name)
    if model.seq_len != seq:
        raise ProfileError(f"{name} was profiled at sequence length {seq}, the job asks for "
                           f"{model.seq_len}; set job.seq_len to {seq} or drop profiles:")
    timings: dict[ProfileKey, LayerTiming] = {}
    for gpu, by_mb in sorted(data[name].items()):
        for mb, by_tp in sorted(by_mb.items(), key=lambda kv: int(kv[0])):
            for tp, layers in sorted(by_tp.items(), key=lambda kv: int(kv[0])):
                timings.update(_sailor_layers(layers, model, gpu, int(mb), int(tp)))
    return Profile(timings, [], source=f"sailor:{path}")


def _sailor_layers(layers: dict[str, list[float]], model: ModelSpec, gpu: str,
                   mb: int, tp: int = 1) -> dict[ProfileKey, LayerTiming]:
    if len(layers) != model.num_layers:
        raise ProfileError(
            f"the profile of {model.profile_name or model.name} on {gpu} has {len(layers)} layers "
            f"(embedding + blocks + head) but the model has {model.num_layers}; check the job "
            f"model's num_layers against the profiled model")
    by_sig: dict[str, list[list[float]]] = {}
    for i, spec in enumerate(model.layers):
        by_sig.setdefault(spec.signature, []).append(layers[str(i)])
    out = {}
    for sig, rows in by_sig.items():
        fwd, bwd, upd = (sum(r[j] for r in rows) / len(rows) for j in range(3))
        out[ProfileKey(gpu, sig, mb, model.seq_len, model.dtype, tp)] = \
            LayerTiming(fwd, bwd, upd, tp_comm_included=tp > 1)
    return out


def link_pair(a: str, b: str) -> tuple[str, str]:
    """The key of the link between groups ``a`` and ``b``, whichever way it is named."""
    return (a, b) if a <= b else (b, a)


def cluster_with_links(cluster: Cluster, profile: Profile) -> Cluster:
    """The cluster with each measured link replacing the figures the file gave for it.

    A measurement from a group to itself (``a == b``, an all-reduce timed among the group's
    ranks) replaces the link its stages' gradients are all-reduced on: the intra-node link of a
    group on one node, the inter-node link of a group over several (what a ring over all its
    GPUs is held to)."""
    measured = {link_pair(m.a, m.b): LinkSpec(m.bandwidth_gbps, m.latency_us)
                for m in profile.links if m.tp == 1}  # tp > 1: Profile.tp_link's
    links = tuple(GroupLink(l.a, l.b, measured.get(link_pair(l.a, l.b), l.link))
                  for l in cluster.links)
    groups = tuple(_with_inside_link(g, measured.get((g.name, g.name))) for g in cluster.groups)
    return Cluster(cluster.name, groups, links, cluster.job, cluster.profiles)


def _with_inside_link(group: GpuGroup, inside: LinkSpec | None) -> GpuGroup:
    if inside is None:
        return group
    if group.nodes > 1:
        return replace(group, inter_node=inside)
    return replace(group, intra_node=inside)
