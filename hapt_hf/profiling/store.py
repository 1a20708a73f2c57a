"""The profile store: a JSON file of measured layer timings and links, and how to measure.

The file has one format with :meth:`hapt_hf.planner.profile.Profile.save`, so the planner reads
a store as a profile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS
from hapt_hf.errors import ProfileError
from hapt_hf.planner.profile import (LayerTiming, LinkMeasurement, Profile, ProfileKey,
                                    StepOverheads, link_pair)

__all__ = ["ProfilerError", "ProfilerOptions", "ProfileStore"]


class ProfilerError(ProfileError):
    """Bad profiler input (micro-batch sizes, store file...); the message says the fix."""


@dataclass(frozen=True)
class ProfilerOptions:
    """How to measure.

    Args:
        micro_batches: samples per forward on one device; one entry per size in the store.
        warmup: untimed forward+backward passes before timing (allocator, kernel caches); the
            first also counts the activation memory, the last sizes the timing windows.
        repeats: timed windows; the median is reported, the spread is (p75 - p25) / median.
        min_window_s: each window repeats the pass until it lasts this long, so a CPU quota's
            10 ms throttling periods average out instead of landing in a single sample.
        attn_implementation: as the job's runtime builds its stages ("eager" or "sdpa"); None:
            the model's best (:func:`hapt_hf.profiling.model_figures.choose_attention`, decided
            by the profiler once it has the model's config).
        tp_degrees: tensor-parallel degrees above 1 at which a block's compute split is timed
            too (:func:`hapt_hf.profiling.tp_split.split_block`: one TP rank's shard of the
            projections the model's plan shards); each is kept where the model's heads,
            key/value heads and MLP width divide and the profiler says why it drops the others.
            (): none.
    """

    micro_batches: tuple[int, ...] = (1, 2, 4)
    warmup: int = 2
    repeats: int = 5
    min_window_s: float = 0.05
    attn_implementation: str | None = None
    budget_s: float = 4.0
    """Timed seconds one entry aims at: slow layers get fewer windows (never under 3)."""
    tp_degrees: tuple[int, ...] = ()
    step_overheads: bool = True
    """Also measure the device's step overheads on a stage of blocks: the fixed cost per
    action and the split backward's parts (:mod:`hapt_hf.profiling.overheads`)."""

    def __post_init__(self) -> None:
        if not self.micro_batches or any(not isinstance(b, int) or b < 1
                                         for b in self.micro_batches):
            raise ProfilerError(f"micro_batches {self.micro_batches!r} must be positive "
                                "integers, e.g. --micro-batches 1,2,4")
        if self.repeats < 1 or self.warmup < 1:
            raise ProfilerError(f"repeats ({self.repeats}) and warmup ({self.warmup}) must be "
                                ">= 1")
        if self.attn_implementation is not None and \
                self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ProfilerError(f"attn_implementation {self.attn_implementation!r} is not "
                                f"known; use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        if any(not isinstance(t, int) or t < 1 for t in self.tp_degrees):
            raise ProfilerError(f"tp_degrees {self.tp_degrees!r} must be positive integers, "
                                "e.g. --tp-degrees 2,4")
        if self.min_window_s < 0:
            raise ProfilerError(f"min_window_s ({self.min_window_s}) must be >= 0")


@dataclass
class ProfileStore:
    """A JSON file of measured layer timings and links; created on first save.

    A block's tensor-parallel compute split is a timing whose key has ``tp`` > 1 (one rank's
    shard, its all-reduces not included); a tensor-parallel all-reduce inside a group is a link
    with ``tp`` > 1, kept in ``tp_links`` by (group, degree)."""

    path: Path
    timings: dict[ProfileKey, LayerTiming] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkMeasurement] = field(default_factory=dict)
    tp_links: dict[tuple[str, int], LinkMeasurement] = field(default_factory=dict)
    overheads: dict[str, StepOverheads] = field(default_factory=dict)
    """Device name -> its measured step overheads."""

    @classmethod
    def open(cls, path: str | Path) -> "ProfileStore":
        store = cls(Path(path))
        if store.path.exists():
            store._read()
        return store

    def _read(self) -> None:
        try:
            profile = Profile.load(self.path)  # one file format with Profile.save
        except ProfileError as e:
            raise ProfilerError(f"profile store {self.path}: {e}; delete it or pass another "
                                "--store") from None
        self.timings.update(profile.timings)
        self.overheads.update(profile.overheads)
        for m in profile.links:
            self.put_link(m)

    def get(self, key: ProfileKey) -> LayerTiming | None:
        return self.timings.get(key)

    def put(self, key: ProfileKey, timing: LayerTiming) -> None:
        self.timings[key] = timing

    def put_link(self, m: LinkMeasurement) -> None:
        """A link between two groups or inside one; a tensor-parallel all-reduce (``m.tp`` > 1)
        goes to ``tp_links``."""
        if m.tp > 1:
            self.tp_links[(m.a, m.tp)] = m
        else:
            self.links[link_pair(m.a, m.b)] = m

    def merge(self, other: "ProfileStore") -> None:
        """Take every entry of ``other`` (it wins where both have one)."""
        self.timings.update(other.timings)
        self.links.update(other.links)
        self.tp_links.update(other.tp_links)
        self.overheads.update(other.overheads)

    def save(self) -> None:
        """Write atomically (a reader never sees half a file), sorted so diffs stay readable."""
        self.to_profile().save(self.path)

    def all_links(self) -> list[LinkMeasurement]:
        """Links between groups and inside them, then tensor-parallel all-reduces, sorted."""
        return [*(m for _, m in sorted(self.links.items())),
                *(m for _, m in sorted(self.tp_links.items()))]

    def to_profile(self) -> Profile:
        return Profile(timings=dict(sorted(self.timings.items())), links=self.all_links(),
                       source=str(self.path), overheads=dict(sorted(self.overheads.items())))
