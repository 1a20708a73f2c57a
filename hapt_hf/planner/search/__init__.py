"""The planner's search: group order, stage shapes, layer ranges, micro-batch, warm-ups.

How it searches (every step deterministic):

1. Candidate *shapes*: for every group, every number of stages ``k`` it can be cut into, with
   widths as equal as the global batch allows (any integer, not only powers of two), and every
   micro-batch size that is a multiple of all widths and divides the global batch.
2. Each (shapes, micro-batch) gets an optimistic bound ``(M + n - 1) * T_bal``, where ``T_bal``
   is the per-micro-batch time if every stage were perfectly balanced. Candidates are expanded in
   order of that bound and the expansion stops once the bound passes the best estimate found.
3. Expanding a candidate tries every order of the groups along the pipeline whose neighbours are
   linked, and cuts the layers by a min-max partition: a binary search on the cap of a stage's
   time, with a greedy that gives each stage the longest range within the cap and its GPUs'
   memory (switching on recompute when only that fits). The result is scored with HAPT's
   formula ``sum(stage) + (M - 1) * max(stage, cut)``.
4. The best few are replayed in the event simulator; for H-1F1B their warm-up depths start from
   HAPT's 1/2/3 thresholds and are refined one slow link at a time by simulation; then the layer
   boundaries of the best plan are moved one layer at a time while the simulation improves.
5. Stages that mix groups (:mod:`~hapt_hf.planner.search.mixed`): the best pipeline with its
   group boundaries merged, and layouts whose every stage takes a slice of every group, each
   GPU's share by its speed; kept only when the simulator finds them faster.
6. The baselines' plans (:mod:`~hapt_hf.planner.search.baselines`) are candidates too, so the
   planner never returns a slower plan.

One module per step: ``options`` (settings and records), ``shapes``, ``partition``, ``warmups``,
``replays``, ``candidates``, ``refine``, ``mixed``, ``baselines``, ``infeasible`` (the message when
nothing fits) and ``driver`` (:func:`plan_job`). The exhaustive yardstick
(``benchmarks/exhaustive.py``, a test yardstick) builds on the public helpers re-exported here.

Simulations inside the search cap the number of micro-batches and extrapolate the steady state
linearly (see :func:`~hapt_hf.planner.search.replays.simulate_layout`); the returned plan is
always replayed in full.
"""
from hapt_hf.errors import PlanningError

from .baselines import BASELINES, baseline_plans
from .driver import plan_job
from .options import LAYER_UNIT_OPTIONS, BaselineResult, Layout, PlannerOptions, PlanResult
from .partition import estimate_s, partition_layers, recompute_flags
from .plans import cluster_profile, layout_of_plan, layout_to_plan, physical_limit_s
from .replays import STEADY_MIN_MICROBATCHES, simulate_layout
from .shapes import (compositions, divisors, group_cuts, group_orders, micro_batch_options,
                     shapes_for, width_options)
from .warmups import hapt_warmups

__all__ = ["PlanningError", "PlannerOptions", "BaselineResult", "PlanResult", "Layout",
           "plan_job", "physical_limit_s", "cluster_profile", "BASELINES", "baseline_plans",
           "LAYER_UNIT_OPTIONS", "STEADY_MIN_MICROBATCHES", "estimate_s", "partition_layers",
           "recompute_flags", "layout_of_plan", "layout_to_plan", "simulate_layout", "divisors",
           "compositions", "group_cuts", "group_orders", "micro_batch_options", "shapes_for",
           "width_options", "hapt_warmups"]
