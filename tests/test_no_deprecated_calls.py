"""hapt_hf's own calls into torch and transformers raise no FutureWarning or DeprecationWarning.

Such a warning is reported where the deprecated call lands, which may be inside transformers (a
block's forward handed a renamed argument by a stage): so every warning of the two kinds is made
an error while hapt_hf's code runs, and the traceback shows the hapt_hf frame that made the call.
Modules are imported first: some of torch's own modules warn as they load (``torch.jit.script``
in ``torch.distributed.optim``), which no call hapt_hf makes can change.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest

import hapt_hf.pipeline  # noqa: F401  (torch's import-time warnings, before the check)
import hapt_hf.profiling.model_reader  # noqa: F401
from hapt_hf.cli import main
from benchmarks.chain_check import chain_ranges, check_chain, tiny_config


@contextmanager
def _deprecations_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_check_turns_a_deprecation_into_an_error():
    with _deprecations_are_errors(), pytest.raises(FutureWarning):
        warnings.warn("renamed", FutureWarning, stacklevel=1)


# the hand-written families (masks built by hapt_hf, blocks and halves called by it) and
# generic types (run through the model's own forward), full and sliding-window masks
@pytest.mark.parametrize(("model_type", "layer_unit"), [
    ("gpt2", "half"), ("llama", "half"), ("mistral", "block"), ("opt", "half"), ("qwen3", "half"),
    ("gemma3_text", "block")])
def test_stage_forward_and_backward_call_nothing_deprecated(model_type, layer_unit):
    config = tiny_config(model_type, blocks=2)
    with _deprecations_are_errors():
        result = check_chain(config, chain_ranges(2, 2, layer_unit), layer_unit)
    assert result.params_matched > 0


def test_planning_calls_nothing_deprecated(capsys):
    # hapt-hf plan reads the model with the model reader (stages built and run on fake tensors)
    with _deprecations_are_errors():
        assert main(["plan"]) == 0
    assert "Warning" not in capsys.readouterr().err
