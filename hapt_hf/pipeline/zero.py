"""The optimizer of one stage replica as the plan says: the whole Adam state on every replica
(``optimizer: replicated``), or ZeRO-1 (``optimizer: sharded``): the state split among the
stage's replicas.

Sharding is ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the stage's replica group
(the group its gradients are all-reduced in). Every replica still holds every parameter and,
after the all-reduce, the same full gradients, so clipping by the global norm, fp16's overflow
decision and the gradient statistics are unchanged; each replica then steps only the
parameters it owns (``ZeroRedundancyOptimizer`` partitions them greedily by size) and
broadcasts them to the others. Only the Adam state is split: the fp32 weights and gradients
stay whole on every replica. Adam is elementwise, so every parameter ends bit for bit where the
replicated optimizer would put it (tested on CPU, with fp16's skipped steps).

:class:`ShardedOptimizer` adds what a pipeline's checkpoints need: its ``state_dict()`` is this
rank's shard (the state of the parameters it owns, under their indices in the whole
optimizer, with every group's hyperparameters), so that each rank writes its own file with no
collective and no rank ever holds the whole state; ``load_state_dict`` takes that shard back on
the same rank of the same plan and refuses any other.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Iterable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from hapt_hf.compat.torch_api import mark_stepped_for_schedulers
from hapt_hf.core.precision import SHARDED
from hapt_hf.errors import ConfigError
from hapt_hf.pipeline.failure import FailureChannel
from hapt_hf.planner.plan import Stage

__all__ = ["ShardedOptimizer", "OptimizerPlanError", "StageOptimizers", "build_optimizer",
           "prepare_optimizer", "check_optimizer"]

SHARD_KEY = "hapt_shard"
"""The key of a :class:`ShardedOptimizer` state dict that says whose shard it is."""


class OptimizerPlanError(ConfigError):
    """An optimizer that does not hold its state as the stage's plan says, and cannot be made
    to; the message names the stage's setting and the fix."""


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over one stage's replicas; ``state_dict`` is this rank's shard.

    Args:
        params: The stage's parameters, or parameter groups (dicts: their hyperparameters are
            kept, and the dicts themselves become this optimizer's ``param_groups``).
        optimizer_class: The optimizer each replica runs over the parameters it owns.
        replica_pg: The stage's replica process group.
        stage_index: The stage's index (named in refusals).
        source: The optimizer this one was made from, if any (see :func:`prepare_optimizer`).
        **kwargs: ``optimizer_class``'s own arguments (``lr``, ``weight_decay``, ...).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 replica_pg: Any, stage_index: int, source: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        # one broadcast of each replica's whole shard after the step (its parameters laid out
        # as views of one flat bucket), as the planner prices the all-gather; parameter by
        # parameter it would pay the link latency once per tensor
        super().__init__(params, optimizer_class=optimizer_class, process_group=replica_pg,
                         parameters_as_bucket_view=True, **kwargs)
        self.stage_index = stage_index
        self._source = source

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        loss = super().step(closure, **kwargs)
        if self._source is not None:
            # an LR scheduler built on the optimizer this one replaced drives the same group
            # dicts; tell it that its optimizer stepped, as the optimizer's own step would
            mark_stepped_for_schedulers(self._source)
        return loss

    def owned_indices(self) -> list[int]:
        """Indices (over every group's parameters, in order) of the parameters this rank steps."""
        index = {id(p): i for i, p in enumerate(self._all_group_params())}
        return sorted(index[id(p)] for g in self.optim.param_groups for p in g["params"])

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
        state = {k: v for k, v in state_dict.items() if k != SHARD_KEY}
        # torch's Optimizer.load_state_dict replaces param_groups with new dicts; an LR
        # scheduler built on the optimizer this one was made from (prepare_optimizer) holds
        # the old ones and would set every later learning rate where no step reads it. The
        # loaded settings go into the group dicts this optimizer was built with instead.
        own = self.param_groups
        super().load_state_dict(state)
        for param_group, loaded in zip(own, self.param_groups):
            param_group.update(loaded)
        self.param_groups = own


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
