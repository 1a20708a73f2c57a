"""The generic stage builder accepts exactly the verified model types, and docs/models.md says so."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hapt_hf.core.families import accepted_model_types, generic_matrix, verified_generic_types
from hapt_hf.pipeline.coverage import tiny_config
from hapt_hf.pipeline.stage import StageBuildError, build_stage

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("model_matrix", ROOT / "scripts" / "model_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_models_md_is_the_committed_matrix():
    assert (ROOT / "docs" / "models.md").read_text() == _script().markdown(generic_matrix())


def test_every_generic_type_the_suite_tests_is_verified():
    from tests.pipeline.test_generic_stage import GENERIC
    assert set(GENERIC) <= set(verified_generic_types())
    assert "xmod" not in accepted_model_types()


@pytest.mark.parametrize(("model_type", "reason"), [
    ("roc_bert", "no tiny config: 14M parameters"),
    ("reformer", "transformers' default config does not build: AssertionError"),
    ("xmod", "the generic builder does not fit: every layer picks a language adapter"),
])
def test_unverified_type_is_refused_with_its_reason_and_the_check(model_type, reason):
    with pytest.raises(StageBuildError, match=f"'{model_type}' is not supported \\(not verified: {reason}"
                       f".*model_matrix.py --type {model_type}"):
        build_stage(tiny_config(model_type, blocks=2), (0, 2), attn_implementation="eager")


def test_verified_type_builds():
    stage = build_stage(tiny_config("qwen3", blocks=2), (0, 2))
    assert stage.is_first and sum(p.numel() for p in stage.parameters()) > 0
