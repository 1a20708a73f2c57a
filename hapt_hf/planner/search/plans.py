"""Between the search's layouts and Plans, and the physical limit every plan is measured by."""
from __future__ import annotations

from dataclasses import replace

from hapt_hf.core.precision import Precision

from ..cluster import Cluster
from ..cost_model import CostModel
from ..model_spec import ModelSpec
from ..plan import Plan, PlanPrediction, StagePrediction
from ..profile import Profile, load_sailor_profiles
from ..simulate import SimResult
from .options import Layout
from .problem import SearchProblem

__all__ = ["layout_to_plan", "layout_of_plan", "physical_limit_s", "cluster_profile"]


def layout_to_plan(problem: SearchProblem, layout: Layout, sim: SimResult | None,
                   baselines: dict[str, float] | None = None) -> Plan:
    """The plan of ``layout``'s stages, each with its predicted times and peak memory."""
    cm, mbs = problem.cost_model, layout.micro_batch_size
    costs = cm.stage_costs(layout.stages, mbs)
    stages = []
    for i, (s, c) in enumerate(zip(layout.stages, costs.stages)):
        peak = sim.peak_memory_bytes[i] if sim and sim.peak_memory_bytes else 0.0
        stages.append(replace(s, index=i, optimizer=c.optimizer,
                              predicted=StagePrediction(c.forward_s, c.backward_s, peak)))
    m = cm.model
    pred = PlanPrediction()
    if sim is not None and sim.feasible:
        pred = PlanPrediction(sim.iteration_s,
                              problem.global_batch_size * m.seq_len / sim.iteration_s,
                              sim.bubble_fraction)
    return Plan(model_name=m.name, num_layers=m.num_layers, seq_len=m.seq_len,
                global_batch_size=problem.global_batch_size, micro_batch_size=mbs,
                num_microbatches=problem.num_microbatches(mbs), schedule=layout.schedule,
                stages=tuple(stages), dtype=m.dtype, predicted=pred,
                attn_implementation=m.attn_implementation,
                loss_scaling=Precision.of(m.dtype).loss_scaling,
                cluster_name=cm.cluster.name, baselines=dict(baselines or {}),
                layer_unit=m.layer_unit)


def layout_of_plan(cm: CostModel, plan: Plan) -> Layout:
    """The plan's stages as a layout (ranks numbered as ``cm`` numbers them)."""
    return Layout(cm.stages_of(plan), plan.micro_batch_size, plan.schedule)


def physical_limit_s(problem: SearchProblem) -> float:
    """Global batch x (forward + backward time per sample) over the sum of all GPUs' speeds.

    A GPU's speed is samples per second through the whole model at its best per-replica batch:
    analytic figures do not depend on the batch; with a profile, the best of the batch sizes it
    measured for that device (and 1). Every GPU counts alone, as one rank computing whole
    layers, whatever tensor-parallel degrees the search weighs: splitting a layer among GPUs
    never makes them faster than that (their time at degree ``t`` is at best ``1/t``)."""
    cm = problem.cost_model
    rate = 0.0
    for g in cm.hardware.groups:
        sizes = {1}
        if cm.profile is not None:
            sizes.update(cm.profile.micro_batches(g.gpu.name))
        rate += g.size / cm.best_sample_time_s(g, sorted(sizes))
    return problem.global_batch_size / rate


def cluster_profile(cluster: Cluster, model: ModelSpec) -> Profile | None:
    """The measured profiles a cluster file names (``profiles:``), or None."""
    if cluster.profiles is None:
        return None
    return load_sailor_profiles(cluster.profiles, model)
