"""A lower bound on the iteration time of every plan of a job, tensor-parallel degrees included.

    python3 benchmarks/tp_bound.py SCENARIO [--target S] [--grid N] [--steps K] [--one-path]
                                   [--what-if] [--no-interleaved]

Tests whether any plan the planner can return for the job could replay in ``--target`` seconds
(default: 20% above the physical limit) or less, for every micro-batch size and both layer
sequences (whole blocks, halves), and bisects below the target where it is not ruled out. The
plans covered: any group order, number of stages, stage widths, tensor-parallel degree per
stage, sequence parallelism, recompute of all or the first blocks of a stage, replicated or
sharded optimizer state, layer partition, H-1F1B or zero_bubble warm-ups and deferrals, stages
that mix groups or give their replicas uneven shares; and, by rule 6 on its own, every
``interleaved`` plan of two chunks a rank or more.

**What every replay obeys** (the rules of ``hapt_hf/planner/simulate.py``). A plan of ``M``
micro-batches of ``mbs`` samples replays in ``T`` seconds. Stage ``s`` runs on ``w_s`` replicas
of ``t_s`` GPUs of one group; its largest replica computes ``n_s`` samples of each
micro-batch, so ``w_s >= mbs / n_s``; ``c_s`` is that replica's compute per micro-batch (its
forward, its backward with any recomputed forward, sequence parallelism's all-gathers: the
cost model's tables at ``n_s`` samples).

1. *Compute.* A stage runs its compute actions one after another: it is busy at least
   ``M c_s``, its *share* ``u_s = M c_s / T <= 1``, and it takes ``w_s t_s >= t_s mbs / n_s``
   GPUs.
2. *GPUs.* A group's stages take at most its ``N_g`` GPUs. For any prices ``lambda_g >= 0``,
   ``sum_s lambda_{g_s} t_s ceil(mbs / n_s) <= sum_g lambda_g N_g`` (every replica computes
   at least one sample: ``Stage.validate``).
3. *Memory slots.* A micro-batch holds its activations on stage ``s`` from the start of its
   forward to the end of its backward (of its weight gradient where split): at least ``c_s``
   plus its forward and input gradient on every later stage, one after another. With at most
   ``q_s`` held at once, averaging the held count over ``[0, T]`` gives
   ``q_s >= u_s + sum_{j>s} rho u_j`` (the *load*), ``rho`` the least share of a stage's
   compute that is its forward and input gradient (``1 - share / (1 + min f / b)`` over every
   layer, degree and batch, ``share`` the split's weight-gradient part; H-1F1B holds longer).
   ``q_s`` is whole, and the stage's GPU must hold its weights and state, its working set,
   the step's weight copies and ``q_s`` micro-batches of ``n_s`` samples
   (``StageCost.memory_use``), or the replay is infeasible. A sharded optimizer state is split
   over the stage's replicas, at most ``mbs - n_s + 1`` of them (each computes a sample).
4. *Backward window.* Every backward of stage ``s`` waits for the first micro-batch's forward
   and input gradient through the later stages, ``sum_{j>s} rho c_j``, which is the load after
   ``s`` times ``T / M``: ``beta_s u_s + load * mbs / gbs <= 1``, ``beta_s`` the least share
   of the stage's compute that is its backward (over the options of its layers).

5. *Warm-up chain* (every kind but ``interleaved``: each stage's list is 1F1B's shape with
   warm-up ``w_s``, forward ``F_j`` right after the backward or input gradient of
   ``j - w_s``, and under ``zero_bubble`` that one's ``W`` deferred by ``d_s``). With
   ``delta = w_s - w_{s+1} + 1`` (at least 1, else the lists deadlock), the input gradient
   ``I_k`` on ``s`` waits for ``I_{k - delta}`` on ``s``, then ``F_{k - delta + w_s}`` on
   ``s`` and on ``s + 1``, then ``I_k`` on ``s + 1``: a chain of ``(f + i)_s + (f + i)_{s+1}``
   per ``delta`` micro-batches, for ``k`` up to ``M - w_{s+1}``; so ``rho (u_s + u_{s+1})
   floor((M - w_{s+1}) / delta) <= M``. Where the stage defers at most ``D``
   (:data:`CHAIN_DEFERRAL`) weight gradients, the ``W`` after ``I_{k - delta}`` joins the
   chain: ``(u_s + rho u_{s+1}) floor((M - w_{s+1} - D) / delta) <= M`` (1F1B's shape, whose
   backward is whole, obeys it too); a stage that defers more holds ``D + 1`` more
   micro-batches. The stage holds its ``w_s`` warm-up micro-batches. Where the shares are near
   1, ``delta >= 2``: each stage's warm-up one deeper than the next one's, as in 1F1B
   (``tests/planner/test_tp_bound.py`` checks the chain on replays of unlike stages).

A plan's stages, last first, are then a path over the layer boundaries whose state is the load
after a boundary (rules 1 to 4; or, with rule 5 in place of 3 and 4, the warm-up and share bin
of the stage after it); a step is a stage of layers ``[a, b)`` on one group, of some degree, batch
``n`` and recompute, allowed where rules 1, 3 and 4 hold, priced ``lambda_g t mbs / n``. If the
cheapest path at some prices costs more than ``sum_g lambda_g N_g``, no plan of ``mbs`` reaches
``T``. The two paths (rules 3 and 4, rule 5) are tested one after the other: either ruling
``T`` out is enough. Prices are found by column generation: each round's are those that best separate the
paths found so far (a small linear program solved by its vertices); where a mix of the paths
found fits the cluster the test stops (``T`` is not ruled out). With ``--one-path``, a target
the prices leave is tested again on one path with every group's GPUs counted (a plan is one
path, not a mix): a best-first search (:func:`one_path`) that drops partial paths by the
prices' cheapest completions; where it finds none, ``T`` is ruled out.

**The relaxations** (each can only admit more):

* the stage's start (the first micro-batch's forwards before it), the cuts between stages,
  the exposed gradient all-reduce, the optimizer step and a sharded state's all-gather, the
  drain after the last backward, and every per-action or per-transfer overhead a profile
  measures are left out; ``ceil(M / q_s)`` round trips count as ``M / q_s``;
* the replica count is ``ceil(mbs / n)`` (the fewest whole replicas with at most ``n``
  samples each), replicas may sit anywhere in the group (one node each is not asked), the
  optimizer state's bytes per parameter are the least any width allows (sharded over at most
  ``mbs - n + 1`` replicas, and at most every GPU of the cluster in replicas of that degree,
  since a stage may mix groups, or replicated);
* per-replica batches above 16 on a grid of ratio 9/8 (memory and share at the grid value,
  GPUs at the next one less one); recompute of the first ``r`` blocks on a grid (compute at
  the value below, memory at the one above);
* a stage that mixes groups or gives uneven shares costs at least its cheapest kind of
  replica priced alone at its batch (its GPUs are a mix of the kinds' ``t mbs / n_k``), and
  that kind meets rules 1, 3 and 4 on its own: it is bounded as that kind alone;
* rule 5 leaves out the transfers in the chain, takes each stage's ``(f + i) / c`` at its
  least (``rho``), deferrals above ``D`` at ``D + 1`` and warm-ups above ``d_max`` at
  ``d_max + 1``, and the chain's first ``delta`` micro-batches at none;
* shares and loads on a grid of ``1 / grid``, rounded the lenient way (a stage fits a share
  bin ``k`` where its share is at most ``k / grid``, and adds ``rho (k - 1) / grid`` to the
  load, which is rounded down; memory is asked for ``floor(load + (k - 1) / grid) + 1``
  micro-batches, all of them above ``d_max`` counted as ``d_max + 1``; rule 5 takes each
  share at its bin's lower end);
* only up to ``rounds`` price vectors are tried: a target not ruled out by them counts as
  reached.

**Rule 6, interleaved plans** (``v >= 2`` chunks a rank; ``v = 1`` is 1F1B's shape, under
rules 1-5). A rank holds several stages on one GPU, so the path above does not price it; rule
6 bounds such plans alone (:func:`interleaved_lower_bound_s`):

6. *The first round held, and the fill.* Rank ``k`` of ``p`` holds stages ``k, k + p, ...``;
   the kind's lists run a rank's forwards round by round, chunk by chunk within a round, the
   first round of ``r = ceil(M / floor(M / p))`` micro-batches (``r = M`` where ``M < p``),
   and a rank's warm-up is at least ``(v - 1) r + 1`` (``interleaved_bounds``). So before its
   first backward the rank holds the first round of each of its first ``v - 1`` chunks and
   one micro-batch of its last, and the replay adds each forward's kept bytes on the rank's
   GPU until its backward: with the chunks as ``Plan.interleave`` cuts them (the last of
   ``floor(units / v)`` contiguous units), the GPU holds its weights and state, working set
   and weight copies, ``r`` times its early chunks' kept bytes and its last chunk's once. The
   last rank's first forward waits for the first chunk's forward on every rank before it,
   and the iteration's end for that chunk's backward of the last micro-batch on each of them:
   ``M c_last + sum_{k < p - 1} c0_k <= T`` (``c0_k``: rank ``k``'s first chunk's forward
   and backward of one micro-batch), the *fill row*.

   A plan's ``p`` ranks are then kinds of rank (a group, degree, batch a replica, sequence
   parallelism; the first rank holds the embedding, the last the head) that must cover every
   middle unit within the groups' GPUs: a linear programme whose ranks may be fractions (a
   rank of mixed replicas is no cheaper than its kinds' mix, as in rule 2), its units
   weighed by a price per unit type (halves: attention and MLP; five weightings tried) and
   its fill row priced into the kinds (eight prices tried). Where at some prices the most the
   ranks cover (the simplex's value, checked as its dual) falls short of the model, no plan
   of ``p`` ranks reaches ``T``. ``v`` from 2 to 7 is weighed one by one, every ``v >= 8``
   together.

   Its relaxations: recompute as a fractional knapsack on each rank's slack (an early
   chunk's unit relieves ``r`` micro-batches, a last chunk's one), the working set and
   weight copies once a rank, the chunks' sequence-parallel edges once, transfers and
   per-action overheads left out, each unit at its type's least figure, a first chunk's
   compute at the cheapest units a contiguous run of its size can hold (the embedding's
   left out), at most ``p - 2`` middle ranks (fewer admitted), fractional replica counts
   (``t mbs / n`` GPUs), and for ``v >= 8`` any split of the last chunk by type.

**Scope.** The bound reads the analytic tables (times linear in the batch plus fixed
latencies); a job with a profile is refused. Rule 6 needs the middle layers to repeat one
pattern of at most two kinds (whole blocks; attention and MLP halves).

``--what-if`` also runs the test with the tensor-parallel collectives (the blocks' all-reduces,
sequence parallelism's all-gathers, the split head's collectives) taken out of the compute: a
what-if of this script, not a cost the cost model prices.
"""
from __future__ import annotations

import argparse
import functools
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
from hapt_hf.errors import PlanningError  # noqa: E402
from hapt_hf.planner.cluster import Cluster, GpuGroup  # noqa: E402
from hapt_hf.planner.cost_model import CostModel  # noqa: E402
from hapt_hf.planner.model_spec import ModelSpec  # noqa: E402
from hapt_hf.planner.search.tensor_parallel import node_degrees  # noqa: E402
from hapt_hf.planner.simulate import WEIGHT_GRADIENT_SHARE  # noqa: E402

__all__ = ["TpBound", "ReplicaMenu", "replica_menu", "replica_path", "rho_floor",
           "beta_floor", "one_path", "tp_lower_bound_s", "unit_types", "interleaved_values",
           "interleaved_cover", "interleaved_ruled_out", "interleaved_lower_bound_s", "main"]


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
    return node_degrees(cm.model, g)  # every degree the planner may give (any max_tp)


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




# -- replicas counted: each stage's share follows from its per-replica batch ----------------

N_EXACT = 16
"""Per-replica batches weighed one by one up to this; above it on a grid of ratio about
9/8, each grid value ``n_i`` standing for ``[n_i, n_{i+1})``: its memory and share at
``n_i``, its GPU count at ``n_{i+1} - 1`` samples a replica."""


def _batch_grid(mbs: int) -> list[tuple[int, int]]:
    """(samples for memory and share, samples for the GPU count) of each option."""
    out = [(n, n) for n in range(1, min(mbs, N_EXACT) + 1)]
    n = N_EXACT + 1
    while n <= mbs:
        nxt = min(mbs + 1, max(n + 1, (n * 9) // 8))
        out.append((n, nxt - 1))
        n = nxt
    return out


@dataclass(frozen=True)
class ReplicaMenu:
    """For one layer sequence, micro-batch size ``mbs`` and target ``T``: per group, number
    of micro-batches held ``q`` and share bin ``k`` (share at most ``k / grid``), the fewest
    GPUs ``t mbs / n`` of a stage of layers ``[a, b)`` whose replicas of ``n`` samples keep
    its share ``M c(n) / T`` within the bin and whose memory holds ``q`` micro-batches."""

    groups: tuple[GpuGroup, ...]
    gpus: np.ndarray
    """Shape (groups, q_cap + 1, grid + 1, L + 1, L + 1); inf where nothing fits."""
    back_share: np.ndarray
    num_layers: int
    layer_unit: str


def replica_menu(cm: CostModel, gbs: int, mbs: int, T: float, q_cap: int, grid: int,
                 hide_tp: bool = False) -> ReplicaMenu:
    """Every stage option at micro-batch ``mbs`` and target ``T`` (see :class:`ReplicaMenu`):
    a stage whose largest replica computes ``n`` samples has at least ``mbs / n`` replicas
    and is busy at least ``M c(n)``; recompute of the first ``r`` blocks at the grid's value
    below (compute) and above (memory) ``r``."""
    if cm.profile is not None:
        raise PlanningError("tp_bound reads the analytic tables only; this job has a profile")
    L = cm.model.num_layers
    groups = cm.hardware.groups
    A = np.arange(L + 1)[:, None]
    B = np.arange(L + 1)[None, :]
    valid = A < B
    A2, B2 = np.broadcast_arrays(A, B)
    M = gbs // mbs
    gpus = np.full((len(groups), q_cap + 1, grid + 1, L + 1, L + 1), np.inf)
    back = np.ones((L + 1, L + 1))
    rgrid = _recompute_grid(L)
    for gi, g in enumerate(groups):
        cap = cm.capacity_bytes(g)
        for t in _degrees(cm, g):
            params = np.asarray(cm.shard(t).params)
            fixed = np.asarray(cm.shard(t).fixed)
            fixed_rc = np.asarray(cm.shard(t).fixed_rc)
            for sp in ([False, True] if cm.sp_allowed(t) else [False]):
                sh = cm.shard(t, sp)
                keep, keep_rc = np.asarray(sh.keep), np.asarray(sh.keep_rc)
                kmax = np.zeros((L + 1, L + 1))
                for a in range(L):
                    kmax[a, a + 1:] = sh.keep_max[a]
                for n, n_gpus in _batch_grid(mbs):
                    # the widest a stage's optimizer state can be sharded: over its replicas,
                    # each computing at least one sample (plan.Stage.validate), so at most
                    # mbs - n + 1 beside one of n, and at most every GPU of the cluster (a
                    # stage may mix groups) in replicas of t
                    reps = min(mbs - n + 1, sum(x.size for x in groups) // t)
                    spb = min(state_bytes_per_param(REPLICATED, reps),
                              state_bytes_per_param(SHARDED, reps) if reps > 1 else math.inf)
                    static = (params[B] - params[A]) * spb
                    f, b, rf = _layer_times(cm, g, n, t, hide_tp)
                    F, Bw, RF = (np.concatenate([[0.0], np.cumsum(x)]) for x in (f, b, rf))
                    edge = 0.0
                    if sp:
                        edge, rg = _sp_terms(cm, g, n, t, hide_tp)
                        RG = np.concatenate([[0.0], np.cumsum(rg)])
                    room0 = cap - static - n * kmax
                    if not np.any(valid & (room0 > 0)):
                        break  # a larger batch only needs more
                    for ri, r in enumerate(rgrid):
                        r_mem = rgrid[ri + 1] - 1 if ri + 1 < len(rgrid) else r
                        e_c = A if r == 0 else np.minimum(np.maximum(A, 1) + r, B)
                        e_m = A if r_mem == 0 else np.minimum(np.maximum(A, 1) + r_mem, B)
                        fwd = (F[B] - F[A]) + edge
                        c = fwd + (Bw[B] - Bw[A]) + (RF[e_c] - RF[A]) + edge
                        if sp:
                            c = c + (RG[B] - RG[e_c])
                        with np.errstate(divide="ignore", invalid="ignore"):
                            back = np.minimum(back, np.where(valid & (c > 0), (c - fwd) / c, 1.0))
                        copies = fixed_rc[e_m] - fixed_rc[A] + fixed[B] - fixed[e_m]
                        act = n * (keep_rc[e_m] - keep_rc[A] + keep[B] - keep[e_m])
                        room = room0 - copies
                        with np.errstate(divide="ignore", invalid="ignore"):
                            q = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)),
                                         q_cap)
                        q = np.where(valid & (room >= 0), np.minimum(q, q_cap), 0).astype(int)
                        # the least share bin the stage fits: share M c / T <= k / grid
                        k = np.ceil(M * c / T * grid - 1e-9).astype(int)
                        ok = (q >= 1) & (k <= grid)
                        if not ok.any():
                            continue
                        np.minimum.at(gpus[gi], (q[ok], np.maximum(k[ok], 1), A2[ok], B2[ok]),
                                      t * -(-mbs // n_gpus))
    # holding q or more fits a need of q; a share bin k fits every wider bin
    gpus = np.minimum.accumulate(gpus[:, ::-1], axis=1)[:, ::-1]
    gpus = np.minimum.accumulate(gpus, axis=2)
    return ReplicaMenu(groups, gpus, back, L, cm.model.layer_unit)


def _steps(menu: ReplicaMenu, grid: int, d_max: float, rho: float, mbs_share: float,
           beta: float, chain: bool = False):
    """The path's step rules on a grid of states: for state ``i`` after a boundary and share
    bin ``k`` (1-based) of the stage before it, the micro-batches that stage holds, the state
    before it, and whether its backward window shuts the step (per stage ``[a, b)``:
    ``shut(a, b)``, states x bins). The states: the load on the grid (rule 3), or with
    ``chain`` the warm-up depth and share bin of the stage after (rule 5; state 0: none)."""
    h = 1.0 / grid
    q_cap = menu.gpus.shape[1] - 1
    if chain:
        return _chain_steps(grid, q_cap, rho, int(round(1.0 / mbs_share)))
    nd = int(round(d_max * grid))
    i = np.arange(nd + 1)[:, None]
    k = np.arange(1, grid + 1)[None, :]
    q_need = np.minimum(np.floor((i + k - 1) * h).astype(int) + 1, q_cap)
    nxt = np.minimum(np.floor(i + rho * (k - 1) + 1e-9).astype(int), nd)
    kh = np.broadcast_to(k * h, q_need.shape)
    load = np.broadcast_to(i * h * mbs_share, q_need.shape)
    back = np.maximum(menu.back_share, beta)

    def shut(a: int, b: int) -> np.ndarray:
        return back[a, b] * (kh - h) + load > 1.0 + 1e-12
    return nd, q_need, nxt, shut, np.arange(1, grid + 1)


CHAIN_DEFERRAL = 8
"""Rule 5 weighs a stage's deferred weight gradients up to this many apart (see the module's
docstring): a stage deferring more holds this many more micro-batches."""


@functools.lru_cache(maxsize=32)
def _chain_steps(grid: int, w_cap: int, rho: float, M: int, d_cap: int = CHAIN_DEFERRAL):
    """Rule 5's steps (see the module's docstring): state ``1 + (w' - 1) grid + k' - 1`` is a
    stage after of warm-up ``w'`` (``w_cap``: at least it) and share bin ``k'``; state 0
    none. A step is a share bin ``k`` and whether the stage defers at most ``d_cap`` weight
    gradients (its chain then counts its own weight gradient) or more (it holds ``d_cap + 1``
    more micro-batches); the stage takes the least warm-up ``w = w' - 1 + delta`` the rule
    allows, holds ``min(w, M)`` (plus the deferred), and passes its own state on. Returns the
    steps' columns as ``(n_states - 1, q_need, nxt, shut, kmap)``, ``kmap`` each column's
    share bin."""
    h = 1.0 / grid
    n_states = 1 + w_cap * grid
    q_need = np.ones((n_states, 2 * grid), dtype=int)
    nxt = np.zeros((n_states, 2 * grid), dtype=int)
    kmap = np.tile(np.arange(1, grid + 1), 2)
    for col in range(2 * grid):
        k, deep = kmap[col], col >= grid
        for w2 in range(0, w_cap + 1):
            for k2 in range(1, grid + 1) if w2 else (1,):
                i = 0 if w2 == 0 else 1 + (w2 - 1) * grid + (k2 - 1)
                if w2 == 0:
                    w = 1                                     # the last stage
                else:
                    u, u2 = (k - 1) * h, (k2 - 1) * h         # lenient: the bins' lower ends
                    pace = rho * (u + u2) if deep else u + rho * u2
                    span = max(M - w2 - (0 if deep else d_cap), 0)
                    delta = 1
                    if pace > 0:
                        # the least delta with pace * floor(span / delta) <= M
                        while pace * (span // delta) > M * (1 + 1e-12):
                            delta += 1
                    w = min(w2 - 1 + delta, w_cap, M)
                q_need[i, col] = min(w + (d_cap + 1 if deep else 0), w_cap, M)
                nxt[i, col] = 1 + (w - 1) * grid + (k - 1)
    never = np.zeros((n_states, 2 * grid), dtype=bool)

    def shut(a: int, b: int) -> np.ndarray:
        return never
    return n_states - 1, q_need, nxt, shut, kmap


def _cover(menu: ReplicaMenu, prices: np.ndarray, grid: int, d_max: float, rho: float,
           mbs_share: float, beta: float, chain: bool = False):
    """The dynamic programme under ``replica_path``: ``G[b, i]``, the least priced GPUs of
    stages covering layers ``[0, b)`` where the stages after ``b`` put load state ``i`` on
    them, and each entry's last stage (its first layer, share bin index, group)."""
    L = menu.num_layers
    with np.errstate(invalid="ignore"):
        priced = menu.gpus * prices[:, None, None, None, None]
    priced[~np.isfinite(menu.gpus)] = np.inf
    nd, q_need, nxt, shut, kmap = _steps(menu, grid, d_max, rho, mbs_share, beta, chain)
    kk_idx = np.broadcast_to(kmap[None, :], q_need.shape)
    G = np.full((L + 1, nd + 1), np.inf)
    G[0] = 0.0
    ch_a = np.zeros((L + 1, nd + 1), dtype=int)
    ch_k = np.zeros((L + 1, nd + 1), dtype=int)
    ch_g = np.zeros((L + 1, nd + 1), dtype=int)
    G_next = [None] * (L + 1)
    G_next[0] = G[0][nxt]
    rows = np.arange(nd + 1)
    for b in range(1, L + 1):
        row = np.full(nd + 1, np.inf)
        ra, rk, rg = (np.zeros(nd + 1, dtype=int) for _ in range(3))
        for a in range(b):
            if not np.isfinite(G[a]).any():
                continue
            closed = shut(a, b)
            for gi in range(len(menu.groups)):
                tab = priced[gi, :, :, a, b]
                if not np.isfinite(tab[1, grid]):
                    continue
                cand = tab[q_need, kk_idx] + G_next[a]
                cand[closed] = np.inf
                best_k = cand.argmin(axis=1)
                v = cand[rows, best_k]
                upd = v < row
                row[upd] = v[upd]
                ra[upd], rk[upd], rg[upd] = a, best_k[upd], gi
        G[b] = row
        ch_a[b], ch_k[b], ch_g[b] = ra, rk, rg
        G_next[b] = row[nxt]
    return G, ch_a, ch_k, ch_g, q_need, nxt, kmap


def replica_path(menu: ReplicaMenu, prices: np.ndarray, sizes: np.ndarray, rho: float,
                 grid: int, d_max: float, mbs_share: float, beta: float = 0.0,
                 chain: bool = False, cover=None) -> tuple[float, list]:
    """The shortest path over layer boundaries, back to front, with the state the load after
    a boundary (on a grid of ``1 / grid``, rounded down): a step is a stage of one group in
    share bin ``k`` (its share in ``((k - 1) / grid, k / grid]``) that holds
    ``ceil(load + share)`` micro-batches and keeps its backward window
    (``back share * share + load * mbs / gbs <= 1``), priced ``lambda_g`` a GPU. Returns the
    priced GPUs over ``lambda . sizes`` (a plan needs at most 1) and the path (group, 0, a,
    b, share bin's top, micro-batches held), first stage first. ``cover``: ``_cover``'s
    tables at these prices, where already made."""
    L = menu.num_layers
    h = 1.0 / grid
    if cover is None:
        cover = _cover(menu, prices, grid, d_max, rho, mbs_share, beta, chain)
    G, ch_a, ch_k, ch_g, q_need, nxt, kmap = cover
    total = G[L, 0]
    path = []
    b, st = L, 0
    while b > 0 and np.isfinite(total):
        a, kx, gi = ch_a[b, st], ch_k[b, st], ch_g[b, st]
        q = int(q_need[st, kx])
        path.append((int(gi), 0, int(a), int(b), float(kmap[kx] * h), q, int(kmap[kx])))
        b, st = a, nxt[st, kx]
    path.reverse()
    return float(total / float(prices @ sizes)), path


LABEL_CAP = 1_000_000
"""Partial paths the one-path search makes at most before it gives up (undecided)."""


def one_path(menu: ReplicaMenu, price_list: list[np.ndarray], sizes: np.ndarray, rho: float,
             grid: int, d_max: float, mbs_share: float, beta: float = 0.0,
             cap: int = LABEL_CAP, chain: bool = False,
             covers: list | None = None) -> tuple[bool | None, list, int]:
    """Whether one path fits the cluster with every group's GPUs counted (a plan is one path;
    the prices' test admits mixes of paths). A best-first search from the last layer: each
    partial path carries the GPUs it takes of each group and is dropped where a group runs
    out, where its cheapest completion at any of ``price_list`` (``_cover``) passes that
    price's budget, or where a partial path at the same boundary with no more load and no
    more GPUs of any group was expanded before; the partial paths are expanded in order of
    their least total at the last prices. Returns (True: found, with the path as
    ``replica_path`` gives it; False: none exists; None: more than ``cap`` partial paths made,
    undecided; the path; partial paths made). ``covers``: ``_cover``'s least costs at each of
    ``price_list`` where already made (None where not)."""
    import heapq
    L, n_groups = menu.num_layers, len(menu.groups)
    h = 1.0 / grid
    _, q_need, nxt, shut, kmap = _steps(menu, grid, d_max, rho, mbs_share, beta, chain)
    made_covers = list(covers) if covers is not None else [None] * len(price_list)
    covers = [c if c is not None else _cover(menu, p, grid, d_max, rho, mbs_share, beta, chain)[0]
              for c, p in zip(made_covers, price_list)]
    P = np.asarray(price_list)
    budget = P @ sizes + 1e-9

    def no_worse(j: int, i: int) -> bool:
        """State ``j`` admits every step state ``i`` does: no more load; under rule 5 a stage
        after of no deeper warm-up and no larger share bin (or the same state)."""
        if not chain or j == i:
            return j <= i
        if j == 0 or i == 0:
            return False
        return (j - 1) // grid <= (i - 1) // grid and (j - 1) % grid <= (i - 1) % grid
    heap = [(float(covers[-1][L, 0]), 0, L, 0, (0.0,) * n_groups, ())]
    expanded: dict[int, list] = {}
    closed_at: dict[int, np.ndarray] = {}
    made = 0
    while heap:
        _, _, b, i, use_t, path = heapq.heappop(heap)
        if b == 0:
            return True, [(g, 0, a, bb, u, q, k) for g, a, bb, u, q, k in path], made
        use = np.asarray(use_t)
        seen = expanded.setdefault(b, [])
        if any(no_worse(j, i) and np.all(u <= use) for j, u in seen):
            continue
        seen.append((i, use))
        if b not in closed_at:
            closed_at[b] = np.stack([shut(a, b) for a in range(b)], axis=-1)
        c = menu.gpus[:, :, :, :b, b][:, q_need[i], kmap, :]        # (groups, steps, a)
        gi, ki, ai = np.nonzero(np.isfinite(c) & ~closed_at[b][i][None])
        if gi.size == 0:
            continue
        new = np.repeat(use[None, :], gi.size, axis=0)
        new[np.arange(gi.size), gi] += c[gi, ki, ai]
        st = nxt[i, ki]
        fine = np.all(new <= sizes + 1e-9, axis=1)
        for pi in range(len(P)):
            fine &= new @ P[pi] + covers[pi][ai, st] <= budget[pi]
        est = new @ P[-1] + covers[-1][ai, st]
        for j in np.nonzero(fine)[0]:
            made += 1
            step = (int(gi[j]), int(ai[j]), b, float(kmap[ki[j]] * h), int(q_need[i, ki[j]]),
                    int(kmap[ki[j]]))
            heapq.heappush(heap, (float(est[j]), made, int(ai[j]), int(st[j]), tuple(new[j]),
                                  (step,) + path))
        if made > cap:
            return None, [], made
    return False, [], made


def replica_use(menu: ReplicaMenu, path) -> np.ndarray:
    """GPUs of each group the path takes."""
    use = np.zeros(len(menu.groups))
    for gi, _t, a, b, _u, q, k in path:
        use[gi] += menu.gpus[gi, q, k, a, b]
    return use


@dataclass(frozen=True)
class TpBound:
    """A lower bound and where it comes from."""

    bound_s: float
    """No plan in scope replays faster (a lower end: the bisection's last interval)."""
    layer_unit: str
    """The layer sequence ('block' or 'half') whose bound is the least."""
    micro_batch_size: int
    """The micro-batch size whose bound is the least."""
    per_size: tuple[tuple[str, int, float], ...]
    """(layer unit, micro-batch size, its bound) of every one weighed (inf: nothing fits)."""
    stages: tuple[tuple[str, int, int, float, int], ...]
    """The cheapest path at the bound's end of the interval, first stage first: (group,
    first layer, end layer, share bin's top, micro-batches held)."""
    rho: float
    beta: float


def _need(menu: ReplicaMenu, sizes: np.ndarray, speed: np.ndarray, rho: float, beta: float,
          grid: int, d_max: float, mbs_share: float, rounds: int, exact: bool = False,
          chain: bool = False) -> tuple[bool, float, list]:
    """Column generation over group prices: (whether some prices rule the target out, the
    largest fraction of the cluster a path needed, that path)."""
    prices = speed / (speed @ sizes)
    best, best_path, uses, tried = -math.inf, [], [], []
    covers: list = []           # each tried price's cheapest completions, for one_path
    for _ in range(rounds):
        cover = _cover(menu, prices, grid, d_max, rho, mbs_share, beta, chain)
        val, path = replica_path(menu, prices, sizes, rho, grid, d_max, mbs_share, beta, chain,
                                 cover)
        tried.append(prices)
        covers.append(cover[0])
        if not path:
            return True, math.inf, []
        if val > best:
            best, best_path = val, path
        if val > 1.0 + 1e-9:
            return True, best, best_path
        uses.append(replica_use(menu, path))
        prices, mix = best_prices(uses, sizes)
        if mix <= 1.0 + 1e-9:   # a mix of these paths fits the cluster
            tried.append(prices)
            covers.append(None)
            break
    if exact:
        found, path, _ = one_path(menu, tried, sizes, rho, grid, d_max, mbs_share, beta,
                                  chain=chain, covers=covers)
        if found is False:      # no one path fits: ruled out
            return True, best, best_path
        if found:
            return False, best, path
    return False, best, best_path


def _layer_sequences(model: ModelSpec) -> list[ModelSpec]:
    """The layer sequences a plan may cut: whole blocks, and halves where the model splits."""
    return [model] + ([model.split_blocks()] if model.can_split_blocks else [])


def _speeds(cm: CostModel) -> np.ndarray:
    """Samples a second of one GPU of each group (the physical limit's speeds: ``gbs /
    (speeds . sizes)`` is the bisections' floor; the first prices)."""
    return np.array([1.0 / cm.sample_time_s(g, 1) for g in cm.hardware.groups])


def _bisect_below(test, target: float, limit: float, steps: int):
    """``test(T) -> (ruled out, info)`` at ``target``, then, where not ruled out, ``steps``
    halvings between ``limit`` and ``target``: (ruled out at ``target``, the lower end, the
    upper end, the info of the target or of the last time not ruled out)."""
    out, info = test(target)
    lo, hi = (target, target) if out else (limit, target)
    for _ in range(0 if out else steps):
        mid = 0.5 * (lo + hi)
        out_mid, info_mid = test(mid)
        if out_mid:
            lo = mid
        else:
            hi, info = mid, info_mid
    return out, lo, hi, info


def tp_lower_bound_s(model: ModelSpec, cluster: Cluster, global_batch_size: int,
                     target: float, grid: int = 8, d_max: float = 24.0, rounds: int = 25,
                     steps: int = 5, hide_tp: bool = False, exact: bool = False,
                     rules: tuple[str, ...] = ("load", "chain"), log=None) -> TpBound:
    """The bound of the module's docstring. Every layer unit and micro-batch size is first
    tested at ``target``; those it does not rule out are bisected between the physical limit
    and ``target`` in ``steps`` halvings. ``bound_s`` is the least lower end, ``target``
    itself where every size is ruled out there (a certificate that no plan reaches it). With
    ``exact``, a target the prices do not rule out is tested again with one path, every
    group's GPUs counted (:func:`one_path`; undecided counts as reached)."""
    from hapt_hf.planner.search import divisors
    gbs = global_batch_size
    sizes = np.array([g.size for g in cluster.groups], dtype=float)
    per, best = [], None
    for m in _layer_sequences(model):
        cm = CostModel(m, cluster)
        rho, beta = rho_floor(cm, gbs, hide_tp), beta_floor(cm, gbs, hide_tp)
        speed = _speeds(cm)
        limit = gbs / float(speed @ sizes)
        q_cap = int(math.ceil(d_max)) + 1
        for mbs in divisors(gbs):
            c0 = time.process_time()

            def test(T: float, cm=cm, mbs=mbs, speed=speed, rho=rho, beta=beta, q_cap=q_cap):
                menu = replica_menu(cm, gbs, mbs, T, q_cap, grid, hide_tp)
                got = None
                for rule in rules:   # each rule alone is necessary: ruled out by either
                    got = _need(menu, sizes, speed, rho, beta, grid, d_max, mbs / gbs, rounds,
                                exact, chain=rule == "chain")
                    if got[0]:
                        break
                return got[0], got[1:]

            out, lo, hi, (need, path) = _bisect_below(test, target, limit, steps)
            if math.isinf(need) and not path:
                lo = math.inf  # nothing fits at all
            per.append((m.layer_unit, mbs, lo))
            if log:
                log(f"  {m.layer_unit} units, micro-batch {mbs}: "
                    + (f"ruled out at {target:.3f} s (needs {need:.3f} of the cluster)" if out
                       else f"bound {lo:.3f} s (a mix of paths fits at {hi:.3f} s)")
                    + f", {time.process_time() - c0:.1f} s CPU")
            if best is None or lo < best[0]:
                best = (lo, m.layer_unit, mbs, path, cluster, rho, beta)
    lo, unit, mbs, path, cl, rho, beta = best
    return TpBound(lo, unit, mbs, tuple(per),
                   tuple((cl.groups[gi].name, a, b, u, q) for gi, _t, a, b, u, q, _k in path),
                   rho, beta)


# -- interleaved plans: rule 6, the warm-up's first round --------------------------------

INTERLEAVED_LUMP = 8
"""Rule 6 weighs ``v`` chunks a rank one by one below this; every ``v`` at or above it
together (a chunk's unit types as uneven as they may be, its last chunk at most
``floor(units / INTERLEAVED_LUMP)`` units)."""

_ROLES = ("middle", "first", "last")
"""A rank holding neither end layer, the first (the embedding), the last (the head)."""


def unit_types(model: ModelSpec) -> list[list[int]]:
    """The positions of each kind of middle layer (between the first and the last layer),
    kinds told apart by signature; PlanningError where they do not repeat one pattern (rule
    6 counts a contiguous run's units of each kind from the period)."""
    sigs: list[str] = []
    for lay in model.layers[1:-1]:
        if lay.signature in sigs:
            break
        sigs.append(lay.signature)
    k = max(len(sigs), 1)
    mid = range(1, model.num_layers - 1)
    if any(model.layers[j].signature != sigs[(j - 1) % k] for j in mid):
        raise PlanningError("the interleaved rule needs the model's middle layers to repeat "
                            "one pattern of kinds; this model's do not")
    return [[j for j in mid if (j - 1) % k == i] for i in range(k)]


def _last_chunk_splits(cnt: np.ndarray, u: np.ndarray, exact: bool) -> list[np.ndarray]:
    """The ways a rank's last chunk of ``u`` middle units may split by unit type (rows as
    ``cnt``, the rank's units of each type): contiguous (``exact``), each type
    ``floor(u / types)`` or one more; else any split (at most two types). A way the rank's
    units cannot give has a negative entry in ``cnt - split`` or in the split."""
    nty = cnt.shape[1]
    if nty == 1:
        return [u[:, None].copy()]
    if nty != 2:
        raise PlanningError("the interleaved rule weighs at most two kinds of middle layer; "
                            f"this model's repeat {nty}")
    firsts = [np.floor(u / 2), np.ceil(u / 2)] if exact else \
        [np.minimum(u, k) for k in range(int(u.max(initial=0)) + 1)]
    return [np.stack([a, u - a], axis=1) for a in firsts]


def interleaved_values(cm: CostModel, gbs: int, mbs: int, T: float, firsts: list[int],
                       pis: np.ndarray, psis: np.ndarray, virtual: int, exact: bool = True,
                       hide_tp: bool = False) -> dict:
    """Rule 6's rank kinds at micro-batch ``mbs`` and target ``T`` (see the module's
    docstring): ``out[role][group][gpus]``, an array over ``firsts`` (the first round's
    micro-batches), the weights ``pis`` (one per unit type) and the fill prices ``psis`` of
    the most ``pi . units - psi . fill`` a rank of that role holds in replicas of ``gpus /
    mbs`` GPUs a sample (-inf: none); ``fill`` is the rank's first chunk's compute of one
    micro-batch over ``T`` (the last rank: its share ``M c / T``). ``virtual``: chunks a
    rank; ``exact``: that many, its chunks' unit types as even as contiguous runs make
    them; else at least that many, the types any (the first chunk then at least a unit)."""
    L = cm.model.num_layers
    groups = cm.hardware.groups
    M = gbs // mbs
    types = unit_types(cm.model)
    nty = len(types)
    rs = np.asarray(firsts, dtype=float)
    psis = np.asarray(psis, dtype=float)
    top = len(types[0]) + 2
    grids = np.meshgrid(*[np.arange(top + 1)] * nty, indexing="ij")
    cnt = np.stack([g.ravel() for g in grids], axis=1).astype(float)   # units of each type
    if exact and nty > 1:  # a contiguous chunk's types differ by at most one unit
        cnt = cnt[cnt.max(axis=1) - cnt.min(axis=1) <= virtual]
    piv = cnt @ np.asarray(pis, dtype=float).T
    out: dict = {role: [{} for _ in groups] for role in _ROLES}
    total_gpus = sum(x.size for x in groups)
    for gi, g in enumerate(groups):
        cap = cm.capacity_bytes(g)
        for t in _degrees(cm, g):
            P_ = np.diff(np.asarray(cm.shard(t).params))
            FX = np.diff(np.asarray(cm.shard(t).fixed))
            for sp in ([False, True] if cm.sp_allowed(t) else [False]):
                sh = cm.shard(t, sp)
                K_, KR = np.diff(np.asarray(sh.keep)), np.diff(np.asarray(sh.keep_rc))
                for n, n_gpus in _batch_grid(mbs):
                    reps = min(mbs - n + 1, total_gpus // t)
                    spb = min(state_bytes_per_param(REPLICATED, reps),
                              state_bytes_per_param(SHARDED, reps) if reps > 1 else math.inf)
                    f, b, rf = _layer_times(cm, g, n, t, hide_tp)
                    rg, edge = np.zeros(L), 0.0
                    if sp:
                        em, rg = _sp_terms(cm, g, n, t, hide_tp)
                        edge = min(em[j, j + 1] for j in range(1, L - 1))

                    def least(x):
                        return np.array([min(x[j] for j in ix) for ix in types])
                    u_c, u_rc, u_fb = least(f + b + rg), least(rf - rg), least(f + b)
                    u_p, u_fx = least(P_) * spb, least(FX)
                    u_k, u_kr = least(K_) * n, least(KR) * n
                    c0, stat0, act0, fx0 = cnt @ u_c + 2 * edge, cnt @ u_p, cnt @ u_k, cnt @ u_fx
                    work0 = np.max(np.where(cnt > 0, u_k[None, :], 0.0), axis=1)
                    for role in _ROLES:
                        c, stat, act, fx, work = c0, stat0, act0, fx0, work0
                        units = cnt.sum(axis=1)
                        end = {"first": 0, "last": L - 1}.get(role)
                        if end is not None:
                            c, stat = c + f[end] + b[end], stat + P_[end] * spb
                            act, fx = act + K_[end] * n, fx + FX[end]
                            work, units = np.maximum(work, K_[end] * n), units + 1
                        slack = T / M - c               # what recompute may add
                        keep = (slack >= -1e-12 * T / M) & (units >= virtual)
                        if not keep.any():
                            continue
                        rows = np.nonzero(keep)[0]
                        cn, un, sl = cnt[rows], units[rows], slack[rows]
                        act, c = act[rows], c[rows]
                        room = cap - stat[rows] - work[rows] - fx[rows]
                        # the last chunk: floor(units / v) contiguous units (the head one of
                        # them on the last rank): the ways its middle units split by type
                        u = np.maximum(np.floor(un / virtual) - (1 if role == "last" else 0), 0)
                        comps = _last_chunk_splits(cn, u, exact)
                        end_keep = K_[end] * n if end is not None else 0.0
                        if role == "last":
                            fill = M * c / T            # the last rank's share
                        else:
                            # the first chunk: ceil(units / v) contiguous units (the embedding
                            # one of them on the first rank), at least floor(u / types) of a
                            # type, the rest at the cheapest; its forward and backward of one
                            # micro-batch
                            u0 = np.ceil(un / virtual) if exact else np.minimum(un, 1.0)
                            u0 = u0 - (1 if role == "first" else 0)
                            each = np.minimum(cn, np.floor(u0 / nty)[:, None])
                            rest = np.maximum(u0 - each.sum(axis=1), 0.0)
                            fill = (each @ u_fb + rest * u_fb.min()) / T
                        gain = piv[rows][:, :, None] - psis[None, None, :] * fill[:, None, None]
                        res = np.full((len(rs), piv.shape[1], len(psis)), -np.inf)
                        for ri, r in enumerate(rs):
                            need = np.full(len(rows), np.inf)
                            for late in comps:
                                early = cn - late
                                base = r * (early @ u_k) + late @ u_k
                                base = base + (end_keep if role == "last" else r * end_keep)
                                # recompute's relief at its most, a fractional knapsack on the
                                # slack: an early unit r micro-batches' kept bytes and its
                                # weight copies, a last-chunk unit one micro-batch's and copies
                                items = [(r * (u_k[ty] - u_kr[ty]) + u_fx[ty], ty, early)
                                         for ty in range(nty)] + \
                                    [((u_k[ty] - u_kr[ty]) + u_fx[ty], ty, late)
                                     for ty in range(nty)]
                                items.sort(key=lambda it: -it[0] / max(u_rc[it[1]], 1e-30))
                                budget = np.maximum(sl, 0.0)
                                relief = np.zeros(len(rows))
                                for gain_unit, ty, held in items:
                                    if gain_unit <= 0:
                                        continue
                                    x = held[:, ty] if u_rc[ty] <= 0 else \
                                        np.minimum(held[:, ty], budget / u_rc[ty])
                                    budget = budget - x * max(u_rc[ty], 0.0)
                                    relief = relief + x * gain_unit
                                valid = np.all(late >= 0, axis=1) & np.all(early >= 0, axis=1)
                                need = np.minimum(need, np.where(valid, base - relief, np.inf))
                            ok = need <= room
                            if ok.any():
                                res[ri] = gain[ok].max(axis=0)
                        if np.isfinite(res).any():
                            d = out[role][gi]
                            key = t * mbs / n_gpus
                            d[key] = np.maximum(d.get(key, -np.inf), res)
    return out


def _simplex_duals(c: np.ndarray, A: np.ndarray, b: np.ndarray, tol: float = 1e-9,
                   max_pivots: int = 5000) -> np.ndarray:
    """The dual prices of ``max c . x, A x <= b, x >= 0`` (``b >= 0``) by the tableau simplex
    (the most negative reduced cost enters, ties to the lowest basis index). The caller
    checks what it takes from them: any prices make a valid certificate once made
    feasible."""
    m, n = A.shape
    tab = np.zeros((m + 1, n + m + 1))
    tab[:m, :n], tab[:m, n:n + m], tab[:m, -1] = A, np.eye(m), b
    tab[m, :n] = -c
    basis = list(range(n, n + m))
    for _ in range(max_pivots):
        j = int(np.argmin(tab[m, :-1]))
        if tab[m, j] >= -tol:
            break
        col = tab[:m, j]
        pos = col > tol
        if not pos.any():
            break   # unbounded: cannot happen with every column priced in GPUs
        ratio = np.where(pos, tab[:m, -1] / np.where(pos, col, 1.0), np.inf)
        ties = np.nonzero(ratio <= ratio.min() + tol)[0]
        i = int(min(ties, key=lambda k: basis[k]))
        tab[i] /= tab[i, j]
        for k in range(m + 1):
            if k != i and tab[k, j] != 0.0:
                tab[k] -= tab[k, j] * tab[i]
        basis[i] = j
    return tab[m, n:n + m].copy()


def interleaved_cover(values: dict, sizes: np.ndarray, ranks: int, ri: int, pi_i: int,
                      psi: float = 0.0, psi_i: int = 0) -> float:
    """The most ``pi . units`` ``ranks`` ranks of :func:`interleaved_values`'s kinds cover
    within the groups' GPUs (one first rank, one last, the rest middle; a rank may mix
    kinds of replicas, so the counts are fractions): the linear programme's value, as the
    dual objective at the simplex's prices (with each group's price made feasible from the
    rank prices, so the figure is an upper bound whatever the pivots' rounding); -inf
    where no first or no last rank fits."""
    kinds = []      # (role, group, GPUs, value) of every kind that fits
    for ti, role in enumerate(_ROLES):
        kinds += [(ti, gi, gpus, float(v[ri, pi_i, psi_i])) for gi, gd in enumerate(values[role])
                  for gpus, v in gd.items() if np.isfinite(v[ri, pi_i, psi_i])]
    if not any(k[0] == 1 for k in kinds) or not any(k[0] == 2 for k in kinds):
        return -math.inf
    G = len(sizes)
    role = np.array([k[0] for k in kinds])
    group = np.array([k[1] for k in kinds])
    gpus = np.array([k[2] for k in kinds])
    val = np.array([k[3] for k in kinds])
    # one first and one last rank: "at most one" each with a reward above anything their
    # GPUs could earn elsewhere, taken back from the rank prices below
    big = 10.0 * (float(np.max(gpus)) * float(np.max(np.abs(val) / gpus))
                  + float(np.max(np.abs(val)))) + 10.0
    A = np.zeros((G + 3, len(kinds)))
    A[group, np.arange(len(kinds))] = gpus
    A[G + role, np.arange(len(kinds))] = 1.0
    b = np.concatenate([sizes, [max(ranks - 2, 0), 1.0, 1.0]])
    y = _simplex_duals(val + big * (role > 0), A, b)
    mu = np.array([max(y[G], 0.0), y[G + 1] - big, y[G + 2] - big])
    lam = np.zeros(G)
    np.maximum.at(lam, group, (val - mu[role]) / gpus)
    return float(max(ranks - 2, 0) * mu[0] + mu[1] + mu[2] + sizes @ lam) + psi


FILL_PRICES = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0)
"""Rule 6's prices of the fill row, in units of the model's (any price is a valid
certificate; these are the ones tried)."""


def interleaved_ruled_out(cm: CostModel, gbs: int, mbs: int, T: float, sizes: np.ndarray,
                          hide_tp: bool = False) -> tuple[bool, tuple]:
    """Whether rule 6 rules out every interleaved plan of micro-batch ``mbs`` at ``T``:
    (True, ()) or (False, (chunks a rank, pipeline ranks, units covered beyond the
    model's)) for the first count of ranks it leaves."""
    from hapt_hf.core.schedules import interleaved_rounds
    M = gbs // mbs
    L = cm.model.num_layers
    types = unit_types(cm.model)
    counts = np.array([len(ix) for ix in types], dtype=float)
    w = np.linspace(0.0, 1.0, 5)
    pis = np.ones((1, 1)) if len(types) == 1 else \
        np.stack([w] + [1.0 - w] + [np.zeros_like(w)] * (len(types) - 2), axis=1)
    psis = float(counts.sum()) * np.asarray(FILL_PRICES)
    classes = [(v, True) for v in range(2, INTERLEAVED_LUMP)] + [(INTERLEAVED_LUMP, False)]
    for v, exact in classes:
        ranks = list(range(2, L // v + 1))
        if not ranks:
            continue
        firsts = [len(interleaved_rounds(p, M)[0]) for p in ranks]
        rs = sorted(set(firsts))
        values = interleaved_values(cm, gbs, mbs, T, rs, pis, psis, v, exact, hide_tp)
        for p, r in zip(ranks, firsts):
            gap = -math.inf
            for pi_i, pi in enumerate(pis):
                need = float(pi @ counts)
                for psi_i, psi in enumerate(psis):
                    cover = interleaved_cover(values, sizes, p, rs.index(r), pi_i, psi, psi_i)
                    if cover < need - 1e-9:
                        break
                    if psi_i == 0:
                        gap = max(gap, cover - need)
                else:
                    continue
                break
            else:
                return False, (v, p, float(gap))
    return True, ()


def interleaved_lower_bound_s(model: ModelSpec, cluster: Cluster, global_batch_size: int,
                              target: float, steps: int = 5, hide_tp: bool = False,
                              log=None) -> tuple[float, tuple[tuple[str, int, float], ...]]:
    """Rule 6's bound over every interleaved plan (``v >= 2`` chunks a rank; ``v = 1`` is
    1F1B's shape, under :func:`tp_lower_bound_s`): each layer unit and micro-batch size tested
    at ``target``, bisected below it where not ruled out. Returns the least lower end and
    (layer unit, micro-batch size, its lower end) of each."""
    from hapt_hf.planner.search import divisors
    gbs = global_batch_size
    sizes = np.array([g.size for g in cluster.groups], dtype=float)
    per = []
    for m in _layer_sequences(model):
        cm = CostModel(m, cluster)
        limit = gbs / float(_speeds(cm) @ sizes)
        for mbs in divisors(gbs):
            c0 = time.process_time()
            out, lo, hi, why = _bisect_below(
                lambda T, cm=cm, mbs=mbs: interleaved_ruled_out(cm, gbs, mbs, T, sizes, hide_tp),
                target, limit, steps)
            per.append((m.layer_unit, mbs, lo))
            if log:
                log(f"  interleaved, {m.layer_unit} units, micro-batch {mbs}: "
                    + (f"ruled out at {target:.3f} s" if out else
                       f"bound {lo:.3f} s (not ruled out at {hi:.3f} s: {why[0]} chunks, "
                       f"{why[1]} ranks cover {why[2]:.1f} units more than the model's)")
                    + f", {time.process_time() - c0:.1f} s CPU")
    return min(lo for _, _, lo in per), tuple(per)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.inputs import scenario_path
    from hapt_hf.planner.job import load_job
    from hapt_hf.planner.search import SearchProblem, physical_limit_s

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", help="a scenario name of benchmarks/scenarios (no .yaml)")
    ap.add_argument("--target", type=float, default=None,
                    help="seconds to test (default: 20%% above the physical limit)")
    ap.add_argument("--grid", type=int, default=8, help="shares and loads in steps of 1/grid")
    ap.add_argument("--steps", type=int, default=5, help="halvings of each bisection")
    ap.add_argument("--one-path", action="store_true",
                    help="where the prices do not rule a target out, search one path with "
                         "every group's GPUs counted (slower)")
    ap.add_argument("--what-if", action="store_true",
                    help="also with the tensor-parallel collectives hidden")
    ap.add_argument("--no-interleaved", action="store_true",
                    help="leave out rule 6 (interleaved plans): the bound then covers the "
                         "other kinds only")
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
        got = tp_lower_bound_s(job.model, job.cluster, gbs, target, args.grid,
                               steps=args.steps, hide_tp=hide, exact=args.one_path, log=print)
        verdict = ("no plan in scope reaches it: a certificate" if got.bound_s >= target
                   else "not ruled out")
        print(f"bound {got.bound_s:.3f} s ({got.bound_s / limit - 1:+.2%} above the limit; "
              f"{got.layer_unit} units, micro-batch {got.micro_batch_size}): {target:.3f} s "
              f"{verdict}; rho {got.rho:.4f}, beta {got.beta:.4f}, "
              f"{time.process_time() - c0:.1f} s CPU")
        print(f"its cheapest path ({len(got.stages)} stages: group [layers) share "
              "micro-batches held):")
        print("    " + "; ".join(f"{g} [{a},{b}) {u:.3f} {q}" for g, a, b, u, q in got.stages))
        if args.no_interleaved:
            continue
        c0 = time.process_time()
        inter, _ = interleaved_lower_bound_s(job.model, job.cluster, gbs, target, args.steps,
                                             hide_tp=hide, log=print)
        every = min(got.bound_s, inter)
        print(f"interleaved plans: bound {inter:.3f} s ({inter / limit - 1:+.2%}), "
              f"{time.process_time() - c0:.1f} s CPU")
        print(f"every plan: bound {every:.3f} s ({every / limit - 1:+.2%} above the limit): "
              f"{target:.3f} s "
              + ("ruled out for every kind" if every >= target else "not ruled out"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
