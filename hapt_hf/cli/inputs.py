"""What ``hapt-hf plan`` and ``simulate`` plan or replay: the flags resolved against the
cluster file's ``job:`` section (flags first), or the demo job when no cluster is named. Every
model is read off the model itself (:class:`~hapt_hf.profiling.model_figures.MeasuringReader`,
imported only when a model is planned, so that the other commands start without torch)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hapt_hf.errors import HaptError, ModelSpecError

if TYPE_CHECKING:  # imported lazily below, so that `hapt-hf --help` answers at once
    from hapt_hf.planner.cluster import Cluster
    from hapt_hf.planner.model_spec import ModelReader, ModelSpec
    from hapt_hf.planner.profile import Profile

__all__ = ["UsageError", "JobInputs", "load_cluster", "resolve_job", "model_spec",
           "DEMO_CLUSTER", "DEMO_MODEL", "model_reader"]

DEMO_CLUSTER = "v100x8_a100x4"
"""The built-in cluster planned without --cluster; its ``job:`` names the demo job."""
DEMO_MODEL = "gpt2"
"""The model of the demo cluster's ``job:`` (named in the help text)."""
JOB_FLAGS = {"model": "--model NAME_OR_PATH", "seq_len": "--seq-len N",
             "global_batch_size": "--global-batch N"}
"""The flag that stands in for each field of a cluster file's ``job:``."""


class UsageError(HaptError):
    """A command line that cannot be carried out; the message says which flag to give."""


@dataclass(frozen=True)
class JobInputs:
    """Everything the planner needs, resolved from the flags and the cluster file's ``job:``."""

    cluster: Cluster
    model: ModelSpec
    profile: Profile | None
    """Measured layer times from the cluster file's ``profiles:``, or None."""
    global_batch_size: int
    cluster_source: str
    """The file the cluster came from, or ``built-in <name>``."""
    precision: Any = None
    """The job's Precision, resolved on the cluster's devices (with why it was chosen)."""


def load_cluster(name_or_path: str | None) -> tuple[Cluster, str]:
    """A cluster file, or the name of a built-in one (default: the demo cluster)."""
    from hapt_hf.planner.cluster import Cluster, builtin_cluster_names, builtin_cluster_path

    name = name_or_path or DEMO_CLUSTER
    path = Path(name)
    if path.is_file():
        return Cluster.load(path), str(path)
    if path.suffix in (".yaml", ".yml", ".json") or "/" in name:
        raise UsageError(f"--cluster: file {name!r} does not exist; give a cluster file or a "
                         f"built-in name ({', '.join(builtin_cluster_names())})")
    if name.removesuffix(".yaml") not in builtin_cluster_names():
        raise UsageError(f"--cluster: {name!r} is neither a file nor a built-in cluster; "
                         f"built-ins: {', '.join(builtin_cluster_names())}")
    return Cluster.load(builtin_cluster_path(name)), f"built-in {name}"


def model_spec(model: str | dict | None, seq_len: int, dtype: str, where: str,
               attn: str | None = None) -> ModelSpec:
    """The model a ``--model`` flag or a ``job: model:`` value names (as ``load_job`` reads it);
    ``attn`` None: the model's best."""
    from hapt_hf.planner.model_spec import ModelSpec

    if not model:
        raise ModelSpecError(f"no model given: pass --model NAME_OR_PATH or set job.model in "
                             f"{where}")
    return ModelSpec.from_job_model(model, seq_len, dtype, attn, model_reader())


def model_reader() -> ModelReader:
    """The reader every model planned is read with (the hand-formula families too)."""
    from hapt_hf.profiling.model_figures import MeasuringReader
    return MeasuringReader()


def _with_store(cluster: Cluster, profile: Profile | None, store: str | None
                ) -> tuple[Cluster, Profile | None]:
    """Measured figures: the cluster file's ``profiles:`` (``profile``), then a ``hapt-hf
    profile`` store.

    The store wins where both measured the same thing, and its measured links replace the
    cluster file's link figures, so a plan follows what this machine's devices really do.
    """
    if store is None:
        return cluster, profile
    if not Path(store).is_file():
        raise UsageError(f"--profile {store}: no such profile store; write one with "
                         "`hapt-hf profile ... --store FILE`")
    from hapt_hf.planner.profile import Profile, cluster_with_links
    measured = Profile.load(store)
    profile = measured if profile is None else profile.merge(measured)
    return cluster_with_links(cluster, measured), profile


def _precision_flag(precision: str | None, dtype: str | None) -> str | None:
    """--precision, or the older --dtype (the same setting under its former name)."""
    if precision is not None and dtype is not None and precision != dtype:
        raise UsageError(f"--precision {precision} and --dtype {dtype} disagree; give "
                         "--precision only (--dtype is its older name)")
    return precision or dtype


def resolve_job(cluster_arg: str | None, *, model: str | None = None, seq_len: int | None = None,
                global_batch: int | None = None, dtype: str | None = None,
                profile_store: str | None = None, precision: str | None = None,
                attn_implementation: str | None = None) -> JobInputs:
    """Flags first, then the cluster file's ``job:``; with no cluster at all, the demo job.

    The file and the flags are read by :func:`hapt_hf.planner.job.load_job` (the flags as
    values that take precedence), then a ``--profile`` store is merged in.
    """
    from hapt_hf.planner.job import load_job

    cluster, source = load_cluster(cluster_arg)
    job = load_job(cluster, model=model, seq_len=seq_len, global_batch_size=global_batch,
                   precision=_precision_flag(precision, dtype),
                   attn_implementation=attn_implementation, flags=JOB_FLAGS, where=source,
                   reader=model_reader())
    cluster, profile = _with_store(job.cluster, job.profile, profile_store)
    return JobInputs(cluster, job.model, profile, job.global_batch_size, source, job.precision)
