"""A stage built with ``init_weights=False`` for a resume: no seeded initialisation runs (it
replays the whole model's random draws), its tensors are the seeded stage's names, shapes and
computed buffers, and once a portable checkpoint is read into it the stage and its optimizer
step bit for bit as the seeded stage that read the same checkpoint."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig

from hapt_hf.pipeline import init_replay, portable
from hapt_hf.pipeline.stage import build_stage

SPANS = [(0, 2), (1, 4)]


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                       tie_word_embeddings=False)


def _step(stage, opt, ids) -> torch.Tensor:
    opt.zero_grad()
    out = stage(ids, labels=ids) if stage.is_first else stage(ids, labels=None)
    loss = out if out.dim() == 0 else out.float().square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _input(stage) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    if stage.is_first:
        return torch.randint(0, 64, (2, 8), generator=g)
    return torch.randn(2, 8, 32, generator=g)


@pytest.mark.parametrize("span", SPANS)
def test_unseeded_stage_reads_a_checkpoint_and_steps_as_the_seeded_one(tmp_path, span, monkeypatch):
    config = _config()
    seeded = build_stage(config, span, seed=0)
    opt = torch.optim.AdamW(seeded.parameters(), lr=1e-2)
    _step(seeded, opt, _input(seeded))
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        portable.save_portable(tmp_path, seeded, opt)

    def refused(*args, **kwargs):
        raise AssertionError("the seeded initialisation ran")
    monkeypatch.setattr(init_replay, "seeded_values", refused)
    empty = build_stage(config, span, seed=0, init_weights=False)
    monkeypatch.undo()
    assert {k: (v.shape, v.dtype) for k, v in empty.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in seeded.state_dict().items()}
    for (name, a), (_, b) in zip(seeded.named_buffers(), empty.named_buffers()):
        assert torch.equal(a, b), name  # computed buffers (rotary frequencies) as the seeded build's

    other = build_stage(config, span, seed=0)
    fresh, fresh_other = (torch.optim.AdamW(s.parameters(), lr=1e-2) for s in (empty, other))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        portable.load_portable(tmp_path, empty, fresh)
        portable.load_portable(tmp_path, other, fresh_other)
    ids = _input(seeded)
    for _ in range(2):
        assert torch.equal(_step(empty, fresh, ids), _step(other, fresh_other, ids))
    for (name, a), (_, b) in zip(other.named_parameters(), empty.named_parameters()):
        assert torch.equal(a, b), name
