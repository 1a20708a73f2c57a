"""Every accepted model type runs a forward under bf16 and fp16 autocast, as the runtime computes
in 16 bits (the chain check of scripts/model_matrix.py runs in fp32 only).

One block, 8 tokens, forward only (about 10 s for all types): a type whose code mixes dtypes
where autocast leaves an op alone (DBRX's experts before :mod:`hapt_hf.compat.moe_autocast`)
fails here, not deep in a user's first step.
"""
from __future__ import annotations

import warnings

import torch

from benchmarks.chain_check import attention_for, tiny_config
from hapt_hf.core.families import accepted_model_types
from hapt_hf.core.layers import num_layers
from hapt_hf.pipeline.families import num_blocks
from hapt_hf.pipeline.stage import build_stage


def _failures(types) -> list[str]:
    failed = []
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in types:
            config = tiny_config(t, 1)
            stage = build_stage(config, (0, num_layers(num_blocks(config))), seed=0,
                                attn_implementation=attention_for(config))
            for dtype in (torch.bfloat16, torch.float16):
                try:
                    with torch.autocast("cpu", dtype=dtype):
                        loss = stage(ids, labels=ids)
                    assert torch.isfinite(loss).all(), "loss not finite"
                except Exception as e:  # noqa: BLE001 - every failure is listed
                    failed.append(f"{t} {dtype}: {type(e).__name__}: {str(e)[:160]}")
    return failed


def test_every_accepted_type_runs_under_16bit_autocast():
    assert not _failures(accepted_model_types())


def test_dbrx_without_the_cast_fails_here(monkeypatch):
    """The check above catches DBRX's experts as transformers writes them."""
    monkeypatch.setattr("hapt_hf.pipeline.stage.cast_index_add_sources", lambda root: [])
    failed = _failures(["dbrx"])
    assert len(failed) == 2 and all("index_add_(): self (Float) and source" in f for f in failed), failed
