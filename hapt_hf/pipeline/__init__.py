"""Pipeline execution: stages, the runtime that runs a plan's schedule, and its transfers."""
from hapt_hf.pipeline.comm import PipelineFailure
from hapt_hf.pipeline.runtime import (Batch, PipelineRuntime, RuntimeConfig, StepResult,
                                      init_distributed)

__all__ = ["Batch", "PipelineRuntime", "RuntimeConfig", "StepResult", "PipelineFailure",
           "init_distributed"]
