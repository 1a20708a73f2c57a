"""The model families hapt_hf describes (planner) and cuts into stages (pipeline): one list."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from hapt_hf.core.data import DATA_DIR

__all__ = ["Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "MATRIX_FILE", "VERIFIED_STATUSES",
           "family", "family_of", "generic_matrix", "verified_generic_types", "unverified_reason",
           "generic_refusal",
           "accepted_model_types"]


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
    Family("opt", ("opt",), halvable=True),
)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str) -> Family | None:
    """The family covering ``model_type``, or None (the caller raises with the fix)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family(name: str) -> Family:
    """The family shape called ``name`` ('gpt2', 'llama', 'opt')."""
    return next(f for f in FAMILIES if f.name == name)


MATRIX_FILE = DATA_DIR / "model_matrix.json"
"""Written by scripts/model_matrix.py from its chain check: per model type, a status and why,
with the transformers version it ran on. The generic stage builder accepts only verified types."""
VERIFIED_STATUSES = ("tested", "works")
"""Statuses whose 2-stage chain matched the full model (logits, loss, every gradient)."""
_CHECK_HINT = "python3 scripts/model_matrix.py --type {t}"


@lru_cache(maxsize=1)
def generic_matrix() -> dict:
    """The committed matrix: ``{"transformers": version, "types": {type: {status, detail}}}``."""
    return json.loads(MATRIX_FILE.read_text())


def verified_generic_types() -> tuple[str, ...]:
    """Model types without a hand-written family whose chain check passed."""
    types = generic_matrix()["types"]
    return tuple(t for t in sorted(types) if types[t]["status"] in VERIFIED_STATUSES
                 and family_of(t) is None)


def accepted_model_types() -> tuple[str, ...]:
    """Every model type a stage (and a ModelSpec) can be built for."""
    return SUPPORTED_MODEL_TYPES + verified_generic_types()


def unverified_reason(model_type: str) -> str | None:
    """The matrix's status and detail of ``model_type`` in words, or None where it is verified."""
    entry = generic_matrix()["types"].get(model_type)
    if entry is None:
        return "it was not in transformers' causal-LM mapping when the list was made"
    if entry["status"] in VERIFIED_STATUSES:
        return None
    return f"{entry['status']}: {entry['detail']}"


def generic_refusal(model_type: str) -> str | None:
    """Why the generic builder refuses ``model_type`` (one message with the way to check it), or
    None where it is verified."""
    matrix = generic_matrix()
    why = unverified_reason(model_type)
    if why is None:
        return None
    return (f"config.model_type {model_type!r} is not supported ({why}; docs/models.md, checked on "
            f"transformers {matrix['transformers']}). Stages are built for {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"and the {len(verified_generic_types())} types whose chain of stages matched the full model "
            f"(docs/models.md); to check this type on your transformers run "
            f"`{_CHECK_HINT.format(t=model_type)}`")
