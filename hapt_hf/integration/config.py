"""The hapt config (``hapt.yaml``): what a user asks of hapt_hf for one training job.

A user writes one small YAML file next to their accelerate config::

    cluster: ../../hapt_hf/data/clusters/cpu_demo_4.yaml   # or `plan: plan.json`
    schedule: h1f1b
    global_batch_size: 8
    precision: auto        # bf16 | fp16 | fp32 | auto (bf16 where every GPU has it)
    attn_implementation: sdpa   # or eager (default: the model's best); the planner budgets it
    planner: {}            # search options (PlannerOptions fields), e.g. {max_stages: 4}

Relative paths are resolved against the directory of the hapt config, so the file can be moved
together with the files it names. What the user asks for lives here; what is derived from it
(the plan) lives in :class:`hapt_hf.planner.plan.Plan`. The ``planner:`` mapping is read into
the search's own :class:`~hapt_hf.planner.search.PlannerOptions` (one list of options, each
documented there) when the config is loaded, so every rank refuses a bad option alike.

``HaptConfig`` is not an Accelerate plugin; ``HaptPlugin`` is its former name, kept so that
existing scripts still import.
"""
from __future__ import annotations

import os
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS, DEFAULT_TIMEOUT_S
from hapt_hf.core.precision import DTYPES, PRECISIONS, canonical_precision
from hapt_hf.core.schedules import SCHEDULES
from hapt_hf.errors import ConfigError, HaptError
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.search import PlannerOptions

__all__ = ["HaptConfigError", "HaptConfig", "HaptPlugin", "PlannerOptions", "HAPT_CONFIG_ENV",
           "resolve_hapt_config_path", "planner_options"]

HAPT_CONFIG_ENV = "HAPT_CONFIG"


class HaptConfigError(ConfigError):
    """A hapt config that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class HaptConfig:
    """What a user asks of hapt_hf for one training job (the contents of ``hapt.yaml``).

    Args:
        cluster: Cluster file (groups of alike GPUs and their links), or a ``Cluster``. Rank 0
            plans from it.
        plan: A ready ``plan.json``. With ``cluster`` too, the two must describe the same
            world size and the plan must name the cluster's groups.
        schedule: Pipeline schedule, one of ``SCHEDULES`` (``gpipe``, ``1f1b``, ``h1f1b``,
            ``zero_bubble``, ``interleaved``); given, it is kept (a ready plan is re-derived
            for it, the planner searches under it alone). None (left out): a ready plan keeps
            its own, and the planner chooses: H-1F1B, or zero_bubble / interleaved where its
            simulator finds them faster and they fit (``planner.weigh_kinds``).
        global_batch_size: Samples per optimizer step (the whole pipeline's batch). Optional:
            ``HaptTrainer`` and ``HaptAccelerator`` derive it from their arguments as
            ``Trainer`` / ``Accelerator`` define it; given, it must agree with theirs.
        seq_len: Tokens per sample; the recipes' ``--seq_len`` overrides it.
        precision: ``auto``, ``bf16``, ``fp16`` or ``fp32``: the compute dtype (weights and
            optimizer state stay fp32). ``auto`` (the default): bf16 where every GPU of the
            cluster has it, else fp16 with dynamic loss scaling, fp32 on CPUs.
        dtype: Older name of ``precision``, read as the same setting.
        attn_implementation: ``eager`` or ``sdpa``; None: the model's best, sdpa where the
            model's class supports it, else eager (rank 0 chooses it when planning; the plan
            carries it). The planner budgets the memory the chosen one keeps, and the stages
            are built with it; one the model cannot run is refused.
        planner: Search options (:class:`~hapt_hf.planner.search.PlannerOptions`, every field
            documented there); a mapping is read into one and checked key by key on every
            rank. Its ``schedule`` is this config's ``schedule`` (H-1F1B when left out), and a
            schedule given here turns ``weigh_kinds`` off unless the mapping sets it.
        timeout_s: How long a rank waits for the others before the job ends with a message.
        checkpoint_local_dir: A directory on each node's own disk (the same path on every
            node). Set, HaptTrainer writes each checkpoint's portable part there first and
            copies it into the checkpoint in the (shared) output directory in the background;
            a resume on another plan reads this node's copy first and fetches only what it
            lacks (:mod:`hapt_hf.pipeline.checkpoint_store`). None: written into the output
            directory directly.
        checkpoint_retries: How that background copy and a recovery's reads retry an error a
            retry may mend (a busy or briefly unreachable shared store): a mapping of
            ``attempts`` (most attempts of one request, 1: none retried; default 5),
            ``backoff_s`` (the wait before the second, doubled before each next; default 1)
            and ``retry_s`` (most seconds one request's attempts and waits may take; default
            600), any of them left out taking its default. Only with ``checkpoint_local_dir``.
        source: Where this config was read from (for messages); not a YAML key.
    """

    cluster: Path | Cluster | None = field(default=None,
                                          metadata={"help": "Cluster YAML file to plan on."})
    plan: Path | None = field(default=None, metadata={"help": "Ready plan.json to run as is."})
    schedule: str | None = field(default=None, metadata={
        "help": f"One of {SCHEDULES}; default: a plan's own, or the planner's choice."})
    global_batch_size: int | None = field(
        default=None, metadata={"help": "Samples per optimizer step (default: derived)."})
    seq_len: int | None = field(default=None, metadata={"help": "Tokens per sample."})
    precision: str | None = field(default=None, metadata={"help": f"One of {PRECISIONS}."})
    dtype: str | None = field(default=None, metadata={"help": "Older name of precision."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": f"One of {ATTN_IMPLEMENTATIONS}; default: the model's "
                                        "best (sdpa where the model supports it, else eager)."})
    planner: PlannerOptions = field(default_factory=PlannerOptions,
                                    metadata={"help": "Search options (PlannerOptions fields)."})
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S,
                             metadata={"help": "Seconds before a stuck job ends."})
    checkpoint_local_dir: Path | None = field(
        default=None, metadata={"help": "Node-local directory for checkpoints' shards (copied "
                                        "to the output directory in the background)."})
    checkpoint_retries: dict[str, float] | None = field(
        default=None, metadata={"help": "How the background copy and a recovery's reads retry "
                                        "(attempts, backoff_s, retry_s)."})
    source: str = field(default="<arguments>", metadata={"help": "Where the config came from."})

    def __post_init__(self) -> None:
        where = self.source
        if self.cluster is None and self.plan is None:
            raise HaptConfigError(f"{where}: give 'cluster' (a cluster YAML to plan on) or 'plan' "
                                  "(a ready plan.json); neither is set")
        for name in ("cluster", "plan"):
            path = getattr(self, name)
            if isinstance(path, Cluster):  # a cluster described in memory (local_cluster)
                continue
            if path is not None and not Path(path).is_file():
                raise HaptConfigError(f"{where}: '{name}' names {str(path)!r}, which does not "
                                      "exist; fix the path (relative paths are read from the "
                                      "hapt config's directory)")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise HaptConfigError(f"{where}: 'schedule' is {self.schedule!r}; use one of "
                                  f"{', '.join(SCHEDULES)}")
        if self.global_batch_size is not None and (not isinstance(self.global_batch_size, int)
                                                   or self.global_batch_size < 1):
            raise HaptConfigError(f"{where}: 'global_batch_size' is {self.global_batch_size!r}; "
                                  "it must be a positive integer")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise HaptConfigError(f"{where}: 'seq_len' is {self.seq_len!r}; it must be an "
                                  "integer >= 2")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise HaptConfigError(f"{where}: 'dtype' is {self.dtype!r}; use one of "
                                  f"{', '.join(DTYPES)} (or 'precision', its newer name)")
        if self.precision is not None and canonical_precision(self.precision) is None:
            raise HaptConfigError(f"{where}: 'precision' is {self.precision!r}; use one of "
                                  f"{', '.join(PRECISIONS)}")
        if None not in (self.precision, self.dtype) and self.precision != self.dtype:
            raise HaptConfigError(f"{where}: 'precision' is {self.precision!r} but 'dtype' is "
                                  f"{self.dtype!r}; keep 'precision' only (dtype is its older "
                                  "name)")
        if self.attn_implementation is not None and \
                self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise HaptConfigError(f"{where}: 'attn_implementation' is "
                                  f"{self.attn_implementation!r}; use one of "
                                  f"{', '.join(ATTN_IMPLEMENTATIONS)}")
        # frozen: the mapping a caller or the YAML gave becomes the typed options once, here
        object.__setattr__(self, "planner", planner_options(self.planner, self.schedule, where))
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise HaptConfigError(f"{where}: 'timeout_s' is {self.timeout_s!r}; it must be a "
                                  "positive number of seconds")
        if self.checkpoint_local_dir is not None:
            if not isinstance(self.checkpoint_local_dir, (str, os.PathLike)) \
                    or not str(self.checkpoint_local_dir):
                raise HaptConfigError(f"{where}: 'checkpoint_local_dir' is "
                                      f"{self.checkpoint_local_dir!r}; give a directory on the "
                                      "nodes' own disks (e.g. /local_nvme/run)")
            object.__setattr__(self, "checkpoint_local_dir",
                               Path(os.path.expanduser(str(self.checkpoint_local_dir))))
        if self.checkpoint_retries is not None:
            object.__setattr__(self, "checkpoint_retries",
                               checkpoint_retries(self.checkpoint_retries, where))

    def load_cluster(self) -> "Cluster":
        """The cluster to plan on: read from the file named, or the one given in memory."""
        return self.cluster if isinstance(self.cluster, Cluster) else Cluster.load(self.cluster)

    @property
    def requested_precision(self) -> str | None:
        """What the config asks for under either name; None: auto."""
        return self.precision or self.dtype

    def with_global_batch(self, derived: int, how: str) -> "HaptConfig":
        """This config planning for ``derived`` samples per step, which the caller's own
        arguments define (``how`` says how, for the message); a ``global_batch_size`` the
        config sets must be the same number."""
        if self.global_batch_size not in (None, derived):
            raise HaptConfigError(f"{self.source}: global_batch_size is {self.global_batch_size}"
                                  f" but {how} = {derived} samples per step; make the two agree"
                                  " or remove global_batch_size from the hapt config")
        return replace(self, global_batch_size=derived)

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None,
                  source: str = "<dict>") -> "HaptConfig":
        """Build from a parsed YAML mapping; paths are resolved against ``base_dir``."""
        if not isinstance(data, dict):
            raise HaptConfigError(f"{source}: a hapt config is a YAML mapping with keys such as "
                                  "'cluster' or 'plan' and 'schedule'; got "
                                  f"{type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HaptConfigError(f"{source}: unknown key(s) {unknown}; the keys are "
                                  f"{sorted(known)}")
        kwargs = dict(data)
        for name in ("cluster", "plan"):
            if kwargs.get(name) is not None:
                path = Path(os.path.expanduser(str(kwargs[name])))
                if not path.is_absolute() and base_dir is not None:
                    path = base_dir / path
                kwargs[name] = path
        return cls(**kwargs, source=source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "HaptConfig":
        path = Path(path)
        if not path.is_file():
            raise HaptConfigError(f"hapt config {str(path)!r} does not exist; pass an existing "
                                  f"file with --hapt_config or the {HAPT_CONFIG_ENV} variable "
                                  "(see recipes/configs/hapt_cpu_demo.yaml)")
        try:
            data = yaml.safe_load(path.read_text())
        except UnicodeDecodeError:
            raise HaptConfigError(f"hapt config {str(path)!r} is not a text file (not UTF-8); "
                                  "give the YAML hapt config (see "
                                  "recipes/configs/hapt_cpu_demo.yaml)") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise HaptConfigError(f"hapt config {str(path)!r} is not valid YAML{at}: "
                                  f"{getattr(e, 'problem', e)}") from None
        return cls.from_dict(data, base_dir=path.resolve().parent, source=str(path))

    @classmethod
    def from_args_or_env(cls, path: str | None = None) -> "HaptConfig":
        """The config from ``--hapt_config`` if given, else from the ``HAPT_CONFIG`` variable."""
        return cls.from_yaml(resolve_hapt_config_path(path))


# Former name of HaptConfig (it never was an Accelerate plugin); kept for existing imports.
HaptPlugin = HaptConfig


def _accepts(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a PlannerOptions field's type (bool is no int, int is a float)."""
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, arm) for arm in typing.get_args(hint))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, (list, tuple)) and all(_accepts(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def planner_options(given: Any, schedule: str | None, where: str) -> PlannerOptions:
    """The ``planner:`` options as the search's ``PlannerOptions``, with ``schedule`` set.

    ``schedule`` None: the planner's choice (its default schedule, other kinds weighed as the
    options say); given: the search keeps it (``weigh_kinds`` false unless the mapping sets
    it), so a schedule the user named is the schedule the plan runs.

    A mapping is checked key by key (unknown key, wrong type, out-of-range value: one message
    naming the key, and the valid keys); lists become tuples (the options are frozen).
    """
    if isinstance(given, PlannerOptions):
        if schedule is None:
            return given
        if given.schedule not in (schedule, PlannerOptions().schedule):
            raise HaptConfigError(f"{where}: the planner options say schedule "
                                  f"{given.schedule!r} but 'schedule' is {schedule!r}; set "
                                  "'schedule' alone")
        return replace(given, schedule=schedule, weigh_kinds=False)
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise HaptConfigError(f"{where}: 'planner' must be a mapping of search options, got "
                              f"{type(given).__name__}")
    hints = typing.get_type_hints(PlannerOptions)
    valid = sorted(f.name for f in fields(PlannerOptions) if f.name != "schedule")
    for key, value in given.items():
        if key == "schedule":
            raise HaptConfigError(f"{where}: 'planner' sets 'schedule'; set it at the top level "
                                  "of the hapt config instead (schedule: h1f1b)")
        if key not in hints:
            raise HaptConfigError(f"{where}: 'planner' has unknown option {key!r}; the options "
                                  f"are {valid}")
        if not _accepts(value, hints[key]):
            raise HaptConfigError(f"{where}: 'planner.{key}' is {value!r}; it must be "
                                  f"{hints[key]}".replace("typing.", ""))
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    if schedule is not None:
        values = {"weigh_kinds": False, **values, "schedule": schedule}
    try:
        return PlannerOptions(**values)
    except HaptError as e:  # a value out of range (PlanningError names the option)
        raise HaptConfigError(f"{where}: 'planner': {e}") from None


def resolve_hapt_config_path(path: str | None = None) -> Path:
    """The hapt config path: the argument first, then ``$HAPT_CONFIG``; an error if neither."""
    chosen = path or os.environ.get(HAPT_CONFIG_ENV)
    if not chosen:
        raise HaptConfigError(f"no hapt config given; pass --hapt_config hapt.yaml or set "
                              f"{HAPT_CONFIG_ENV} (see recipes/configs/hapt_cpu_demo.yaml)")
    return Path(chosen)


RETRY_KEYS = {"attempts": "upload_attempts", "backoff_s": "upload_backoff_s",
              "retry_s": "upload_retry_s"}
"""``checkpoint_retries``' keys and the :class:`~hapt_hf.pipeline.checkpoint_store.CheckpointStore`
fields they set."""


def checkpoint_retries(given: Any, where: str) -> dict[str, float]:
    """``checkpoint_retries`` checked key by key: a mapping of :data:`RETRY_KEYS` (``attempts`` a
    whole number >= 1, the two others seconds >= 0), returned as given."""
    if not isinstance(given, dict):
        raise HaptConfigError(f"{where}: 'checkpoint_retries' is {given!r}; give a mapping such as "
                              "{attempts: 8, backoff_s: 2, retry_s: 900}")
    unknown = sorted(set(given) - set(RETRY_KEYS))
    if unknown:
        raise HaptConfigError(f"{where}: 'checkpoint_retries' has unknown key(s) "
                              f"{', '.join(map(repr, unknown))}; its keys are "
                              f"{', '.join(RETRY_KEYS)}")
    from hapt_hf.pipeline.checkpoint_store import retry_setting_problem  # the store's own rule
    for key, value in given.items():
        need = retry_setting_problem(RETRY_KEYS[key], value)
        if need:
            raise HaptConfigError(f"{where}: 'checkpoint_retries.{key}' is {value!r}; give {need}")
    return dict(given)
