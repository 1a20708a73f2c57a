"""Planning: model and cluster descriptions in, a validated Plan and its schedule out.

Nothing here imports torch, the pipeline or the profiler (:mod:`hapt_hf.profiling` measures
devices and is imported by nobody below it), so planning a job needs no devices and no process
group. Every error a user can cause is a :class:`hapt_hf.errors.HaptError` whose message names
the field and the fix.
"""
from hapt_hf.planner.cluster import Cluster, ClusterError
from hapt_hf.planner.cost_model import CostModelError
from hapt_hf.planner.model_spec import ModelSpec, ModelSpecError
from hapt_hf.planner.plan import Plan, PlanError, Replica, Stage
from hapt_hf.planner.profile import Profile, ProfileError, load_sailor_profiles
from hapt_hf.planner.schedule import Schedule, ScheduleError, build_schedule
from hapt_hf.planner.search import PlannerOptions, PlanningError, PlanResult, plan_job
from hapt_hf.planner.simulate import SimResult, simulate_plan

__all__ = [
    # inputs
    "ModelSpec", "Cluster", "Profile", "load_sailor_profiles",
    # planning and its result
    "PlannerOptions", "plan_job", "PlanResult", "Plan", "Stage", "Replica",
    # schedule and simulation
    "Schedule", "build_schedule", "simulate_plan", "SimResult",
    # errors (all hapt_hf.errors.HaptError, a ValueError)
    "ModelSpecError", "ClusterError", "ProfileError", "PlanError", "ScheduleError",
    "PlanningError", "CostModelError",
]
