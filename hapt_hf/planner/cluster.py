"""Cluster: groups of alike GPUs and the links between them (the cluster file), as a graph.

SKELETON: fields are the contract; the helper owning this file fills in the bodies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ClusterError", "GpuType", "LinkSpec", "GpuGroup", "GroupLink", "JobSpec", "Cluster"]


class ClusterError(ValueError):
    """A cluster file that is wrong; the message names the field and what would fix it."""


@dataclass(frozen=True)
class GpuType:
    name: str
    """Catalogue name, e.g. 'V100-32', 'A100-40', 'cpu'."""
    tflops: float
    """Peak dense fp16/bf16 TFLOP/s (fp32 for 'cpu')."""
    memory_gb: float
    """Memory of one device, GB (1e9 bytes)."""


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float
    """Gigabits per second."""
    latency_us: float
    """Microseconds."""

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes``: bytes / bandwidth + latency."""
        return nbytes * 8 / (self.bandwidth_gbps * 1e9) + self.latency_us * 1e-6


@dataclass(frozen=True)
class GpuGroup:
    name: str
    gpu: GpuType
    nodes: int
    gpus_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec

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
    dtype: str | None = None


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

    def group(self, name: str) -> GpuGroup:
        raise NotImplementedError

    def link(self, a: str, b: str) -> LinkSpec | None:
        """The link between two distinct groups, or None if they cannot be neighbours."""
        raise NotImplementedError

    def ranks_of(self, name: str) -> list[int]:
        """Global ranks of a group: numbered group by group, node by node, in file order."""
        raise NotImplementedError

    def graph(self):
        """networkx.Graph: a node per group (attr 'group'), an edge per link (attr 'link')."""
        raise NotImplementedError

    @classmethod
    def load(cls, path) -> "Cluster":
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict, base_dir: Path | None = None) -> "Cluster":
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError
