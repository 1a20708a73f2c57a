"""A cluster file's ``job:`` section resolved into what :func:`plan_job` needs.

The benchmarks plan every scenario this way; ``hapt-hf plan`` does the same, with its flags
taking precedence over the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.core.precision import Precision
from hapt_hf.errors import ClusterError

from .cluster import Cluster
from .model_spec import ModelSpec
from .profile import Profile
from .search import cluster_profile

__all__ = ["Job", "load_job"]


@dataclass(frozen=True)
class Job:
    """Cluster, model, batch and measured figures of one planning job."""

    cluster: Cluster
    model: ModelSpec
    global_batch_size: int
    profile: Profile | None
    """The measured figures the cluster file's ``profiles:`` names, or None."""
    precision: Precision
    """``job.precision`` resolved on the cluster's devices (``model.dtype`` is its compute)."""


def load_job(path: str | os.PathLike) -> Job:
    """Read a cluster file whose ``job:`` names the model, sequence length and global batch."""
    cluster = Cluster.load(path)
    job = cluster.job
    missing = [k for k in ("model", "seq_len", "global_batch_size") if getattr(job, k) is None]
    if missing:
        raise ClusterError(f"{path}: job.{missing[0]} is missing; a job file names the model, "
                           "seq_len and global_batch_size under 'job:'")
    precision = cluster.precision(job.precision)
    model = ModelSpec.from_job_model(job.model, job.seq_len, precision.compute,
                                     job.attn_implementation or DEFAULT_ATTN_IMPLEMENTATION)
    return Job(cluster, model, job.global_batch_size, cluster_profile(cluster, model), precision)
