"""Portable checkpoints on one process (no process group): model and Adam state round-trip by
parameter name and the next step is bit for bit the one the saved optimizer takes; a tensor
the checkpoint lacks or holds in another shape, and a directory that is no such checkpoint,
are refused naming them."""
from __future__ import annotations

import warnings

import pytest
import torch

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline import portable


def _model(width: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 3), torch.nn.Linear(3, 2))


def _step(model, opt) -> None:
    opt.zero_grad()
    model(torch.ones(5, model[0].in_features)).square().sum().backward()
    opt.step()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def test_round_trip_continues_bit_for_bit(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        _step(model, opt)
    portable.save_portable(tmp_path, model, opt)
    names = set(portable.portable_state_dict(model, opt))
    assert "optim.0.weight.exp_avg_sq" in names and "model.1.bias" in names
    again = _model()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-2)
    portable.load_portable(tmp_path, again, fresh)
    _step(model, opt)
    _step(again, fresh)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert float(fresh.state[again[0].weight]["step"]) == 3.0


def test_other_shapes_and_other_directories_are_refused(tmp_path):
    model = _model()
    portable.save_portable(tmp_path / "ckpt", model, None)
    with pytest.raises(CheckpointError, match=r"'model.0.weight' has shape \(3, 4\) but this "
                                              r"run's is \(3, 6\)"):
        portable.prepare_load(tmp_path / "ckpt", _model(width=6), None)
    bigger = torch.nn.Sequential(*_model(), torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"has no tensor 'model.2.weight'"):
        portable.prepare_load(tmp_path / "ckpt", bigger, None)
    with pytest.raises(CheckpointError, match="not a checkpoint written by save_portable"):
        portable.load_portable(tmp_path, model, None)
