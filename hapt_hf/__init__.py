"""hapt_hf: heterogeneity-aware pipeline-parallel training for Hugging Face causal LMs.

Subpackages, imported one way: ``hapt_hf.planner`` (pure planning, no torch at import),
``hapt_hf.pipeline`` (the runtime; imports the planner's data objects) and
``hapt_hf.integration`` (accelerate, HaptTrainer, recipes; imports both). Importing ``hapt_hf``
itself loads none of them, so the CLI and the planner stay quick to start.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
