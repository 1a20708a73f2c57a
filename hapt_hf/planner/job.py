"""A cluster file's ``job:`` section resolved into what :func:`plan_job` needs.

The benchmarks plan every scenario this way (the hand formulas: no reader); ``hapt-hf plan`` and
``simulate`` do the same, passing their flags as values that take precedence over the file's
and the measuring reader (:class:`~hapt_hf.profiling.model_figures.MeasuringReader`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from hapt_hf.core.precision import Precision
from hapt_hf.errors import ClusterError

from .cluster import Cluster
from .model_spec import ModelReader, ModelSpec
from .profile import Profile
from .search import cluster_profile

__all__ = ["Job", "load_job", "JOB_FIELDS"]


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


JOB_FIELDS = ("model", "seq_len", "global_batch_size")
"""What a job must name, in the file's ``job:`` or given in its place."""


def _first(*values: Any) -> Any:
    """The first value given (0 counts as given, and is then refused as such)."""
    return next((v for v in values if v is not None), None)


def load_job(source: str | os.PathLike | Cluster, *, model: str | dict | None = None,
             seq_len: int | None = None, global_batch_size: int | None = None,
             precision: str | None = None, attn_implementation: str | None = None,
             flags: Mapping[str, str] | None = None, where: str | None = None,
             reader: ModelReader | None = None) -> Job:
    """Read a cluster file (or take a loaded cluster) whose ``job:`` names the model, sequence
    length and global batch.

    A value given here takes precedence over the file's field of the same name (a command
    line's flags). ``flags`` names, for each field, the option that could have given it, so
    that the message for a missing or non-positive value names it; ``where`` is how messages
    name the cluster (default: the path). ``reader`` is where the model's figures come from,
    as :meth:`ModelSpec.from_config` takes it (None: the hand formulas); with neither the
    argument nor the file's ``job.attn_implementation``, the attention is the model's best.
    """
    cluster = source if isinstance(source, Cluster) else Cluster.load(source)
    where = where or (cluster.name if isinstance(source, Cluster) else str(source))
    flags = flags or {}
    job = cluster.job
    values = dict(zip(JOB_FIELDS, (_first(model, job.model), _first(seq_len, job.seq_len),
                                   _first(global_batch_size, job.global_batch_size))))
    for field, value in values.items():
        if value is None:
            fix = (f"pass {flags[field]} or set job.{field} under 'job:'" if field in flags else
                   "a job file names the model, seq_len and global_batch_size under 'job:'")
            raise ClusterError(f"{where}: job.{field} is missing; {fix}")
    for field in ("seq_len", "global_batch_size"):
        if int(values[field]) < 1:  # the file's values are checked on load; these were given
            name = flags.get(field, field).split()[0]
            raise ClusterError(f"{name} must be a positive integer, got {values[field]}")
    resolved = cluster.precision(_first(precision, job.precision))
    spec = ModelSpec.from_job_model(
        values["model"], int(values["seq_len"]), resolved.compute,
        _first(attn_implementation, job.attn_implementation), reader)
    return Job(cluster, spec, int(values["global_batch_size"]), cluster_profile(cluster, spec),
               resolved)
