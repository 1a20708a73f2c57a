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
7. Tensor parallelism (:mod:`~hapt_hf.planner.search.tensor_parallel`): the steps above run
   again with each group's replicas of ``t`` GPUs of one node seen as one GPU, for a few
   assignments of degrees per group; a degree above 1 is kept where the simulator finds it
   faster, or where nothing fits without.

Every step takes one :class:`~hapt_hf.planner.search.problem.SearchProblem`: the cost model
(model and cluster), the global batch size and the options, derived on a set of groups or on
another layer sequence where the driver needs one. The modules:

* ``options``: the settings (:class:`PlannerOptions`) and records (:class:`Layout`,
  :class:`PlanResult`, :class:`BaselineResult`, ``GroupChoice``);
* ``problem``: :class:`SearchProblem`;
* ``shapes``: stage widths per group, group orders, micro-batch sizes, each stage's replicas;
* ``partition``: the min-max layer partition under memory and HAPT's formula that scores it;
* ``state``: each stage's optimizer state, replicated or sharded (ZeRO-1), and why;
* ``warmups``: HAPT's warm-up thresholds and their refinement by simulation;
* ``replays``: a layout replayed in the simulator, shortened where that is exact enough;
* ``candidates``: the analytic search over shapes in order of their bound (steps 1 to 3);
* ``refine``: layer boundaries moved by simulation, a baseline under the planner's schedule;
* ``mixed``: stages that mix groups (merged boundaries, columns);
* ``data_parallel``: one stage over every GPU, shares by speed or equal;
* ``baselines``: the splits other systems make;
* ``infeasible``: the message when nothing fits, with what would fit;
* ``plans``: layouts to plans and back, and the physical limit;
* ``subsets``: which groups to use (sets of groups with the others idle);
* ``tensor_parallel``: each group's tensor-parallel degree (the screen of assignments);
* ``driver``: :func:`plan_job`, the whole search.

The exhaustive yardstick (``benchmarks/exhaustive.py``, a test yardstick) builds on the public
helpers re-exported here.

Simulations inside the search cap the number of micro-batches and extrapolate the steady state
linearly (see :func:`~hapt_hf.planner.search.replays.simulate_layout`); the returned plan is
always replayed in full.
"""
from hapt_hf.errors import PlanningError

from .baselines import BASELINES, baseline_plans
from .driver import plan_job
from .options import BaselineResult, Layout, PlannerOptions, PlanResult
from .partition import recompute_flags
from .plans import cluster_profile, layout_of_plan, layout_to_plan, physical_limit_s
from .problem import SearchProblem
from .replays import simulate_layout
from .shapes import compositions, divisors, group_cuts, group_orders, shapes_for, width_options

__all__ = [
    # planning a job
    "plan_job", "PlannerOptions", "PlanResult", "PlanningError", "SearchProblem",
    "physical_limit_s", "cluster_profile",
    # the baselines
    "BASELINES", "baseline_plans", "BaselineResult",
    # layouts, for the yardsticks and tests that build their own
    "Layout", "layout_of_plan", "layout_to_plan", "simulate_layout", "recompute_flags",
    "divisors", "compositions", "group_cuts", "group_orders", "shapes_for", "width_options",
]
