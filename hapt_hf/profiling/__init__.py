"""Measuring devices and links for the planner: builds real stages, opens process groups.

It sits above the pipeline (it times the very stages :func:`hapt_hf.pipeline.stage.build_stage`
builds) and below the integration layer; the planner reads what it measures as a
:class:`~hapt_hf.planner.profile.Profile` and never imports it.
"""
from hapt_hf.profiling.cli import cli_main
from hapt_hf.profiling.links import fit_link, measure_link
from hapt_hf.profiling.profiler import (LayerMemory, layer_memory, profile_group_leaders,
                                        profile_model, time_layer)
from hapt_hf.profiling.store import ProfilerError, ProfilerOptions, ProfileStore

__all__ = ["ProfilerError", "ProfilerOptions", "ProfileStore", "profile_model", "time_layer",
           "measure_link", "fit_link", "profile_group_leaders", "cli_main", "LayerMemory",
           "layer_memory"]
