"""Cluster: groups of alike GPUs and the links between them (the cluster file), as a graph.

File format (YAML; bandwidths in gigabits per second, latencies in microseconds)::

    name: v100x8-a100x4
    profiles: ../data/gpu-profiles      # optional, relative to this file's directory, or
                                        # `sailor`: the measurements shipped in hapt_hf/data
    groups:
      - name: v100
        gpu: V100-32                    # catalogue name; tflops:, memory_gb:, bf16: override
        nodes: 1                        # it; an unknown name is accepted with tflops, memory_gb
        gpus_per_node: 8
        intra_node: {bandwidth_gbps: 200, latency_us: 10}
        inter_node: {bandwidth_gbps: 100, latency_us: 20}
        hosts: [gpu-v100-*]             # optional: the hostnames of its nodes (fnmatch patterns)
    links:                              # between groups; a pair with no link cannot be neighbours
      - {between: [v100, a100], bandwidth_gbps: 5, latency_us: 1000}
    job: {model: gpt2, seq_len: 1024, global_batch_size: 64,     # optional
          precision: auto, attn_implementation: sdpa}

A group that omits ``intra_node`` gets ``DEFAULT_INTRA_NODE`` (100 Gb/s, 10 us: PCIe-class, no
NVLink) and one that omits ``inter_node`` gets ``DEFAULT_INTER_NODE`` (25 Gb/s, 20 us: a common
datacentre Ethernet NIC), so a file left vague does not make links look faster than they are.

Length: over 400 lines because every section of the file (groups, links, job, profiles) is
parsed field by field, so that each message names its field; the parsers share one set of
checks (``_positive``, ``_no_unknown_keys``) and stay beside the records they fill.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hapt_hf.core.data import BUILTIN_PROFILES, CLUSTERS_DIR
from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS
from hapt_hf.core.precision import AUTO, PRECISIONS, Precision, canonical_precision, resolve_precision
from hapt_hf.core.ranks import first_ranks
from hapt_hf.errors import ClusterError

from .catalogue import GpuType, find_gpu, known_gpu_names, looks_like_cpu

__all__ = ["ClusterError", "GpuType", "LinkSpec", "GpuGroup", "GroupLink", "JobSpec", "Cluster",
           "builtin_cluster_path", "builtin_cluster_names"]

@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float
    """Gigabits per second."""
    latency_us: float
    """Microseconds."""

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes``: bytes / bandwidth + latency."""
        return nbytes * 8 / (self.bandwidth_gbps * 1e9) + self.latency_us * 1e-6


DEFAULT_INTRA_NODE = LinkSpec(bandwidth_gbps=100, latency_us=10)
DEFAULT_INTER_NODE = LinkSpec(bandwidth_gbps=25, latency_us=20)


@dataclass(frozen=True)
class GpuGroup:
    name: str
    gpu: GpuType
    nodes: int
    gpus_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    hosts: tuple[str, ...] = ()
    """fnmatch patterns of its nodes' hostnames (``hosts:``): how a node finds its group."""

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class GroupLink:
    a: str
    b: str
    link: LinkSpec


@dataclass(frozen=True)
class JobSpec:
    """The optional ``job:`` section of a cluster/scenario file."""

    model: dict | str | None = None
    seq_len: int | None = None
    global_batch_size: int | None = None
    precision: str | None = None
    """'auto' | 'bf16' | 'fp16' | 'fp32' (``dtype:`` is read as a deprecated alias)."""
    attn_implementation: str | None = None
    """'eager' | 'sdpa'; None: the runtime's default."""

    @property
    def dtype(self) -> str | None:
        """The older name of ``precision``: the compute dtype it names, None for auto/unset."""
        return None if self.precision in (None, AUTO) else self.precision


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[GpuGroup, ...]
    links: tuple[GroupLink, ...]
    job: JobSpec = field(default_factory=JobSpec)
    profiles: Path | None = None
    """Directory of measured per-layer profiles (``profiles:`` in the file, resolved)."""

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    def precision(self, requested: str | None = None) -> Precision:
        """The precision a job asking for ``requested`` (None: auto) runs in on every device
        of this cluster (see :func:`hapt_hf.core.precision.resolve_precision`)."""
        devices = {g.gpu.name: g.gpu.bf16 for g in self.groups}
        cpus = {g.gpu.name for g in self.groups if g.gpu.is_cpu}
        return resolve_precision(requested, devices, cpus)

    def group(self, name: str) -> GpuGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise ClusterError(f"no group named {name!r}; groups: {', '.join(self.group_names)}")

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def link(self, a: str, b: str) -> LinkSpec | None:
        """The link between two distinct groups, or None if they cannot be neighbours."""
        for l in self.links:
            if {l.a, l.b} == {a, b} and a != b:
                return l.link
        return None

    def first_ranks(self) -> dict[str, int]:
        """The first global rank of each group (see :mod:`hapt_hf.core.ranks`)."""
        return first_ranks((g.name, g.size) for g in self.groups)

    def ranks_of(self, name: str) -> list[int]:
        """Global ranks of a group: numbered group by group, node by node, in file order."""
        for g in self.groups:
            if g.name == name:
                start = self.first_ranks()[name]
                return list(range(start, start + g.size))
        raise ClusterError(f"no group named {name!r}; groups: {', '.join(self.group_names)}")

    def group_of_host(self, host: str) -> str | None:
        """The group whose ``hosts`` patterns match ``host`` (fnmatch, ignoring case); None
        where no group lists hosts. A host that matches no group, or several, is refused."""
        if not any(g.hosts for g in self.groups):
            return None
        found = [g.name for g in self.groups
                 if any(fnmatch.fnmatchcase(host.lower(), p.lower()) for p in g.hosts)]
        if len(found) == 1:
            return found[0]
        listed = "; ".join(f"{g.name}: {list(g.hosts)}" for g in self.groups if g.hosts)
        if not found:
            raise ClusterError(f"host {host!r} matches no group's hosts in cluster {self.name!r} "
                               f"({listed}); add a pattern matching it to its group's hosts, or "
                               "set HAPT_GROUP=<group> on that node")
        raise ClusterError(f"host {host!r} matches the hosts of groups {', '.join(found)} in "
                           f"cluster {self.name!r} ({listed}); make the patterns match one group "
                           "only, or set HAPT_GROUP=<group> on that node")

    def subset(self, names) -> "Cluster":
        """The cluster with only the groups named (file order kept) and the links among them:
        what a plan that leaves the other groups idle runs on, its ranks numbered over these."""
        keep = set(names)
        unknown = sorted(keep - set(self.group_names))
        if unknown or not keep:
            raise ClusterError(f"cannot keep groups {sorted(keep)} of cluster {self.name!r}: "
                               f"{'unknown ' + str(unknown) if unknown else 'none named'}; "
                               f"groups: {', '.join(self.group_names)}")
        return Cluster(self.name, tuple(g for g in self.groups if g.name in keep),
                       tuple(l for l in self.links if l.a in keep and l.b in keep),
                       self.job, self.profiles)

    def graph(self):
        """networkx.Graph: a node per group (attr 'group'), an edge per link (attr 'link')."""
        import networkx as nx

        g = nx.Graph(name=self.name)
        for grp in self.groups:
            g.add_node(grp.name, group=grp)
        for l in self.links:
            g.add_edge(l.a, l.b, link=l.link)
        return g

    @classmethod
    def load(cls, path) -> "Cluster":
        """Read a cluster file; a built-in name (see ``builtin_cluster_names()``) also works."""
        p = Path(path)
        if not p.exists() and str(path).removesuffix(".yaml") in builtin_cluster_names():
            p = builtin_cluster_path(str(path))
        if not p.is_file():
            raise ClusterError(f"cluster file {str(path)!r} does not exist; give the path of a "
                               f"YAML cluster file or a built-in name: "
                               f"{', '.join(builtin_cluster_names())}")
        try:
            d = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ClusterError(f"cluster file {p} is not a text YAML file (byte {e.start} is "
                               "not UTF-8); give a cluster YAML (docs/cluster-file.md) or a "
                               f"built-in name: {', '.join(builtin_cluster_names())}") from None
        except yaml.YAMLError as e:  # one line: where, and what is wrong there
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            why = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ClusterError(f"cluster file {p} is not valid YAML{at}: {why}") from None
        if not isinstance(d, dict):
            raise ClusterError(f"cluster file {p} must hold a mapping with 'groups:' (and "
                               f"'links:'), got {type(d).__name__}")
        d.setdefault("name", p.stem)
        return cls.from_dict(d, base_dir=p.resolve().parent)

    @classmethod
    def from_dict(cls, d: dict, base_dir: Path | None = None) -> "Cluster":
        if not isinstance(d, dict):
            raise ClusterError(f"a cluster must be a mapping with 'groups:', got "
                               f"{type(d).__name__}")
        _no_unknown_keys(d, {"name", "groups", "links", "job", "profiles"}, "cluster")
        groups = _parse_groups(d.get("groups"))
        links = _parse_links([] if d.get("links") is None else d["links"], [g.name for g in groups])
        _check_connected(groups, links)
        return cls(name=str(d.get("name", "cluster")), groups=groups, links=links,
                   job=_parse_job(d.get("job")), profiles=_parse_profiles(d.get("profiles"),
                                                                         base_dir))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "groups": [_group_dict(g) for g in self.groups],
                               "links": [{"between": [l.a, l.b], **_link_dict(l.link)}
                                         for l in self.links]}
        job = {k: v for k, v in vars(self.job).items() if v is not None}
        if job:
            out["job"] = job
        if self.profiles is not None:
            out["profiles"] = str(self.profiles)
        return out


# --- parsing, one field at a time so every message can name its field ------------------------

_GROUP_KEYS = {"name", "gpu", "tflops", "memory_gb", "bf16", "nodes", "gpus_per_node",
               "intra_node", "inter_node", "hosts"}


def _no_unknown_keys(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; known keys: "
                           f"{', '.join(sorted(known))}")


def _positive(value, where: str, integer: bool = False, allow_zero: bool = False) -> float:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else (">= 1" if integer else "> 0")
        raise ClusterError(f"{where} must be {kind} {bound}, got {value!r}")
    return value


def _parse_link_spec(d, where: str, default: LinkSpec | None = None) -> LinkSpec:
    if d is None and default is not None:
        return default
    if not isinstance(d, dict):
        raise ClusterError(f"{where} must be a mapping {{bandwidth_gbps: ..., latency_us: ...}}")
    _no_unknown_keys(d, {"bandwidth_gbps", "latency_us"}, where)
    for k in ("bandwidth_gbps", "latency_us"):
        if k not in d:
            raise ClusterError(f"{where}.{k} is missing; give it (bandwidth in Gb/s, latency "
                               f"in microseconds)")
    return LinkSpec(float(_positive(d["bandwidth_gbps"], f"{where}.bandwidth_gbps")),
                    float(_positive(d["latency_us"], f"{where}.latency_us", allow_zero=True)))


def _parse_gpu(d: dict, where: str) -> GpuType:
    name = d.get("gpu")
    if not isinstance(name, str) or not name:
        raise ClusterError(f"{where}.gpu is missing; name a GPU type (one of "
                           f"{', '.join(known_gpu_names())})")
    tflops = _positive(d["tflops"], f"{where}.tflops") if "tflops" in d else None
    memory = _positive(d["memory_gb"], f"{where}.memory_gb") if "memory_gb" in d else None
    bf16 = d.get("bf16")
    if bf16 is not None and not isinstance(bf16, bool):
        raise ClusterError(f"{where}.bf16 must be true or false (whether the GPU computes in "
                           f"bfloat16), got {bf16!r}")
    known = find_gpu(name)
    if known is None:
        if tflops is None or memory is None:
            raise ClusterError(
                f"{where}.gpu: unknown GPU type {name!r}; use one of "
                f"{', '.join(known_gpu_names())}, or give both tflops: (peak dense fp16/bf16 "
                f"TFLOP/s) and memory_gb: for it")
        cpu = looks_like_cpu(name)
        return GpuType(name, float(tflops), float(memory), bf16=True if cpu else bf16,
                       is_cpu=cpu)
    return GpuType(known.name, float(tflops if tflops is not None else known.tflops),
                   float(memory if memory is not None else known.memory_gb), known.profile_names,
                   known.bf16 if bf16 is None else bf16, known.is_cpu)


def _parse_groups(raw) -> tuple[GpuGroup, ...]:
    if not isinstance(raw, list) or not raw:
        raise ClusterError("groups: must be a non-empty list of groups (name, gpu, nodes, "
                           "gpus_per_node)")
    groups, seen = [], set()
    for i, d in enumerate(raw):
        where = f"groups[{i}]"
        if not isinstance(d, dict):
            raise ClusterError(f"{where} must be a mapping with name, gpu, gpus_per_node")
        _no_unknown_keys(d, _GROUP_KEYS, where)
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterError(f"{where}.name is missing; give every group a unique name")
        where = f"group {name!r}"
        if name in seen:
            raise ClusterError(f"{where}: duplicate group name; rename one of the groups")
        seen.add(name)
        if "gpus_per_node" not in d:
            raise ClusterError(f"{where}.gpus_per_node is missing; give the GPUs per node")
        groups.append(GpuGroup(
            name=name, gpu=_parse_gpu(d, where),
            nodes=int(_positive(d.get("nodes", 1), f"{where}.nodes", integer=True)),
            gpus_per_node=int(_positive(d["gpus_per_node"], f"{where}.gpus_per_node",
                                        integer=True)),
            intra_node=_parse_link_spec(d.get("intra_node"), f"{where}.intra_node",
                                        DEFAULT_INTRA_NODE),
            inter_node=_parse_link_spec(d.get("inter_node"), f"{where}.inter_node",
                                        DEFAULT_INTER_NODE),
            hosts=_parse_hosts(d.get("hosts"), where)))
    return tuple(groups)


def _parse_hosts(raw, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(h, str) and h for h in raw):
        raise ClusterError(f"{where}.hosts must be a list of hostnames or fnmatch patterns "
                           f"(e.g. [node-a*, gpu7]), got {raw!r}")
    return tuple(raw)


def _parse_links(raw, names: list[str]) -> tuple[GroupLink, ...]:
    if not isinstance(raw, list):
        raise ClusterError("links: must be a list of {between: [a, b], bandwidth_gbps, "
                           "latency_us}")
    links, pairs = [], set()
    for i, d in enumerate(raw):
        where = f"links[{i}]"
        if not isinstance(d, dict):
            raise ClusterError(f"{where} must be a mapping {{between: [a, b], bandwidth_gbps, "
                               f"latency_us}}")
        between = d.get("between")
        if not isinstance(between, list) or len(between) != 2:
            raise ClusterError(f"{where}.between must name two groups, e.g. [v100, a100]")
        a, b = (str(x) for x in between)
        for g in (a, b):
            if g not in names:
                raise ClusterError(f"{where}.between names unknown group {g!r}; groups: "
                                   f"{', '.join(names)}")
        if a == b:
            raise ClusterError(f"{where}.between links {a!r} to itself; a group's own links "
                               f"are its intra_node/inter_node")
        if frozenset((a, b)) in pairs:
            raise ClusterError(f"{where}: a second link between {a!r} and {b!r}; keep one")
        pairs.add(frozenset((a, b)))
        spec = {k: v for k, v in d.items() if k != "between"}
        links.append(GroupLink(a, b, _parse_link_spec(spec, where)))
    return tuple(links)


def _check_connected(groups: tuple[GpuGroup, ...], links: tuple[GroupLink, ...]) -> None:
    if len(groups) < 2:
        return
    linked = {l.a for l in links} | {l.b for l in links}
    for g in groups:
        if g.name not in linked:
            other = next(o.name for o in groups if o.name != g.name)
            raise ClusterError(
                f"group {g.name!r} has no link to any other group, so no pipeline can reach it; "
                f"add to links: {{between: [{g.name}, {other}], bandwidth_gbps: ..., "
                f"latency_us: ...}} or remove the group")


def _parse_job(raw) -> JobSpec:
    if raw is None:
        return JobSpec()
    if not isinstance(raw, dict):
        raise ClusterError("job: must be a mapping {model, seq_len, global_batch_size, "
                           "precision, attn_implementation}")
    _no_unknown_keys(raw, {"model", "seq_len", "global_batch_size", "precision", "dtype",
                           "attn_implementation"}, "job")
    model = raw.get("model")
    if model is not None and not isinstance(model, (str, dict)):
        raise ClusterError("job.model must be a model name, a path or a mapping "
                           "{family, hidden_size, num_layers, num_heads, vocab_size, ...}")
    for k in ("seq_len", "global_batch_size"):
        if raw.get(k) is not None:
            _positive(raw[k], f"job.{k}", integer=True)
    attn = raw.get("attn_implementation")
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise ClusterError(f"job.attn_implementation {attn!r} is not known; use one of "
                           f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    return JobSpec(model=model, seq_len=raw.get("seq_len"),
                   global_batch_size=raw.get("global_batch_size"),
                   precision=_job_precision(raw), attn_implementation=attn)


def _job_precision(raw: dict) -> str | None:
    """``job.precision``, or the older ``job.dtype`` read as the same setting."""
    given = {k: raw[k] for k in ("precision", "dtype") if raw.get(k) is not None}
    for key, value in given.items():
        if canonical_precision(value) is None:
            raise ClusterError(f"job.{key} {value!r} is not known; use one of "
                               f"{', '.join(PRECISIONS)}")
    names = {canonical_precision(v) for v in given.values()}
    if len(names) > 1:
        raise ClusterError(f"job.precision {given['precision']!r} and job.dtype "
                           f"{given['dtype']!r} disagree; keep precision only (dtype is its "
                           "older name)")
    return names.pop() if names else None


def _parse_profiles(raw, base_dir: Path | None) -> Path | None:
    """A directory (relative to the cluster file's) or, where no such directory exists, the
    name of a set shipped with the package (``sailor``)."""
    if raw is None:
        return None
    p = Path(str(raw))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    p = p.resolve()
    if not p.is_dir() and str(raw) in BUILTIN_PROFILES:
        p = BUILTIN_PROFILES[str(raw)]
    if not p.is_dir():
        raise ClusterError(f"profiles: directory {str(raw)!r} (resolved to {p}) does not exist; "
                           f"give a path relative to the cluster file's directory or a built-in "
                           f"set ({', '.join(BUILTIN_PROFILES)})")
    return p


def _link_dict(l: LinkSpec) -> dict[str, float]:
    return {"bandwidth_gbps": l.bandwidth_gbps, "latency_us": l.latency_us}


def _group_dict(g: GpuGroup) -> dict[str, Any]:
    out = {"name": g.name, "gpu": g.gpu.name, "tflops": g.gpu.tflops,
           "memory_gb": g.gpu.memory_gb, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
           "intra_node": _link_dict(g.intra_node), "inter_node": _link_dict(g.inter_node)}
    if g.gpu.bf16 is not None:
        out["bf16"] = g.gpu.bf16
    if g.hosts:
        out["hosts"] = list(g.hosts)
    return out


# --- built-in cluster files ----------------------------------------------------------------

def builtin_cluster_names() -> list[str]:
    return sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml"))


def builtin_cluster_path(name: str) -> Path:
    """Path of a cluster file shipped with the package (``name`` with or without ``.yaml``)."""
    stem = str(name).removesuffix(".yaml")
    p = CLUSTERS_DIR / f"{stem}.yaml"
    if not p.is_file():
        raise ClusterError(f"no built-in cluster named {name!r}; built-in clusters: "
                           f"{', '.join(builtin_cluster_names())}")
    return p
