"""What more search effort, the other layer unit, or a local search under zero_bubble find.

    python3 benchmarks/search_effort.py [SCENARIO] [--only NAME...]

Plans one scenario (default ``scale_llama70b_mixed256``) several ways and prints each plan's
simulated iteration time, its CPU seconds, its stages and degrees:

* ``default``: ``plan_job`` as ``benchmarks/planner.py`` runs it;
* ``full``: every degree assignment searched in full (``weigh_groups_max_gpus`` above the
  cluster, so the screen's shortened search is not the one kept);
* ``budget``: ``full`` with every search budget raised (expansions x4, patience x4, replays x2,
  boundary refinements x4, degree screens x2, stage-degree rounds x2);
* ``half``: stages cut between half blocks only (``layer_unit="half"``);
* ``sp_half`` (a what-if, not a plan the runtime runs): ``half`` with sequence parallelism
  allowed on half-block stages, which the runtime refuses (``core/tp.sp_refusal``); the rule
  is lifted in this process only;
* ``local``: from the default plan, every one-layer move of one boundary or of a whole stage
  and every warm-up one deeper or shallower, each with its ``zero_bubble`` deferrals refit to
  memory (``fitting_deferrals``) and replayed in full, kept while the replay improves;
* ``tp_comm`` (what-ifs, not costs the runtime has: its tensor-parallel collectives are not
  overlapped with compute): the default search with a fraction of every tensor-parallel
  collective's time left exposed (the blocks' all-reduces, sequence parallelism's
  all-gathers, the split head's loss collectives; ``--comm-fractions``, the rest taken as
  hidden behind compute, as an overlapped all-gather/reduce-scatter with the projections
  would hide it), and all of it hidden on the NVLink-class groups only (an intra-node link of
  at least ``NVLINK_GBPS``), the others' exposed;
* ``dist_optimizer`` (a what-if): the default search with Megatron-LM's distributed
  optimizer's memory, where the runtime keeps fp32 weights and gradients on every replica and
  autocast's 16-bit copies once a step: 16-bit weights and gradients, the fp32 master weights
  and Adam's moments sharded over the stage's replicas where its state is sharded (whole where
  replicated), no 16-bit copies; alone and with every tensor-parallel collective hidden;
* ``interleaved``: the default plan's pipeline ranks interleaved at 2 and 3 chunks a rank,
  each rank's first chunk 20% to 80% of its layers (``Plan.interleave(chunk_layers=...)``,
  where the planner weighs even cuts only), its early chunks recomputing or not, each
  replayed in full; the fastest that fits and the fastest whether or not memory holds it.

Plans with no baselines (they do not change the plan).
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.inputs import SCENARIOS_DIR  # noqa: E402
from hapt_hf.planner.job import load_job  # noqa: E402
from hapt_hf.planner.search import PlannerOptions, plan_job  # noqa: E402

VARIANTS = ("default", "full", "budget", "half", "sp_half", "local", "interleaved", "tp_comm",
            "dist_optimizer")
COMM_FRACTIONS = (0.75, 0.5, 0.25, 0.0)
NVLINK_GBPS = 1000.0
"""An intra-node link from this bandwidth up counts as NVLink-class in the ``tp_comm`` rows."""
TP_COMM = ("tp_allreduce_s", "sp_edge_s", "sp_regather_s", "head_comm_s")
"""The cost model's methods that price a tensor-parallel collective (each group's own; the
all-gathers of sequence parallelism come through the two ``sp_`` ones)."""


def _options(name: str, world: int) -> PlannerOptions:
    base = PlannerOptions(include_baselines=False)
    full = dict(weigh_groups_max_gpus=world + 1)
    if name == "full":
        return replace(base, **full)
    if name == "budget":
        o = base
        return replace(o, **full, max_expansions=4 * o.max_expansions, patience=4 * o.patience,
                       simulate_top=2 * o.simulate_top,
                       max_refine_simulations=4 * o.max_refine_simulations,
                       tp_screens=2 * o.tp_screens, tp_stage_rounds=2 * o.tp_stage_rounds)
    if name in ("half", "sp_half"):
        return replace(base, layer_unit="half")
    return base


def _lift_sp_rule() -> None:
    """Let the cost model price sequence parallelism on half-block stages (a what-if)."""
    import hapt_hf.planner.cost_model as cost_model
    from hapt_hf.core.layers import BLOCK
    from hapt_hf.core.tp import sp_refusal

    def whole_blocks(model_type, tp_plan, t, layer_unit=BLOCK):
        return sp_refusal(model_type, tp_plan, t, BLOCK)
    cost_model.sp_refusal = whole_blocks


@contextmanager
def tp_comm_exposed(fraction: float, only_below_gbps: float | None = None):
    """In this block, every tensor-parallel collective the cost model prices takes
    ``fraction`` of its time (a what-if: the rest hidden behind compute); with
    ``only_below_gbps``, the groups whose intra-node link is at least that fast take
    ``fraction``, the others all of it."""
    from hapt_hf.planner.cost_model import CostModel

    saved = {n: getattr(CostModel, n) for n in TP_COMM}

    def scaled(orig):
        def priced(self, group, *args):
            t = orig(self, group, *args)
            if only_below_gbps is not None and group.intra_node.bandwidth_gbps < only_below_gbps:
                return t
            return tuple(x * fraction for x in t) if isinstance(t, tuple) else t * fraction
        return priced
    try:
        for n, orig in saved.items():
            setattr(CostModel, n, scaled(orig))
        yield
    finally:
        for n, orig in saved.items():
            setattr(CostModel, n, orig)


@contextmanager
def distributed_optimizer_memory():
    """In this block the cost model prices a stage's training state as Megatron-LM's
    distributed optimizer keeps it (a what-if; see the module's doc)."""
    import hapt_hf.planner.cost_model as cost_model
    from hapt_hf.core.precision import ADAM_STATE_BYTES, DTYPE_BYTES, MASTER_BYTES, SHARDED

    def per_param(optimizer: str, replicas: int) -> float:
        fp32 = MASTER_BYTES + ADAM_STATE_BYTES  # the master weights and Adam's moments
        weight_and_grad = 2 * DTYPE_BYTES["bf16"]
        return weight_and_grad + (fp32 / max(1, replicas) if optimizer == SHARDED else fp32)
    saved = cost_model.state_bytes_per_param, cost_model.CostModel.weight_copy_bytes
    try:
        cost_model.state_bytes_per_param = per_param
        cost_model.CostModel.weight_copy_bytes = lambda self, *args, **kw: 0.0
        yield
    finally:
        cost_model.state_bytes_per_param, cost_model.CostModel.weight_copy_bytes = saved


def local_search(job, plan, budget: int = 400):
    """(first, best) replay times of the local search from ``plan`` (see the module's doc),
    the layout kept and the replays run."""
    from hapt_hf.planner.cost_model import CostModel
    from hapt_hf.planner.search.kinds import replay_kind, zero_bubble_layout
    from hapt_hf.planner.search.plans import layout_of_plan
    from hapt_hf.planner.search.problem import SearchProblem
    from hapt_hf.planner.search.refine import _moves, moved_layout

    cm = CostModel(job.model.with_layer_unit(plan.layer_unit), job.cluster, job.profile)
    problem = SearchProblem(cm, job.global_batch_size, PlannerOptions())
    m = plan.num_microbatches
    best = layout_of_plan(cm, plan)
    best_r = replay_kind(cm, best, m)
    first, runs, improved = best_r.iteration_s, 0, True
    while improved and runs < budget:
        improved = False
        moves = [("bounds", idx, d) for idx, d in _moves(best.num_stages)]
        moves += [("warmup", i, d) for i in range(best.num_stages) for d in (-1, 1)]
        for what, idx, d in moves:
            if runs >= budget:
                break
            if what == "bounds":
                cand = moved_layout(problem, best, idx, d, best_r.peak_in_flight or best.warmups)
                if cand is None:
                    continue
            else:
                warm = list(best.warmups)
                warm[idx] += d
                if warm[idx] < 1:
                    continue
                cand = best.with_warmups(tuple(warm))
            cand = zero_bubble_layout(cm, replace(cand, schedule="h1f1b"), m)
            runs += 1
            r = replay_kind(cm, cand, m)
            if r.feasible and r.iteration_s < best_r.iteration_s * (1 - 1e-9):
                best, best_r, improved = cand, r, True
    return first, best_r.iteration_s, best, runs


FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def interleaved_splits(job, plan, virtuals=(2, 3), fractions=FRACTIONS):
    """The plan's pipeline ranks (one stage each) interleaved at each of ``virtuals`` chunks,
    each rank's first chunk ``fraction`` of its layers (the rest cut evenly), its early chunks
    recomputing or not; each replayed in full. Rows ``(v, fraction, recompute, fits, s)``:
    ``s`` the replay's iteration time whether or not the ranks' memory holds it (``fits``)."""
    from hapt_hf.errors import PlanError
    from hapt_hf.planner.cost_model import CostModel
    from hapt_hf.planner.search.kinds import replay_kind
    from hapt_hf.planner.search.options import Layout

    cm = CostModel(job.model.with_layer_unit(plan.layer_unit), job.cluster, job.profile)
    m, rows = plan.num_microbatches, []
    for v in virtuals:
        for fr in fractions:
            chunks = []
            for s in plan.stages:
                n = s.num_layers
                first = min(max(1, round(n * fr)), n - (v - 1))
                rest = [(n - first) // (v - 1) + (1 if c < (n - first) % (v - 1) else 0)
                        for c in range(v - 1)]
                chunks.append([first, *rest])
            try:
                inter = plan.interleave(v, chunk_layers=chunks)
            except PlanError:
                continue  # a rank holds fewer layers than chunks
            for rc in (False, True):
                stages = tuple(replace(st, recompute=rc and st.index < (v - 1) * plan.num_stages,
                                       recompute_layers=0) for st in inter.stages)
                r = replay_kind(cm, Layout(stages, plan.micro_batch_size, inter.schedule), m)
                rows.append((v, fr, rc, r.feasible, r.iteration_s))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", nargs="?", default="scale_llama70b_mixed256")
    ap.add_argument("--only", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--comm-fractions", nargs="*", type=float, default=list(COMM_FRACTIONS),
                    help="the tp_comm rows' exposed fractions of the collectives' time")
    args = ap.parse_args(argv)
    job = load_job(SCENARIOS_DIR / f"{args.scenario}.yaml")
    default_plan = None
    for name in args.only:
        c0 = time.process_time()
        if name in ("local", "interleaved"):
            if default_plan is None:
                default_plan = plan_job(job.model, job.cluster, job.global_batch_size,
                                        job.profile, _options("default", 0)).plan
                c0 = time.process_time()
        if name == "interleaved":
            rows = interleaved_splits(job, default_plan)
            fit = [r for r in rows if r[3]]
            best_fit = min(fit, key=lambda r: r[4]) if fit else None
            best_any = min(rows, key=lambda r: r[4]) if rows else None
            print(f"interleaved: {len(rows)} replays ({time.process_time() - c0:.1f} s CPU), "
                  f"{len(fit)} fit; fastest that fits: {_row(best_fit)}; fastest whether or not "
                  f"memory holds it: {_row(best_any)}", flush=True)
            for r in rows:
                print(f"  {_row(r)}", flush=True)
            continue
        if name == "local":
            first, best, lay, runs = local_search(job, default_plan)
            print(f"local: {first:.3f} s -> {best:.3f} s after {runs} replays "
                  f"({time.process_time() - c0:.1f} s CPU); layers "
                  f"{[s.layers for s in lay.stages]}, warm-ups {list(lay.warmups)}", flush=True)
            continue
        if name == "tp_comm":
            for f in args.comm_fractions:
                _what_if(job, f"tp_comm, {f:g} of it exposed on every group", tp_comm_exposed(f))
            _what_if(job, f"tp_comm, hidden on the groups of an intra-node link from "
                     f"{NVLINK_GBPS:g} Gb/s, exposed on the others",
                     tp_comm_exposed(0.0, NVLINK_GBPS))
            continue
        if name == "dist_optimizer":
            _what_if(job, "dist_optimizer, alone", distributed_optimizer_memory())
            _what_if(job, "dist_optimizer, with every tensor-parallel collective hidden",
                     distributed_optimizer_memory(), tp_comm_exposed(0.0))
            continue
        if name == "sp_half":
            _lift_sp_rule()
        res = plan_job(job.model, job.cluster, job.global_batch_size, job.profile,
                       _options(name, job.cluster.world_size))
        p = res.plan
        if name == "default":
            default_plan = p
        print(f"{name}: {res.sim.iteration_s:.3f} s ({time.process_time() - c0:.1f} s CPU), "
              f"{_stages(p)}", flush=True)
    return 0


def _what_if(job, label: str, *what_ifs) -> None:
    """Plan ``job`` with the default options inside every context of ``what_ifs`` and print
    its line."""
    c0 = time.process_time()
    with ExitStack() as stack:
        for w in what_ifs:
            stack.enter_context(w)
        res = plan_job(job.model, job.cluster, job.global_batch_size, job.profile,
                       _options("default", 0))
    print(f"{label}: {res.sim.iteration_s:.3f} s, "
          f"{res.sim.iteration_s / res.physical_limit_s - 1:.1%} above the limit "
          f"({time.process_time() - c0:.1f} s CPU); {_stages(res.plan)}", flush=True)


def _stages(p) -> str:
    stages = ", ".join(f"{s.replicas[0].group} t{s.tp}{' sp' if s.sequence_parallel else ''}"
                       f" {s.layers[1] - s.layers[0]}" for s in p.stages)
    return (f"{p.num_stages} stages, micro-batch {p.micro_batch_size}, {p.schedule}, "
            f"layer unit {p.layer_unit}: {stages}")


def _row(r) -> str:
    if r is None:
        return "none"
    v, fr, rc, fits, t = r
    return (f"{t:.3f} s (v={v}, first chunk {fr:.0%}, early chunks "
            f"{'recomputing' if rc else 'kept'}{'' if fits else ', does not fit'})")


if __name__ == "__main__":
    sys.exit(main())
