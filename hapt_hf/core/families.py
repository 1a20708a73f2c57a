"""The model families hapt_hf describes (planner) and cuts into stages (pipeline): one list."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "family", "family_of"]


@dataclass(frozen=True)
class Family:
    """One family shape: models whose modules sit alike and run alike."""

    name: str
    model_types: tuple[str, ...]
    """Every ``config.model_type`` of this shape."""
    halvable: bool
    """Whether a block can be cut exactly into an attention half and an MLP half."""


FAMILIES = (
    Family("gpt2", ("gpt2",), halvable=True),
    Family("llama", ("llama", "mistral", "qwen2"), halvable=True),
    # OPT places its norms before or after the residual (do_layer_norm_before): not cut in two
    Family("opt", ("opt",), halvable=False),
)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str) -> Family | None:
    """The family covering ``model_type``, or None (the caller raises with the fix)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family(name: str) -> Family:
    """The family shape called ``name`` ('gpt2', 'llama', 'opt')."""
    return next(f for f in FAMILIES if f.name == name)
