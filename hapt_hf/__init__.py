"""hapt_hf: heterogeneity-aware pipeline-parallel training for Hugging Face causal LMs.

Layers, imported one way (lowest first): ``hapt_hf.errors`` and ``hapt_hf.core`` (the error
root and the facts every side shares), ``hapt_hf.planner`` (pure planning, no torch),
``hapt_hf.pipeline`` (the runtime), ``hapt_hf.profiling`` (measures devices and links),
``hapt_hf.integration`` (accelerate, HaptTrainer, recipes) and ``hapt_hf.cli``; see
docs/architecture.md. Importing ``hapt_hf`` itself loads none of them, so the CLI and the
planner stay quick to start.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
