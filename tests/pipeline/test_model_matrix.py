"""The generic stage builder accepts exactly the verified model types, and docs/models.md says so."""
from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest

from hapt_hf.core.families import (VERIFIED_STATUSES, accepted_model_types, generic_matrix,
                                   verified_generic_types)
from benchmarks.chain_check import tiny_config
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


def _without_balanced_routing(monkeypatch):
    """The reader as it was before it routed data-less tokens: DBRX's experts cannot be read."""
    import contextlib
    monkeypatch.setattr("hapt_hf.profiling.model_reader.balanced_routing",
                        lambda fake=False: contextlib.nullcontext())


def test_a_type_the_reader_cannot_read_is_not_verified(monkeypatch):
    script = _script()
    assert script.classify("dbrx")[0] == "tested"  # the chain and the read pass
    _without_balanced_routing(monkeypatch)
    status, detail = script.classify("dbrx")  # the same chain, the read fails
    assert status == script.NOT_READ and status not in VERIFIED_STATUSES
    assert detail.startswith("NotImplementedError") and "nonzero" in detail


def _refused_in_the_matrix(monkeypatch, model_type: str, status: str, detail: str) -> None:
    matrix = copy.deepcopy(generic_matrix())
    matrix["types"][model_type] = {"status": status, "detail": detail}
    monkeypatch.setattr("hapt_hf.core.families.generic_matrix", lambda: matrix)


def test_a_type_the_reader_cannot_read_is_refused_by_the_builder_and_the_planner(
        monkeypatch, tmp_path, capsys):
    from hapt_hf.cli import main
    status = _script().NOT_READ
    _refused_in_the_matrix(monkeypatch, "dbrx", status, "NotImplementedError: nonzero on meta")
    config = tiny_config("dbrx", blocks=2)
    why = f"'dbrx' is not supported \\({status}: NotImplementedError: nonzero on meta"
    with pytest.raises(StageBuildError, match=why):
        build_stage(config, (0, 2))
    config.save_pretrained(tmp_path / "model")
    code = main(["plan", "--model", str(tmp_path / "model"), "--seq-len", "32",
                 "--global-batch", "8"])
    out, err = capsys.readouterr()
    assert code != 0 and re.search(why, err) and "model_matrix.py --type dbrx" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
