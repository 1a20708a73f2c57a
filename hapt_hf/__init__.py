"""hapt_hf: heterogeneity-aware pipeline-parallel training for Hugging Face causal LMs.

Layers, imported one way (lowest first): ``hapt_hf.errors`` and ``hapt_hf.core`` (the error
root and the facts every side shares), ``hapt_hf.planner`` (pure planning, no torch),
``hapt_hf.pipeline`` (the runtime), ``hapt_hf.profiling`` (measures devices and links),
``hapt_hf.integration`` (accelerate, HaptTrainer, recipes) and ``hapt_hf.cli``; see
docs/architecture.md. Importing ``hapt_hf`` itself loads none of them, so the CLI and the
planner stay quick to start: ``from hapt_hf import HaptAccelerator, HaptTrainer, HaptConfig``
imports the integration layer (and torch) on first use of the name (PEP 562), and
``hapt_hf.model_spec(config_or_name, seq_len=...)`` (a model's figures, read off the model for
every accepted type: :func:`hapt_hf.profiling.model_figures.model_spec`) the profiling layer.
"""

__version__ = "0.1.0"

__all__ = ["HaptAccelerator", "HaptTrainer", "HaptConfig", "model_spec", "__version__"]

_LAZY = ("HaptAccelerator", "HaptTrainer", "HaptConfig", "model_spec")
"""The names re-exported from the layers above the planner, imported on first use."""


def __getattr__(name: str):
    # The root package stands outside the layers of docs/architecture.md: it re-exports the
    # entry points of the integration and profiling layers, and imports them only when asked
    # for (import-linter sees these).
    if name == "HaptAccelerator":
        from hapt_hf.integration.accelerate_plugin import HaptAccelerator as value
    elif name == "HaptTrainer":
        from hapt_hf.integration.trainer import HaptTrainer as value
    elif name == "HaptConfig":
        from hapt_hf.integration.config import HaptConfig as value
    elif name == "model_spec":
        from hapt_hf.profiling.model_figures import model_spec as value
    else:
        raise AttributeError(f"module 'hapt_hf' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
