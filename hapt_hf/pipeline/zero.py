"""The optimizer of one stage replica as the plan says: the whole Adam state on every replica
(``optimizer: replicated``), or ZeRO-1 (``optimizer: sharded``): the state split among the
stage's replicas.

Sharding (:class:`ShardedOptimizer`) works as ``torch.distributed.optim.ZeroRedundancyOptimizer``
does, in the group of the ranks that hold the same parameters in every replica of the stage
(the group their gradients are all-reduced in; under tensor parallelism, the ranks at one
tensor-parallel position, each holding the same shard of every sharded projection). Every such
rank still holds all of its parameters and, after the all-reduce, the same gradients, so
clipping by the global norm, fp16's overflow decision and the gradient statistics are
unchanged; each then steps only the parameters it owns (partitioned greedily by the size of
the rank's own tensors, as ``ZeroRedundancyOptimizer`` partitions) and broadcasts them to the
others, one flat broadcast per owner (and dtype). Only the Adam state is split: the fp32
weights and gradients stay on every replica. Adam is elementwise, so every parameter ends bit
for bit where the replicated optimizer would put it (tested on CPU, with fp16's skipped steps
and with tensor-parallel stages). ``ZeroRedundancyOptimizer`` itself cannot hold a
tensor-parallel stage: it makes parameters views of flat buckets and broadcasts them whole,
which a DTensor takes neither. Here whole parameters become views of their owner's bucket as
there (the broadcast writes them in place), and a DTensor's local shard
(``DTensor.to_local()``) is copied into a flat buffer and back out around the broadcast.

:class:`ShardedOptimizer` adds what a pipeline's checkpoints need: its ``state_dict()`` is this
rank's shard (the state of the parameters it owns, under their indices in the whole
optimizer, with every group's hyperparameters), so that each rank writes its own file with no
collective and no rank ever holds the whole state; ``load_state_dict`` takes that shard back on
the same rank of the same plan and refuses any other. The state of a tensor-parallel
parameter is a DTensor, as the parameter; :func:`portable_state` writes it as the rank's local
shard and :func:`load_portable_state` makes it a DTensor of the parameter again, for either
kind of optimizer.
"""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hapt_hf.compat.torch_api import mark_stepped_for_schedulers
from hapt_hf.core.precision import SHARDED
from hapt_hf.errors import ConfigError
from hapt_hf.pipeline.failure import FailureChannel
from hapt_hf.pipeline.grad_sync import flat_buffer, pack, unpack
from hapt_hf.pipeline.tensor_parallel import is_sharded, local_tensor
from hapt_hf.planner.plan import Stage

__all__ = ["ShardedOptimizer", "OptimizerPlanError", "StageOptimizers", "build_optimizer",
           "prepare_optimizer", "check_optimizer", "portable_state", "load_portable_state"]

SHARD_KEY = "hapt_shard"
"""The key of a :class:`ShardedOptimizer` state dict that says whose shard it is."""


class OptimizerPlanError(ConfigError):
    """An optimizer that does not hold its state as the stage's plan says, and cannot be made
    to; the message names the stage's setting and the fix."""


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over one stage's replicas; ``state_dict`` is this rank's shard.

    Args:
        params: The stage's parameters, or parameter groups (dicts: their hyperparameters are
            kept, and the dicts themselves become this optimizer's ``param_groups``).
        optimizer_class: The optimizer each replica runs over the parameters it owns.
        replica_pg: The process group of the ranks holding the same parameters in every
            replica of the stage (the group their gradients are all-reduced in).
        stage_index: The stage's index (named in refusals).
        source: The optimizer this one was made from, if any (see :func:`prepare_optimizer`).
        **kwargs: ``optimizer_class``'s own arguments (``lr``, ``weight_decay``, ...).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 replica_pg: Any, stage_index: int, source: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        super().__init__(params, kwargs)
        self.stage_index = stage_index
        self.replica_pg = replica_pg
        self.rank: int = dist.get_rank(replica_pg)
        """This rank's position in ``replica_pg``."""
        self.world_size: int = dist.get_world_size(replica_pg)
        """Ranks the state is split among."""
        self._source = source
        self.global_rank: int = dist.get_global_rank(replica_pg, self.rank)
        self._owner = _partition(self.param_groups, self.world_size)
        # what each owner broadcasts after the step: its parameters of one dtype and device in
        # one flat bucket
        self._buckets: list[_Bucket] = []
        for owner in range(self.world_size):
            kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in self._all_group_params():
                if self._owner[id(p)] == owner:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
            src = dist.get_global_rank(replica_pg, owner)
            self._buckets += [_Bucket.of(src, params) for params in kinds.values()]
        mine = [{**_settings(g), "params": [p for p in g["params"] if self._owner[id(p)] == self.rank]}
                for g in self.param_groups]
        self.optim: torch.optim.Optimizer = optimizer_class(mine, **kwargs)
        """This rank's optimizer over the parameters it owns (groups may be empty)."""
        _copy_settings(self.optim.param_groups, self.param_groups)  # its defaults, e.g. betas

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """Step the parameters this rank owns, then every owner broadcasts its parameters to
        the other replicas (one flat broadcast per owner and dtype)."""
        _copy_settings(self.param_groups, self.optim.param_groups)  # an LR scheduler's settings
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
        _copy_settings(self.optim.param_groups, self.param_groups)
        self._broadcast_params()
        if self._source is not None:
            # an LR scheduler built on the optimizer this one replaced drives the same group
            # dicts; tell it that its optimizer stepped, as the optimizer's own step would
            mark_stepped_for_schedulers(self._source)
        return loss

    def _broadcast_params(self) -> None:
        with torch.no_grad():
            for bucket in self._buckets:
                bucket.broadcast(self.global_rank, self.replica_pg)

    def owned_indices(self) -> list[int]:
        """Indices (over every group's parameters, in order) of the parameters this rank steps."""
        return [i for i, p in enumerate(self._all_group_params()) if self._owner[id(p)] == self.rank]

    def _all_group_params(self) -> list[torch.Tensor]:
        return list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: ``param_groups`` as ``torch.optim.Optimizer.state_dict`` gives them
        (every parameter's index, every hyperparameter), ``state`` only for the parameters this
        rank owns, under those indices. Local: no collective."""
        out = torch.optim.Optimizer.state_dict(self)
        local = self.optim.state_dict()
        owned = [p for g in self.optim.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(self._all_group_params())}
        # the local optimizer numbers its own parameters 0.. in its group order
        out["state"] = {index[id(p)]: local["state"][i] for i, p in enumerate(owned)
                        if i in local["state"]}
        out[SHARD_KEY] = {"stage": self.stage_index, "replica": self.rank,
                          "replicas": self.world_size, "owned": self.owned_indices()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back a shard :meth:`state_dict` wrote on the same replica of the same stage.

        Refuses (ValueError; the checkpoint reader names the file) a whole optimizer's state
        (the run that wrote it kept the state replicated) and another replica's shard. The
        saved hyperparameters are written into this optimizer's own group dicts, which stay
        its ``param_groups``, so an LR scheduler built on the optimizer it was made from
        goes on driving it after the load."""
        shard = state_dict.get(SHARD_KEY)
        mine = {"stage": self.stage_index, "replica": self.rank, "replicas": self.world_size,
                "owned": self.owned_indices()}
        if shard is None:
            raise ValueError(f"stage {self.stage_index}'s optimizer is sharded but the saved "
                             "state is a whole optimizer's (written with optimizer: "
                             "replicated); resume with the plan the checkpoint was written "
                             "under")
        if shard != mine:
            raise ValueError(f"the saved optimizer shard is stage {shard['stage']} replica "
                             f"{shard['replica']} of {shard['replicas']} owning parameters "
                             f"{shard['owned']}, but this is stage {self.stage_index} replica "
                             f"{self.rank} of {self.world_size} owning {mine['owned']}; resume "
                             "with the same plan and the same trainable parameters")
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved_groups] != sizes:
            raise ValueError(f"the saved optimizer state has parameter groups of "
                             f"{[len(g['params']) for g in saved_groups]} parameters, this "
                             f"optimizer {sizes}; resume with the same trainable parameters")
        # the local optimizer's own state dict: its parameters numbered 0.. in its group order
        local_groups, local_state, n = [], {}, 0
        for saved, group in zip(saved_groups, self.param_groups):
            ids = []
            for index, p in zip(saved["params"], group["params"]):
                if self._owner[id(p)] != self.rank:
                    continue
                if index in state_dict["state"]:
                    local_state[n] = state_dict["state"][index]
                ids.append(n)
                n += 1
            local_groups.append({**_settings(saved), "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        # the loaded settings go into the group dicts this optimizer was built with: an LR
        # scheduler built on the optimizer this one was made from (prepare_optimizer) holds them
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(_settings(saved))
        _copy_settings(self.param_groups, self.optim.param_groups)


@dataclass
class _Bucket:
    """One owner's parameters of one dtype and device, broadcast as one flat tensor."""

    src: int
    """The owner's global rank."""
    params: list[torch.Tensor]
    flat: torch.Tensor | None
    """The bucket (whole parameters: they are views of it); for tensor-parallel shards, a
    buffer kept across steps on a CPU (as the gradient buckets'), else None."""
    viewed: bool
    """The parameters are views of :attr:`flat` (no copy in or out)."""

    @classmethod
    def of(cls, src: int, params: list[torch.Tensor]) -> "_Bucket":
        tensors = [local_tensor(p) for p in params]
        if any(is_sharded(p) for p in params):
            # a DTensor's local shard cannot be made a view of another tensor: copied in and out
            return cls(src, params, flat_buffer(tensors), viewed=False)
        # whole parameters become views of one flat bucket, as ZeroRedundancyOptimizer's
        # parameters_as_bucket_view makes them: the broadcast reads and writes them in place
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                           device=tensors[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.reshape(-1))
                p.data = flat[offset:offset + n].view_as(p)
                offset += n
        return cls(src, params, flat, viewed=True)

    def broadcast(self, rank: int, pg: Any) -> None:
        """From the owner to the others, into every parameter (in ``torch.no_grad``)."""
        if self.viewed:
            dist.broadcast(self.flat, self.src, group=pg)
            return
        tensors = [local_tensor(p) for p in self.params]
        if self.src == rank:
            buf = pack(tensors, self.flat)
        else:
            buf = self.flat if self.flat is not None else torch.empty(
                sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        dist.broadcast(buf, self.src, group=pg)
        if self.src != rank:
            unpack(buf, tensors)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _copy_settings(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    for s, d in zip(src, dst):
        d.update(_settings(s))


def _partition(param_groups: list[dict[str, Any]], n: int) -> dict[int, int]:
    """Owner (0..n-1) of every parameter, by ``id``: group by group, the largest first (this
    rank's local shard's size), each to the owner holding the fewest elements so far (as
    ``ZeroRedundancyOptimizer`` partitions; every rank of the group sees the same sizes)."""
    sizes = [0] * n
    owner: dict[int, int] = {}
    for group in param_groups:
        for p in sorted(group["params"], key=lambda t: local_tensor(t).numel(), reverse=True):
            r = min(range(n), key=sizes.__getitem__)
            owner[id(p)] = r
            sizes[r] += local_tensor(p).numel()
    return owner


LOCAL_KEY = "hapt_local_shards"
"""The key of a :func:`portable_state` listing the ``[index, name]`` of every state tensor it
holds as this rank's local shard of a sharded (tensor-parallel) parameter's state."""


def portable_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` as a file can hold it: the state of a tensor-parallel
    parameter (a DTensor, like the parameter) as this rank's local shard, listed under
    :data:`LOCAL_KEY`; everything else as it is. :func:`load_portable_state` takes it back on
    the same rank of the same plan."""
    out = optimizer.state_dict()
    local: list[list[Any]] = []
    state = {}
    for index, entry in out["state"].items():
        state[index] = dict(entry)  # never write into the optimizer's own state dicts
        for name, value in entry.items():
            if is_sharded(value):
                state[index][name] = value.to_local().detach()  # shares the shard's storage
                local.append([index, name])
    return {**out, "state": state, LOCAL_KEY: local}


def load_portable_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` of what :func:`portable_state` wrote: each local shard
    made again the shard of its parameter (a DTensor on the parameter's mesh and placements).
    ValueError where a shard does not fit its parameter (another plan's)."""
    saved = dict(saved)
    local = saved.pop(LOCAL_KEY, [])
    if local:
        # saved indices to this optimizer's parameters, group by group (as torch maps them)
        params = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved["param_groups"]),
                          itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
        state = {i: dict(entry) for i, entry in saved["state"].items()}
        for index, name in local:
            p = params.get(index)
            if p is None or not is_sharded(p) or state[index][name].shape != local_tensor(p).shape:
                raise ValueError(f"the saved optimizer state of parameter {index} ({name!r}) is "
                                 "one tensor-parallel shard, which this optimizer's parameter "
                                 "does not take (another plan's); resume with the plan the "
                                 "checkpoint was written under")
            state[index][name] = DTensor.from_local(state[index][name], p.device_mesh, p.placements,
                                                    run_check=False, shape=p.shape, stride=p.stride())
        saved["state"] = state
    optimizer.load_state_dict(saved)


def _replica_pg_needed(stage_plan: Stage, replica_pg: Any) -> None:
    if replica_pg is None:  # validate() refuses a sharded stage of one replica: a programming error
        raise RuntimeError(f"stage {stage_plan.index} is sharded but has no replica process group")


def build_optimizer(stage_plan: Stage, replica_pg: Any, optimizer_class: type[torch.optim.Optimizer],
                    params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer_class(params, **kwargs)`` on a replicated stage; on a sharded one the same
    optimizer as a :class:`ShardedOptimizer` over the stage's replica process group."""
    if stage_plan.optimizer != SHARDED:
        return optimizer_class(params, **kwargs)
    _replica_pg_needed(stage_plan, replica_pg)
    return ShardedOptimizer(params, optimizer_class, replica_pg, stage_plan.index, **kwargs)


def _refusal(stage_plan: Stage, what: str, fix: str) -> OptimizerPlanError:
    return OptimizerPlanError(
        f"stage {stage_plan.index}'s plan says optimizer: sharded (its optimizer state split among "
        f"ranks {list(stage_plan.ranks)}), but {what}; {fix}, or set the stage's \"optimizer\" to "
        "\"replicated\" in the plan")


BUILD_IT = "build it with runtime.make_optimizer(optimizer_class, **kwargs)"
PREPARE_IT = ("build it with runtime.make_optimizer(optimizer_class, **kwargs), or pass a "
              "fresh one through runtime.prepare_optimizer(optimizer) before the first step")


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The recorded ``defaults`` that ``cls``'s constructor takes (AdamW records
    ``decoupled_weight_decay`` but sets it itself)."""
    sig = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in sig}


def prepare_optimizer(stage_plan: Stage, replica_pg: Any,
                      optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer built elsewhere, holding its state as the stage's plan says.

    Replicated stage: ``optimizer`` itself. Sharded stage: a :class:`ShardedOptimizer` of the
    same class and settings whose ``param_groups`` are ``optimizer``'s own group dicts, so that
    an LR scheduler built on ``optimizer`` drives it. Refused, naming the fix: an optimizer that
    has stepped already (its state is whole), or one whose class does not take back the
    settings it records (it cannot be rebuilt per shard).
    """
    if stage_plan.optimizer != SHARDED or isinstance(optimizer, ShardedOptimizer):
        return optimizer
    _replica_pg_needed(stage_plan, replica_pg)
    cls = type(optimizer)
    if optimizer.state:
        raise _refusal(stage_plan, f"the optimizer given ({cls.__name__}) has taken steps already "
                              "(it holds the whole state)", PREPARE_IT)
    kwargs = _constructor_kwargs(cls, optimizer.defaults)
    try:
        sharded = ShardedOptimizer(optimizer.param_groups, cls, replica_pg, stage_plan.index,
                                   source=optimizer, **kwargs)
    except (TypeError, ValueError) as e:
        raise _refusal(stage_plan, f"the optimizer given ({cls.__name__}) cannot be rebuilt for one "
                              f"shard from the settings it records ({type(e).__name__}: {e})",
                       BUILD_IT) from None
    if sharded.optim.defaults != optimizer.defaults:
        raise _refusal(stage_plan, f"the optimizer given ({cls.__name__}) rebuilt from the settings "
                              "it records does not come out the same (its constructor derives "
                              "them)", BUILD_IT)
    return sharded


def check_optimizer(stage_plan: Stage, optimizer: torch.optim.Optimizer) -> None:
    """Refuse stepping a sharded stage with an optimizer that keeps the whole state."""
    if stage_plan.optimizer == SHARDED and not isinstance(optimizer, ShardedOptimizer):
        raise _refusal(stage_plan, f"the optimizer given ({type(optimizer).__name__}) holds the "
                              "whole state", PREPARE_IT)


class StageOptimizers:
    """Makes, prepares and steps one stage replica's optimizer as the plan says.

    Args:
        stage_plan: The stage's record in the plan (its ``optimizer`` setting, index, ranks).
        module: The stage's ``nn.Module``: its trainable parameters are the default ones.
        replica_pg: The stage's replica process group (None without replicas): a sharded
            optimizer splits its state in it.
        channel: The runtime's failure channel: a replica lost in a sharded step is named.
    """

    def __init__(self, stage_plan: Stage, module: torch.nn.Module, replica_pg: Any,
                 channel: FailureChannel) -> None:
        self.stage_plan = stage_plan
        self.module = module
        self.replica_pg = replica_pg
        self.channel = channel

    def make(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None,
             **kwargs: Any) -> torch.optim.Optimizer:
        """This stage's optimizer as the plan says: ``optimizer_class(params, **kwargs)`` where
        the stage's optimizer state is replicated, a :class:`ShardedOptimizer` (ZeRO-1 over
        the stage's replicas, this rank holding its share of the state) where it is sharded.
        ``params``: parameters or parameter groups; default, the stage's that train."""
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        return build_optimizer(self.stage_plan, self.replica_pg, optimizer_class, params,
                               **kwargs)

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer built over this stage's parameters elsewhere (``Trainer``, a user's
        loop) holding its state as the plan says (:func:`prepare_optimizer`): itself, or a
        sharded one that an LR scheduler built on ``optimizer`` drives. Call it before the
        first step; an optimizer that cannot be sharded is refused, naming the fix."""
        return prepare_optimizer(self.stage_plan, self.replica_pg, optimizer)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse stepping a sharded stage with an optimizer that keeps the whole state."""
        check_optimizer(self.stage_plan, optimizer)

    def step(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None,
             result: Any = None) -> Any:
        """Step the optimizer, then the LR scheduler; gives back ``result``. A sharded
        optimizer's step broadcasts every replica's updated parameters to the others: a
        collective over the stage's replicas, so that a replica lost in it is named."""
        if isinstance(optimizer, ShardedOptimizer):
            with self.channel.collective("the sharded optimizer step", self.stage_plan.index,
                                         self.stage_plan.ranks):
                optimizer.step()
        else:
            optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        return result
