"""GPU catalogue: public peak figures the cost model falls back to when nothing was measured.

``tflops`` is the peak DENSE fp16/bf16 tensor-core rate (no 2:4 sparsity), as printed in the
vendor's datasheet or architecture whitepaper. GeForce cards run fp16 matmuls with fp32
accumulation (what mixed-precision training uses) at half their fp16-accumulate rate; their
figures below are the fp32-accumulate ones. ``memory_gb`` is the device memory in GB (1e9 bytes,
as marketed). ``bf16``: whether the device computes in bfloat16 (NVIDIA Ampere and later; Volta,
Turing and Pascal do not), which ``precision: auto`` reads.

Names: a cluster file may use a canonical name or an alias (``H100`` = ``H100-80``, ``GH-96`` =
``GH200``); matching ignores case, spaces and underscores. ``GpuType.profile_names`` lists the
names under which measured profiles store a device (the Sailor profiles in
``shared/data/gpu-profiles`` call the 96 GB GH200 ``GH-96``); :func:`device_names` gives every
name of one device so a profile lookup can match any of them.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuType", "CATALOGUE", "ALIASES", "find_gpu", "known_gpu_names", "device_names",
           "looks_like_cpu"]


@dataclass(frozen=True)
class GpuType:
    name: str
    """Catalogue name, e.g. 'V100-32', 'A100-40', 'cpu'."""
    tflops: float
    """Peak dense fp16/bf16 TFLOP/s (fp32 for 'cpu')."""
    memory_gb: float
    """Memory of one device, GB (1e9 bytes)."""
    profile_names: tuple[str, ...] = ()
    """Other names measured profiles may use for this device (e.g. 'GH-96' for 'GH200')."""
    bf16: bool | None = None
    """Computes in bfloat16; None: not known (a device outside the catalogue)."""
    is_cpu: bool = False
    """A CPU standing in for a GPU (testbeds): jobs on it train in fp32 by default."""


def _g(name: str, tflops: float, memory_gb: float, *profile_names: str,
       bf16: bool = True) -> GpuType:
    return GpuType(name, tflops, memory_gb, tuple(profile_names), bf16)


CATALOGUE: dict[str, GpuType] = {g.name: g for g in (
    _g("V100-16", 125, 16, bf16=False),  # V100 SXM2 datasheet: 125 TFLOPS tensor, 16 GB HBM2
    _g("V100-32", 125, 32, bf16=False),  # V100 SXM2 datasheet: 125 TFLOPS tensor, 32 GB HBM2
    _g("A100-40", 312, 40),      # A100 datasheet: 312 TFLOPS bf16/fp16 dense, 40 GB
    _g("A100-80", 312, 80),      # A100 datasheet: 312 TFLOPS bf16/fp16 dense, 80 GB
    _g("H100-80", 989, 80),      # H100 SXM datasheet: 1979 with sparsity -> 989 dense, 80 GB
    _g("H200", 989, 141),        # H200 SXM datasheet: same compute as H100 SXM, 141 GB HBM3e
    _g("GH200", 989, 96, "GH-96"),  # GH200 datasheet: H100-class GPU, 96 GB HBM3 variant
    _g("L4", 121, 24),           # L4 datasheet: 242 with sparsity -> 121 dense, 24 GB
    _g("L40S", 362, 48),         # L40S datasheet: 733 with sparsity -> 362 dense, 48 GB
    _g("A10", 125, 24),          # A10 datasheet: 125 TFLOPS fp16 tensor dense, 24 GB
    _g("A40", 149.7, 48),        # A40 datasheet: 299.4 with sparsity -> 149.7 dense, 48 GB
    _g("L40", 181, 48),          # L40 datasheet: 362 with sparsity -> 181 dense, 48 GB
    _g("T4", 65, 16, bf16=False),  # T4 datasheet: 65 TFLOPS mixed precision, 16 GB
    _g("RTX-3090", 71, 24),      # Ampere GA102 whitepaper: 71 fp16 tensor w/ fp32 acc, 24 GB
    _g("RTX-4080", 97.5, 16),    # Ada whitepaper: 97.5 fp16 tensor w/ fp32 acc, 16 GB
    _g("RTX-4090", 165.2, 24),   # Ada whitepaper: 165.2 fp16 tensor w/ fp32 acc, 24 GB
    _g("A6000", 154.8, 48),      # RTX A6000 datasheet: 154.8 fp16 tensor dense, 48 GB
    # Titan RTX: 130 TFLOPS fp16 tensor (full-rate fp32 acc), 24 GB
    _g("Titan-RTX", 130, 24, bf16=False),
    _g("RTX-2080", 40.3, 8, bf16=False),  # Turing whitepaper: 40.3 fp16 w/ fp32 acc, 8 GB
    # CPU testbeds: ~0.1 TFLOP/s fp32 is a few AVX2 cores; 16 GB is a fixed share of host memory
    # (not read from the machine, so a plan does not change with where it is made)
    GpuType("cpu", 0.1, 16, bf16=True, is_cpu=True),
)}

ALIASES: dict[str, str] = {
    "H100": "H100-80", "GH-96": "GH200", "A100": "A100-40", "RTX-A6000": "A6000",
    "TITAN-RTX": "Titan-RTX",
}


def _norm(name: str) -> str:
    return str(name).strip().upper().replace(" ", "-").replace("_", "-")


_BY_NORM: dict[str, str] = {_norm(n): n for n in CATALOGUE}
_BY_NORM.update({_norm(a): n for a, n in ALIASES.items()})


def find_gpu(name: str) -> GpuType | None:
    """The catalogue entry for a canonical name or alias (case-insensitive), or None."""
    canonical = _BY_NORM.get(_norm(name))
    return CATALOGUE[canonical] if canonical else None


def looks_like_cpu(name: str) -> bool:
    """A device name a testbed gives its CPU processes (``cpu``, ``cpu-fast``...)."""
    return _norm(name) == "CPU" or _norm(name).startswith("CPU-")


def known_gpu_names() -> list[str]:
    return list(CATALOGUE)


def device_names(name: str) -> tuple[str, ...]:
    """Every name one device may be stored under in a profile: the given name first, then the
    canonical name, its profile names and its aliases. An unknown name maps to itself only."""
    gpu = find_gpu(name)
    if gpu is None:
        return (name,)
    names = [name, gpu.name, *gpu.profile_names,
             *(a for a, n in ALIASES.items() if n == gpu.name)]
    return tuple(dict.fromkeys(names))
