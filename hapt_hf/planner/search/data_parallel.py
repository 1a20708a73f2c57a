"""Data parallelism as a plan: one stage holding the whole model on every GPU of the groups kept.

Two variants, scored by the same simulator as every pipeline:

* ``uneven`` (the planner's candidate): each GPU takes a share of every micro-batch in
  proportion to its speed (:func:`~hapt_hf.core.shares.speed_shares`), so unlike GPUs finish
  together; where the whole model fits every GPU and the links between groups carry the
  gradient all-reduce behind the backward, it has no pipeline bubble and no cut to pay;
* ``equal`` (the ``ddp`` baseline, what ``accelerate launch`` does today): every GPU the same
  share, the fastest waiting for the slowest.

Either fits only where every GPU holds the whole model's weights, gradients and optimizer state
plus its share's activations (recompute switched on where only that fits, as for any stage).
The optimizer state may be replicated or sharded among all the GPUs (ZeRO-1: the ``zero1_ddp``
baseline with equal shares; the candidate weighs both and keeps the faster that fits).
"""
from __future__ import annotations

from dataclasses import dataclass

from hapt_hf.core.precision import REPLICATED, SHARDED
from hapt_hf.core.shares import speed_shares
from hapt_hf.errors import CostModelError

from ..cluster import GpuGroup
from ..cost_model import CostModel
from ..plan import Replica
from ..simulate import SimResult
from .options import Layout
from .problem import SearchProblem
from .replays import simulate_layout
from .shapes import divisors
from .warmups import hapt_warmups

__all__ = ["DataParallel", "data_parallel", "dp_shares", "layer_speed_shares"]


@dataclass(frozen=True)
class DataParallel:
    """The best one-stage data-parallel layout found, or why there is none."""

    layout: Layout | None
    sim: SimResult | None
    reason: str = ""
    """Why no layout fits (empty when there is one)."""


def layer_speed_shares(cm: CostModel, gpus: list[GpuGroup], mbs: int, a: int, b: int,
                       recompute: bool = False) -> tuple[int, ...]:
    """Shares of a micro-batch of ``mbs`` for GPUs of these groups (one entry per GPU, in
    order) holding layers [a, b), by each GPU's forward + backward time on them."""
    memo: dict[tuple[str, int], float] = {}

    def timer(g: GpuGroup):
        def t(s: int) -> float:
            if (g.name, s) not in memo:
                memo[g.name, s] = sum(cm.compute_s(g, s, a, b, recompute, cm.tp_of(g)))
            return memo[g.name, s]
        return t

    return speed_shares(mbs, [timer(g) for g in gpus])


def dp_shares(cm: CostModel, mbs: int, recompute: bool, even: bool) -> tuple[int, ...]:
    """Each GPU's share of a micro-batch of ``mbs``, GPUs in rank order: equal, or by speed."""
    gpus = [g for g in cm.cluster.groups for _ in range(g.size)]
    if even:
        return (mbs // len(gpus),) * len(gpus)
    return layer_speed_shares(cm, gpus, mbs, 0, cm.model.num_layers, recompute)


def dp_shape(cm: CostModel, shares: tuple[int, ...]) -> tuple[Replica, ...]:
    """The replicas of the stage over every GPU, in rank order, with these shares."""
    groups = cm.cluster.groups
    if len(groups) == 1 and len(set(shares)) == 1:
        return cm.slice_replicas(groups[0], groups[0].size, 0, sum(shares))
    return cm.gpu_replicas([(g, i) for g in groups for i in range(g.size)], shares)


def _whole_model_fits(cm: CostModel, optimizer: str = REPLICATED, gpus: int = 1) -> str:
    """Why the whole model's state (optimizer state kept ``optimizer`` over ``gpus``) cannot sit
    on some GPU (empty if it can)."""
    state = "optimizer state sharded over every GPU" if optimizer == SHARDED \
        else "optimizer state"
    for g in cm.cluster.groups:
        need = cm.static_bytes(0, cm.model.num_layers, optimizer, gpus, cm.tp_of(g))
        cap = cm.capacity_bytes(g)
        if need > cap:
            return (f"the whole model's weights, gradients and {state} need "
                    f"{need / 1e9:.1f} GB per GPU but a {g.gpu.name} of group {g.name!r} has "
                    f"{cap / 1e9:.1f} GB usable")
    return ""


def data_parallel(problem: SearchProblem, even: bool,
                  optimizers: tuple[str, ...] = (REPLICATED,)) -> DataParallel:
    """The fastest one-stage layout over every GPU of the problem's cluster, over every
    micro-batch size that gives each GPU at least one sample (equal shares: a multiple of the
    GPU count) and each optimizer state of ``optimizers``, replayed exactly."""
    cm, options = problem.cost_model, problem.options
    n = sum(g.size for g in cm.cluster.groups)
    states = [o for o in optimizers if o == REPLICATED or n > 1]
    fitting = [o for o in states if not _whole_model_fits(cm, o, n)]
    if not fitting:
        return DataParallel(None, None, _whole_model_fits(cm, states[-1] if states
                                                          else REPLICATED, n)
                            or "one GPU has no replica to shard the optimizer state with")
    sizes = [m for m in divisors(problem.global_batch_size) if m >= n and (not even or m % n == 0)
             and (options.micro_batch_sizes is None or m in options.micro_batch_sizes)]
    if not sizes:
        return DataParallel(None, None, f"no micro-batch size divides the global batch "
                            f"{problem.global_batch_size} and gives each of the {n} GPUs "
                            f"{'the same number of' if even else 'at least one'} sample(s)")
    best, reason = None, ""
    for mbs in sizes:
        m = problem.num_microbatches(mbs)
        for opt in fitting:
            for rc in ((False, True) if options.allow_recompute else (False,)):
                shape = dp_shape(cm, dp_shares(cm, mbs, rc, even))
                lay = Layout.build((shape,), ((0, cm.model.num_layers),), (rc,), mbs,
                                   hapt_warmups((shape,), [], 1.0, m, options.schedule),
                                   options.schedule, (opt,))
                try:
                    r = simulate_layout(cm, lay, m, exact=True)
                except CostModelError as e:  # groups the gradient ring cannot cross
                    return DataParallel(None, None, str(e))
                if r.feasible:
                    if best is None or r.iteration_s < best[1].iteration_s:
                        best = (lay, r)
                    break
                reason = reason or r.reason
    if best is None:
        return DataParallel(None, None, f"no micro-batch size fits every GPU: {reason}")
    return DataParallel(best[0], best[1])


