"""Pipeline execution: stages, the runtime that runs a plan's schedule, and its transfers."""
from hapt_hf.pipeline.failure import PipelineFailure
from hapt_hf.pipeline.loss_scale import DynamicLossScaler
from hapt_hf.pipeline.process_group import init_distributed
from hapt_hf.pipeline.runtime import PipelineRuntime
from hapt_hf.pipeline.runtime_types import Batch, Prediction, RuntimeConfig, StepResult
from hapt_hf.pipeline.stage import PipelineStage, StageBuildError, build_stage, supported_families

__all__ = ["Batch", "PipelineRuntime", "RuntimeConfig", "StepResult", "Prediction",
           "PipelineFailure", "init_distributed", "build_stage",
           "PipelineStage", "StageBuildError", "supported_families", "DynamicLossScaler"]
