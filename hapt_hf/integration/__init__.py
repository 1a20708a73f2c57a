"""The way people use hapt_hf: ``accelerate launch`` + a hapt config, HaptTrainer, the recipes."""
from hapt_hf.integration.config import HaptConfig, HaptConfigError, HaptPlugin
from hapt_hf.integration.launch import LaunchEnv, LaunchError, read_launch_env
from hapt_hf.integration.plan_resolution import resolve_plan
from hapt_hf.integration.trainer import HaptTrainer

__all__ = ["HaptPlugin", "HaptConfig", "HaptConfigError", "LaunchEnv", "LaunchError",
           "read_launch_env", "resolve_plan", "HaptTrainer"]
