"""A lower bound on the iteration time of every plan of a job, tensor-parallel degrees included.

    python3 benchmarks/tp_bound.py SCENARIO [--target S] [--grid N] [--rounds R] [--what-if]

No plan the planner can return for the job (any group order, any number of stages, any stage
widths, tensor-parallel degree, sequence parallelism, recompute of all or the first blocks of a
stage, replicated or sharded optimizer state, micro-batch size, layer partition, whole blocks
or halves, H-1F1B or zero_bubble warm-ups and deferrals; stages that mix groups or give their
replicas uneven shares) replays faster than :func:`tp_lower_bound_s`. The planner's
``interleaved`` kind (a pipeline rank holding several stages) is left out: see *Scope*.

**What any replay obeys** (the event simulator's rules, ``hapt_hf/planner/simulate.py``). Take
a plan of ``M`` micro-batches of ``mbs`` samples replayed in ``T`` seconds. Stage ``s`` runs on
``w_s`` replicas of ``t_s`` GPUs of one group, each replica computing ``n_s = mbs / w_s``
samples; ``c_s = f_s + b_s`` is its compute per micro-batch (its forward, backward with any
recomputed forward, and sequence parallelism's all-gathers, from the cost model's tables).

1. *Compute.* A stage runs its ``2M`` (or ``3M``, split) compute actions one after another, so
   it is busy ``M c_s <= T``; write ``u_s = M c_s / T``, the share of the iteration it computes.
   Its GPUs number ``w_s t_s = gbs t_s c_s / (n_s u_s T)``.
2. *GPUs.* A group's stages use at most its ``N_g`` GPUs. For any prices ``lambda_g >= 0``,
   ``sum_s lambda_{g_s} w_s t_s <= sum_g lambda_g N_g``, hence
   ``T >= sum_s lambda_{g_s} gbs t_s c_s / (n_s u_s) / sum_g lambda_g N_g``.
3. *Memory slots.* A micro-batch holds its activations on stage ``s`` from the start of its
   forward to the end of its backward (the end of its weight gradient ``W`` where split): at
   least ``c_s`` plus, on every later stage ``j``, its forward and input gradient, which a
   replay can only run one after another along the pipeline. Where ``q_s`` micro-batches at
   most are held at once, the held count averaged over ``[0, T]`` is at most ``q_s``, so
   ``q_s >= u_s + sum_{j>s} rho u_j``, where ``rho`` is the least share of a stage's busy time
   that its forwards and input gradients take (``1 - share / (1 + min f/b)`` over every
   layer, degree and micro-batch, the split's weight-gradient share; 1 under H-1F1B, which is
   never less). ``q_s`` is a whole number, and the stage's GPU must hold its weights and
   state, its working set, the step's weight copies and ``q_s`` micro-batches' activations
   (``StageCost.memory_use``), or the replay is infeasible.

**The relaxations** (each can only lower the bound):

* the stage's start (the first micro-batch's forwards before it), the cuts between stages,
  the exposed gradient all-reduce, the optimizer step and the all-gather of a sharded state,
  every per-action and per-transfer overhead a profile measures are left out;
* ``ceil(M / q_s)`` round trips are counted as ``M / q_s``;
* ``w_s`` is any positive number (not a whole number of replicas, not a divisor of the
  micro-batch), and the optimizer state's bytes per parameter are the least any width of the
  group allows (sharded over all of its replicas of that degree, or replicated);
* a stage's replicas may sit anywhere in the group (one node each is not asked);
* per-sample compute at ``n`` samples is taken at the next power of two (never less than the
  tables' time at ``n``: the analytic time of ``n`` samples is linear in ``n`` plus a fixed
  latency per collective), memory at the power of two below it; recompute of the first ``r``
  blocks likewise at the grid's value below (compute) and above (memory) ``r``;
* a stage that mixes groups or gives uneven shares costs at least its cheapest kind of
  replica priced alone at the stage's share ``u`` of the iteration, and each of its kinds
  meets the memory rule on its own: it is bounded as that kind alone;
* the group prices ``lambda`` are any: the best found by a few subgradient rounds is kept
  (every round's value is a bound; the largest is reported);
* loads and shares ``u`` are rounded on a grid of ``1 / grid`` in the direction that lowers the
  bound (a share in ``((k - 1) / grid, k / grid]`` pays ``c / (k / grid)`` and adds
  ``rho (k - 1) / grid`` of load).

What is left is a shortest path over the layer boundaries from the last layer to the first:
a state is ``(boundary, load after it)``, a step a stage of layers ``[a, b)`` on one group's
replicas at one degree and share ``u``, allowed where its memory holds ``ceil(load + u)``
micro-batches, costing ``lambda_g gbs t c / (n u)`` and adding ``rho u`` to the load. The bound
is the path's cost over ``sum_g lambda_g N_g``, the least over whole-block and half-block
layer sequences (the planner searches both).

**Scope.** Under ``interleaved`` a pipeline rank holds several stages and their memory adds
up on one GPU, which this path does not price; such plans are not bounded here (on the
scenarios of this repository the planner's interleaved replays do not fit or are slower).
The bound reads the cost model's tables as they are: profiles whose per-sample times grow
with the micro-batch would break the rounding of ``n``, so a job with a profile is refused.

With ``--what-if`` it also prints the bound with the tensor-parallel collectives (the
blocks' all-reduces, sequence parallelism's all-gathers, the split head's collectives) taken
out of the compute: what hiding them behind compute would allow at most. That is a what-if of
this script, not a cost the cost model prices.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hapt_hf.core.precision import REPLICATED, SHARDED, state_bytes_per_param  # noqa: E402
from hapt_hf.core.tp import TP_DEGREES  # noqa: E402
from hapt_hf.errors import PlanningError  # noqa: E402
from hapt_hf.planner.cluster import Cluster, GpuGroup  # noqa: E402
from hapt_hf.planner.cost_model import CostModel, tp_unfit  # noqa: E402
from hapt_hf.planner.model_spec import ModelSpec  # noqa: E402
from hapt_hf.planner.simulate import WEIGHT_GRADIENT_SHARE  # noqa: E402

__all__ = ["TpBound", "StageMenu", "stage_menu", "rho_floor", "path_bound", "tp_lower_bound_s",
           "main"]


@dataclass(frozen=True)
class TpBound:
    """A lower bound and how it was reached."""

    bound_s: float
    """No plan in scope replays faster."""
    layer_unit: str
    """The layer sequence ('block' or 'half') whose path gave the bound (the lower of the two)."""
    prices: tuple[tuple[str, float], ...]
    """The group prices lambda that gave it (normalised to sum 1)."""
    rho: float
    stages: tuple[tuple[str, int, int, int, float, int], ...]
    """The cheapest path at those prices, first stage first: (group, degree, first layer,
    end layer, share u of the iteration, micro-batches its memory must hold)."""
    gpus: tuple[tuple[str, float], ...]
    """GPUs of each group that path uses at ``bound_s`` (above a group's size where the prices
    could not balance it: the bound is then below what a plan needs)."""
    micro_batch_size: int = 0
    """The micro-batch size whose bound is the least."""


@dataclass(frozen=True)
class StageMenu:
    """For one layer sequence: per group, per number of micro-batches ``q`` a stage holds, the
    least ``gbs t c / n`` (GPU-seconds of the iteration at ``u = 1``, times ``T``) of a stage of
    layers ``[a, b)`` whose memory holds ``q`` micro-batches, and the degree that gives it."""

    groups: tuple[GpuGroup, ...]
    cost: np.ndarray
    """Shape (groups, q_cap + 1, L + 1, L + 1): ``cost[g, q, a, b]``, inf where nothing fits."""
    degree: np.ndarray
    """The same shape: the degree of the cheapest option."""
    num_layers: int
    layer_unit: str
    per_sample: np.ndarray | None = None
    """The same shape: the least ``gbs c / n`` (the stage's busy seconds on one replica) of
    any option holding ``q`` micro-batches, whatever its cost."""
    back_share: np.ndarray | None = None
    """Shape (L + 1, L + 1): the least share of a stage's compute that is its backward, over
    every option of layers ``[a, b)``."""
    forward_one: np.ndarray | None = None
    """Shape (groups, L + 1, L + 1): the least forward seconds of one sample through layers
    ``[a, b)`` on a replica of the group that fits them."""


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _recompute_grid(L: int) -> list[int]:
    """Recompute units weighed exactly (0 = none); between two, the lower's compute and the
    upper's memory."""
    grid = list(range(0, min(L, 16) + 1))
    r = 16
    while r < L:
        r = min(L, r + max(2, r // 8))
        grid.append(r)
    return grid


def _layer_times(cm: CostModel, g: GpuGroup, n: int, t: int, hide_tp: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer (forward, backward, recomputed block forward) of a replica of ``t`` GPUs of
    ``g`` computing ``n`` samples; with ``hide_tp`` the tensor-parallel collectives left out."""
    tab = cm.table(g, n, t)
    f = np.diff(np.asarray(tab.fwd))
    b = np.diff(np.asarray(tab.bwd))
    rf = np.diff(np.asarray(tab.block_fwd))
    if hide_tp and t > 1:
        L = cm.model.num_layers
        ar = np.array([cm.tp_allreduce_s(g, n, t, j) for j in range(L)])
        blocks = np.array([l.kind == "block" for l in cm.model.layers])
        f = f - np.where(blocks, ar, 0.0)
        b = b - np.where(blocks, ar, 0.0)
        rf = rf - np.where(blocks, ar, 0.0)
        last = cm.model.layers[-1]
        if last.kind == "head" and tab.fwd[-1] - tab.fwd[-2] > 0:
            from hapt_hf.planner.cost_model import head_split
            if head_split(cm.model, t):
                hf, hb = cm.head_comm_s(g, n, t)
                f[-1] -= hf
                b[-1] -= hb
    return np.maximum(f, 0.0), np.maximum(b, 0.0), np.maximum(rf, 0.0)


def _sp_terms(cm: CostModel, g: GpuGroup, n: int, t: int, hide_tp: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    """Sequence parallelism's (edge all-gather where a stage holds a block, per-layer
    regather) for one replica; zeros under ``hide_tp``."""
    L = cm.model.num_layers
    if hide_tp:
        return np.zeros((L + 1, L + 1)), np.zeros(L)
    regather = np.array([cm.sp_regather_s(g, n, t, j, j + 1) for j in range(L)])
    # the all-gather of the output of the stage's last block (sp_edge_s)
    gather = np.array([cm.sp_edge_s(g, n, t, j, j + 1) for j in range(L)])
    last = np.full(L + 1, -1)
    for b in range(1, L + 1):
        last[b] = b - 1 if cm.model.layers[b - 1].kind == "block" else last[b - 1]
    A = np.arange(L + 1)[:, None]
    lb = last[None, :]
    edge = np.where((lb >= A) & (A < np.arange(L + 1)[None, :]), gather[np.maximum(lb, 0)], 0.0)
    return edge, regather


def rho_floor(cm: CostModel, gbs: int, hide_tp: bool = False) -> float:
    """The least share of a stage's busy time its forwards and input gradients take, over
    every layer, group, degree, sequence parallelism and per-replica batch (see the module's
    docstring): ``1 - share / (1 + min f / b)``."""
    if cm.profile is not None:
        raise PlanningError("tp_bound reads the analytic tables only; this job has a profile")
    ratio = 1.0
    for g in cm.hardware.groups:
        for t in _degrees(cm, g):
            for n in _pow2_upto(gbs):
                f, b, _ = _layer_times(cm, g, n, t, hide_tp)
                extra = np.zeros_like(b)
                if t > 1 and cm.sp_allowed(t):
                    extra = _sp_terms(cm, g, n, t, hide_tp)[1]
                ok = b > 0
                if ok.any():
                    ratio = min(ratio, float(np.min(f[ok] / (b[ok] + extra[ok]))))
    return 1.0 - WEIGHT_GRADIENT_SHARE / (1.0 + ratio)


def beta_floor(cm: CostModel, gbs: int, hide_tp: bool = False) -> float:
    """The least share of a stage's compute that is its backward, over every layer, group,
    degree and per-replica batch: ``1 / (1 + max f / b)`` (sequence parallelism's edge
    all-gathers add as much to both)."""
    ratio = 0.0
    for g in cm.hardware.groups:
        for t in _degrees(cm, g):
            for n in _pow2_upto(gbs):
                f, b, _ = _layer_times(cm, g, n, t, hide_tp)
                if t > 1 and cm.sp_allowed(t) and not hide_tp:
                    # a stage's one edge all-gather, forward and backward, charged to a block
                    e = np.array([cm.sp_edge_s(g, n, t, j, j + 1) for j in range(len(f))])
                    f, b = f + e, b + e
                ok = b > 0
                if ok.any():
                    ratio = max(ratio, float(np.max(f[ok] / b[ok])))
    return 1.0 / (1.0 + ratio)


def _degrees(cm: CostModel, g: GpuGroup) -> list[int]:
    return [t for t in TP_DEGREES if t <= g.gpus_per_node and g.gpus_per_node % t == 0
            and tp_unfit(cm.model, t) is None]


def stage_menu(cm: CostModel, gbs: int, q_cap: int, hide_tp: bool = False,
               mbs: int | None = None) -> StageMenu:
    """Every stage option of the model's layer sequence, reduced to the cheapest per
    (group, micro-batches held, layers); see :class:`StageMenu`. With ``mbs``, only
    replicas of at most ``mbs`` samples."""
    if cm.profile is not None:
        raise PlanningError("tp_bound reads the analytic tables only; this job has a profile")
    model = cm.model
    L = model.num_layers
    groups = cm.hardware.groups
    A = np.arange(L + 1)[:, None]
    B = np.arange(L + 1)[None, :]
    valid = A < B
    A2, B2 = np.broadcast_arrays(A, B)
    cost = np.full((len(groups), q_cap + 1, L + 1, L + 1), np.inf)
    degree = np.zeros(cost.shape, dtype=np.int8)
    tau = np.full(cost.shape, np.inf)
    back = np.ones((L + 1, L + 1))
    first_f = np.full((len(groups), L + 1, L + 1), np.inf)
    rgrid = _recompute_grid(L)
    for gi, g in enumerate(groups):
        cap = cm.capacity_bytes(g)
        degs = _degrees(cm, g)
        exact = np.full((len(degs), q_cap + 1, L + 1, L + 1), np.inf)
        fast = np.full((q_cap + 1, L + 1, L + 1), np.inf)
        for ti, t in enumerate(degs):
            reps = g.size // t
            spb = min(state_bytes_per_param(REPLICATED, reps),
                      state_bytes_per_param(SHARDED, reps) if reps > 1 else math.inf)
            params = np.asarray(cm.shard(t).params)
            static = (params[B] - params[A]) * spb
            fixed = np.asarray(cm.shard(t).fixed)
            fixed_rc = np.asarray(cm.shard(t).fixed_rc)
            for sp in ([False, True] if cm.sp_allowed(t) else [False]):
                sh = cm.shard(t, sp)
                keep, keep_rc = np.asarray(sh.keep), np.asarray(sh.keep_rc)
                kmax = np.zeros((L + 1, L + 1))
                for a in range(L):
                    kmax[a, a + 1:] = sh.keep_max[a]
                pows = _pow2_upto(gbs)
                for i, n in enumerate(pows):
                    if mbs is not None and n > mbs:
                        break
                    n_cost = pows[min(i + 1, len(pows) - 1)]
                    f, b, rf = _layer_times(cm, g, n_cost, t, hide_tp)
                    F, Bw, RF = (np.concatenate([[0.0], np.cumsum(x)]) for x in (f, b, rf))
                    if sp:
                        edge, rg = _sp_terms(cm, g, n_cost, t, hide_tp)
                        RG = np.concatenate([[0.0], np.cumsum(rg)])
                    room0 = cap - static - n * kmax
                    if not np.any(valid & (room0 > 0)):
                        break  # a larger batch only needs more
                    for ri, r in enumerate(rgrid):
                        r_mem = rgrid[ri + 1] - 1 if ri + 1 < len(rgrid) else r
                        e_c = A if r == 0 else np.minimum(np.maximum(A, 1) + r, B)
                        e_m = A if r_mem == 0 else np.minimum(np.maximum(A, 1) + r_mem, B)
                        c = (F[B] - F[A]) + (Bw[B] - Bw[A]) + (RF[e_c] - RF[A])
                        if sp:
                            # the edge forward and backward; the regather where not recomputed
                            c = c + 2 * edge + (RG[B] - RG[e_c])
                        copies = fixed_rc[e_m] - fixed_rc[A] + fixed[B] - fixed[e_m]
                        act = n * (keep_rc[e_m] - keep_rc[A] + keep[B] - keep[e_m])
                        room = room0 - copies
                        with np.errstate(divide="ignore", invalid="ignore"):
                            q = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)),
                                         q_cap)
                        q = np.where(valid & (room >= 0), np.minimum(q, q_cap), 0).astype(int)
                        unit = gbs * t * c / n_cost
                        with np.errstate(divide="ignore", invalid="ignore"):
                            share_b = np.where(c > 0, (c - (F[B] - F[A]) - (
                                2 * edge if sp else 0.0) / 2) / np.where(c > 0, c, 1.0), 1.0)
                        back = np.minimum(back, np.where(valid, share_b, 1.0))
                        ok = q >= 1
                        if not ok.any():
                            continue
                        np.minimum.at(exact[ti], (q[ok], A2[ok], B2[ok]), unit[ok])
                        np.minimum.at(fast, (q[ok], A2[ok], B2[ok]), unit[ok] / t)
                        if n == 1:  # one sample's forward: no replica's is shorter
                            f1, _, _ = _layer_times(cm, g, 1, t, hide_tp)
                            F1 = np.concatenate([[0.0], np.cumsum(f1)])
                            fw = F1[B] - F1[A]
                            if sp:
                                fw = fw + _sp_terms(cm, g, 1, t, hide_tp)[0]
                            first_f[gi] = np.where(ok, np.minimum(first_f[gi], fw), first_f[gi])
        # holding q or more: the least over every level from q up
        exact = np.minimum.accumulate(exact[:, ::-1], axis=1)[:, ::-1]
        pick = exact.argmin(axis=0)
        cost[gi] = np.take_along_axis(exact, pick[None], axis=0)[0]
        degree[gi] = np.asarray(degs, dtype=np.int8)[pick]
        tau[gi] = np.minimum.accumulate(fast[::-1], axis=0)[::-1]
    return StageMenu(groups, cost, degree, L, model.layer_unit, tau, back, first_f)


def path_bound(menu: StageMenu, prices: np.ndarray, sizes: np.ndarray, rho: float, grid: int,
               d_max: float, beta: float = 0.0, mbs_share: float = 0.0,
               u_floor: float = 0.0) -> tuple[float, list]:
    """The shortest path of the module's docstring at group prices ``prices``: the bound in
    seconds and the path (group index, degree, a, b, share u, micro-batches held), first stage
    first. With a micro-batch of ``mbs_share`` of the global batch and a target ``T``:
    ``beta u + load * mbs_share <= 1`` (the backward window) and ``u >= per_sample * u_floor``
    (``u_floor = 1 / (mbs T)``: at most ``mbs`` replicas)."""
    L = menu.num_layers
    q_cap = menu.cost.shape[1] - 1
    with np.errstate(invalid="ignore"):  # inf times a price of 0
        priced = menu.cost * prices[:, None, None, None]
    priced[~np.isfinite(menu.cost)] = np.inf  # a price of 0 keeps nothing-fits out
    h = 1.0 / grid
    nd = int(round(d_max * grid))
    i = np.arange(nd + 1)[:, None]
    k = np.arange(1, grid + 1)[None, :]
    # a share in ((k-1)h, kh]: its cost at kh, its load and its memory need at (k-1)h
    # (level q_cap holds every option holding q_cap or more: above it, the lenient side)
    q_need = np.minimum(np.floor((i + k - 1) * h).astype(int) + 1, q_cap)
    nxt = np.minimum(np.floor(i + rho * (k - 1) + 1e-9).astype(int), nd)
    inv_u = 1.0 / (k * h)
    kh = np.broadcast_to(k * h, q_need.shape)
    load = np.broadcast_to(i * h * mbs_share, q_need.shape)
    back = menu.back_share if menu.back_share is not None else np.zeros((L + 1, L + 1))
    back = np.maximum(back, beta)
    floors = None
    if u_floor > 0 and menu.per_sample is not None:
        floors = menu.per_sample * u_floor   # (g, q, a, b): the least share with <= mbs replicas
    G_cols = len(menu.groups)
    G = np.full((L + 1, nd + 1), np.inf)
    G[0] = 0.0
    choice_a = np.zeros((L + 1, nd + 1), dtype=int)
    choice_k = np.zeros((L + 1, nd + 1), dtype=int)
    choice_g = np.zeros((L + 1, nd + 1), dtype=int)
    G_next = [None] * (L + 1)
    G_next[0] = G[0][nxt]
    for b in range(1, L + 1):
        row = np.full(nd + 1, np.inf)
        ra = np.zeros(nd + 1, dtype=int)
        rk = np.zeros(nd + 1, dtype=int)
        rg = np.zeros(nd + 1, dtype=int)
        for a in range(b):
            if not np.isfinite(priced[:, 1, a, b]).any():
                continue
            # the backward window, at the bin's least share and the state's least load
            shut = back[a, b] * (kh - h) + load > 1.0 + 1e-12
            for gi in range(G_cols):
                col = priced[gi, :, a, b]
                if not np.isfinite(col[1]):
                    continue
                cand = col[q_need] * inv_u + G_next[a]
                cand[shut] = np.inf
                if floors is not None:
                    cand[kh < floors[gi, :, a, b][q_need]] = np.inf
                kk = cand.argmin(axis=1)
                v = cand[np.arange(nd + 1), kk]
                upd = v < row
                row[upd] = v[upd]
                ra[upd] = a
                rk[upd] = kk[upd]
                rg[upd] = gi
        G[b] = row
        choice_a[b], choice_k[b], choice_g[b] = ra, rk, rg
        G_next[b] = row[nxt]
    total = G[L, 0]
    path = []
    b, s = L, 0
    while b > 0 and np.isfinite(total):
        a, kk = choice_a[b, s], choice_k[b, s]
        q = min(q_need[s, kk], q_cap)
        gi = int(choice_g[b, s])
        path.append((gi, int(menu.degree[gi, q, a, b]), int(a), int(b), float((kk + 1) * h),
                     int(q)))
        b, s = a, nxt[s, kk]
    path.reverse()
    return float(total / float(prices @ sizes)), path


def start_path_bound(menu: StageMenu, prices: np.ndarray, sizes: np.ndarray, T: float,
                     mbs: int, steps: int = 128, s_max: float = 0.5) -> tuple[float, list]:
    """The second relaxation, a path from the first layer to the last: a stage starts no
    earlier than one sample's forward through the stages before it (``start``, in shares of
    ``T`` on a grid of ``1 / steps``, rounded down), so its share ``u <= 1 - start`` and it
    costs at least ``lambda_g gbs t c / n / (1 - start)``; memory only asks it to hold one
    micro-batch, and no more than ``mbs`` replicas (``u >= per_sample / (mbs T)``). Returns
    the bound at ``T`` (feasible where it is at most ``T``) and the path as
    :func:`path_bound` gives it."""
    L = menu.num_layers
    with np.errstate(invalid="ignore"):
        priced = menu.cost[:, 1] * prices[:, None, None]
    priced[~np.isfinite(menu.cost[:, 1])] = np.inf
    ns = int(round(s_max * steps))
    S = np.arange(ns + 1) / steps
    room = 1.0 - S                      # the most share a stage starting there can take
    H = np.full((L + 1, ns + 1), np.inf)
    H[0, 0] = 0.0
    back_a = np.zeros((L + 1, ns + 1), dtype=int)
    back_g = np.zeros((L + 1, ns + 1), dtype=int)
    back_i = np.zeros((L + 1, ns + 1), dtype=int)
    floors = menu.per_sample[:, 1] / (mbs * T) if menu.per_sample is not None else None
    for b in range(1, L + 1):
        for a in range(b):
            src = H[a]
            if not np.isfinite(src).any():
                continue
            for gi in range(len(menu.groups)):
                c = priced[gi, a, b]
                if not np.isfinite(c):
                    continue
                shift = int(math.floor(menu.forward_one[gi, a, b] / T * steps + 1e-9))
                ok = room > 0
                if floors is not None:
                    ok &= room >= floors[gi, a, b]
                cand = np.where(ok, src + c / np.where(ok, room, 1.0), np.inf)
                free = ns - shift             # sources below it land on a state of their own
                if free > 0:
                    better = cand[:free] < H[b, shift:ns]
                    tgt = np.nonzero(better)[0]
                    H[b, tgt + shift] = cand[tgt]
                    back_a[b, tgt + shift], back_g[b, tgt + shift] = a, gi
                    back_i[b, tgt + shift] = tgt
                top = max(free, 0)              # the rest land on the clamped top: the least
                i = top + int(np.argmin(cand[top:]))
                if cand[i] < H[b, ns]:
                    H[b, ns] = cand[i]
                    back_a[b, ns], back_g[b, ns], back_i[b, ns] = a, gi, i
    end = int(np.argmin(H[L]))
    total = H[L, end]
    path = []
    b, j = L, end
    while b > 0 and np.isfinite(total):
        a, gi, i = back_a[b, j], back_g[b, j], back_i[b, j]
        path.append((int(gi), int(menu.degree[gi, 1, a, b]), int(a), int(b),
                     float(room[i]), 1))
        b, j = a, i
    path.reverse()
    return float(total / float(prices @ sizes)), path


def _path_use(menu: StageMenu, path) -> np.ndarray:
    """Per group, the path's ``gbs t c / (n u)`` summed: its GPUs there times ``T``."""
    use = np.zeros(len(menu.groups))
    for gi, _t, a, b, u, q in path:
        use[gi] += menu.cost[gi, q, a, b] / u
    return use


def best_prices(uses: list[np.ndarray], sizes: np.ndarray) -> tuple[np.ndarray, float]:
    """The prices ``lambda >= 0`` (``lambda . sizes = 1``) that maximise the least
    ``lambda . use`` over the paths found so far, by enumerating the vertices of that small
    linear program; and that value (what a mix of those paths needs at least)."""
    G = len(sizes)
    U = np.asarray(uses)
    # constraints a . (lambda, z) <= 0: z - lambda . U_p <= 0, and -lambda_g <= 0
    rows = [np.concatenate([-u, [1.0]]) for u in U] + \
        [np.concatenate([-np.eye(G)[g], [0.0]]) for g in range(G)]
    rows = np.asarray(rows)
    eq = np.concatenate([sizes, [0.0]])
    best, arg = -np.inf, None
    for pick in itertools.combinations(range(len(rows)), G):
        M = np.vstack([rows[list(pick)], eq])
        rhs = np.zeros(G + 1)
        rhs[-1] = 1.0
        try:
            x = np.linalg.solve(M, rhs)
        except np.linalg.LinAlgError:
            continue
        if np.all(rows @ x <= 1e-9 * max(1.0, abs(x[-1]))) and x[-1] > best:
            best, arg = x[-1], x[:G]
    return np.maximum(arg, 0.0), float(best)


def _prices_round(solve, menu: StageMenu, sizes: np.ndarray, speed: np.ndarray, rounds: int,
                  target: float | None, log=None) -> tuple[float, np.ndarray, list, np.ndarray]:
    """Column generation over the group prices: the best bound of up to ``rounds`` prices,
    each round's prices those that best separate the paths found so far. With ``target``,
    stops once the bound passes it or the paths' mix shows it cannot."""
    prices = speed / (speed @ sizes)
    best, uses = None, []
    for rnd in range(rounds):
        val, path = solve(prices)
        if not path:  # no path at all: nothing fits these constraints
            return math.inf, prices, [], np.zeros(len(sizes))
        use = _path_use(menu, path)
        uses.append(use)
        if best is None or val > best[0]:
            best = (val, prices.copy(), path, use)
        prices, mix = best_prices(uses, sizes)
        if log:
            log(f"    round {rnd}: {val:.3f} s (best {best[0]:.3f}, the paths' mix needs "
                f"{mix:.3f})")
        if mix <= best[0] * (1 + 1e-4):
            break
        if target is not None and (best[0] > target or mix <= target):
            break
    return best


def tp_lower_bound_s(model: ModelSpec, cluster: Cluster, global_batch_size: int,
                     grid: int = 16, rounds: int = 10, d_max: float = 32.0,
                     hide_tp: bool = False, target: float | None = None, hi: float = math.inf,
                     steps: int = 7, log=None) -> TpBound:
    """The lower bound of the module's docstring: the least over the whole-block and
    half-block layer sequences and every micro-batch size of the least ``T`` no plan below
    which passes the path's test (bisection between the physical limit and ``hi`` in
    ``steps`` halvings: the lower end of the last interval); with ``target``, only whether
    ``target`` passes (the bound is then ``target`` where no micro-batch size passes it)."""
    from hapt_hf.planner.search import divisors
    gbs = global_batch_size
    models = [model] + ([model.split_blocks()] if model.can_split_blocks else [])
    sizes = np.array([g.size for g in cluster.groups], dtype=float)
    out = None
    for m in models:
        cm = CostModel(m, cluster)
        rho, beta = rho_floor(cm, gbs, hide_tp), beta_floor(cm, gbs, hide_tp)
        speed = np.array([1.0 / cm.sample_time_s(g, 1) for g in cluster.groups])
        limit = gbs / float(speed @ sizes)
        q_cap = int(math.ceil(d_max)) + 1
        for mbs in divisors(gbs):
            c0 = time.process_time()
            menu = stage_menu(cm, gbs, q_cap, hide_tp, mbs)

            def passes(T: float, menu=menu, speed=speed, rho=rho, beta=beta, mbs=mbs):
                """Whether both relaxations let a plan of ``mbs`` reach ``T``: the slots
                path's best (the bound the module describes), or the start path's where
                that one rules ``T`` out."""
                def slots(lam, menu=menu, rho=rho, beta=beta, mbs=mbs, T=T):
                    return path_bound(menu, lam, sizes, rho, grid, d_max, beta=beta,
                                      mbs_share=mbs / gbs, u_floor=1.0 / (mbs * T))

                def starts(lam, menu=menu, mbs=mbs, T=T):
                    return start_path_bound(menu, lam, sizes, T, mbs)

                got = _prices_round(slots, menu, sizes, speed, rounds, T)
                if got[0] > T:
                    return False, got
                other = _prices_round(starts, menu, sizes, speed, rounds, T)
                if other[0] > T:
                    return False, other
                return True, (got if got[0] >= other[0] else other)

            if target is not None:
                ok, got = passes(target)
                val = target if not ok else got[0]
            else:
                lo, top = limit, hi
                ok, got = passes(top) if math.isfinite(top) else (True, None)
                if not ok:
                    lo = top
                for _ in range(steps if ok else 0):
                    mid = 0.5 * (lo + top)
                    ok_mid, got_mid = passes(mid)
                    if ok_mid:
                        top, got = mid, got_mid
                    else:
                        lo = mid
                val = lo
            if log:
                log(f"  {m.layer_unit} units, micro-batch {mbs}: bound {val:.3f} s "
                    f"({time.process_time() - c0:.1f} s CPU, rho {rho:.4f}, beta {beta:.4f})")
            if got is None or not got[2]:
                continue
            if out is None or val < out.bound_s:
                v, pr, path, use = got
                out = TpBound(val, m.layer_unit,
                              tuple((g.name, float(p)) for g, p in zip(cluster.groups, pr)),
                              rho, tuple((cluster.groups[gi].name, t, a, b, u, q)
                                         for gi, t, a, b, u, q in path),
                              tuple((g.name, float(x / max(val, 1e-12)))
                                    for g, x in zip(cluster.groups, use)), mbs)
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.inputs import scenario_path
    from hapt_hf.planner.job import load_job
    from hapt_hf.planner.search import SearchProblem, physical_limit_s

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", help="a scenario name of benchmarks/scenarios (no .yaml)")
    ap.add_argument("--target", type=float, default=None,
                    help="seconds to test (default: 20%% above the physical limit)")
    ap.add_argument("--grid", type=int, default=8, help="shares and loads in steps of 1/grid")
    ap.add_argument("--rounds", type=int, default=10, help="price rounds per test")
    ap.add_argument("--what-if", action="store_true",
                    help="also with the tensor-parallel collectives hidden")
    args = ap.parse_args(argv)
    job = load_job(scenario_path(args.scenario))
    gbs = job.global_batch_size
    limit = physical_limit_s(SearchProblem.build(job.model, job.cluster, gbs, job.profile))
    target = args.target if args.target is not None else 1.2 * limit
    print(f"{args.scenario}: physical limit {limit:.3f} s; testing {target:.3f} s "
          f"({target / limit - 1:+.1%})")
    for hide in (False, True) if args.what_if else (False,):
        if hide:
            print("\nwhat-if: the tensor-parallel collectives hidden")
        c0 = time.process_time()
        got = tp_lower_bound_s(job.model, job.cluster, gbs, args.grid, args.rounds,
                               hide_tp=hide, target=target, log=print)
        verdict = ("no plan in scope reaches it: a certificate" if got.bound_s >= target
                   else "not ruled out")
        print(f"least over micro-batch sizes and layer units: {got.bound_s:.3f} s "
              f"({got.bound_s / limit - 1:+.2%} above the limit), micro-batch "
              f"{got.micro_batch_size}, {got.layer_unit} units: {target:.3f} s {verdict} "
              f"({time.process_time() - c0:.1f} s CPU)")
        print(f"its cheapest path ({len(got.stages)} stages; group, degree, layers, share u, "
              f"micro-batches held):")
        for g, t, a, b, u, q in got.stages:
            print(f"    {g} t={t} [{a}, {b}) u={u:.3f} q={q}")
        print("GPUs it uses: " + ", ".join(f"{g} {x:.1f}" for g, x in got.gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
