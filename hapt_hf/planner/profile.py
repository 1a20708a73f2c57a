"""Profile: measured per-layer times, per device type; the cost model prefers it to the catalogue.

SKELETON: fields are the contract; the helper owning this file fills in the bodies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ProfileKey", "LayerTiming", "LinkMeasurement", "Profile"]


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


@dataclass(frozen=True)
class LayerTiming:
    forward_s: float
    backward_s: float
    update_s: float = 0.0
    """Optimizer step time of the layer's parameters (0 if not measured)."""
    peak_memory_bytes: float = 0.0
    spread: float = 0.0
    """Relative spread of the repeated measurements (e.g. IQR / median)."""


@dataclass(frozen=True)
class LinkMeasurement:
    a: str
    b: str
    bandwidth_gbps: float
    latency_us: float


@dataclass
class Profile:
    timings: dict[ProfileKey, LayerTiming] = field(default_factory=dict)
    links: list[LinkMeasurement] = field(default_factory=list)
    source: str = ""

    def lookup(self, device: str, layer_signature: str, micro_batch: int, seq_len: int,
               dtype: str) -> LayerTiming | None:
        """Exact entry, or one interpolated/extrapolated linearly in micro_batch from the
        entries of the same (device, signature, seq_len, dtype); None if there are none."""
        raise NotImplementedError

    def devices(self) -> set[str]:
        return {k.device for k in self.timings}

    def micro_batches(self, device: str) -> list[int]:
        return sorted({k.micro_batch for k in self.timings if k.device == device})
