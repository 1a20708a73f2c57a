"""LoRA on a stage (one process): only adapters train, and merging keeps the function."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from hapt_hf.integration.lora import LoraSetupError, apply_lora, merge_lora
from hapt_hf.pipeline.stage import build_stage

LLAMA = Path(__file__).resolve().parents[2] / "recipes" / "models" / "llama-tiny"


def test_lora_trains_adapters_only_and_merges_back_to_hf_keys():
    config = AutoConfig.from_pretrained(LLAMA)
    stage = build_stage(config, (0, 5), seed=0)  # embedding + 4 blocks
    hf_keys = set(stage.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    before = stage(ids).detach()
    trainable = apply_lora(stage, r=4)
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert trainable == sum(p.numel() for p in stage.parameters() if p.requires_grad)
    torch.testing.assert_close(stage(ids), before)  # LoRA B starts at zero
    with torch.no_grad():
        for n, p in stage.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    adapted = stage(ids).detach()
    assert not torch.allclose(adapted, before)
    merge_lora(stage)
    assert set(stage.state_dict()) == hf_keys
    torch.testing.assert_close(stage(ids), adapted, rtol=1e-5, atol=4e-5)


def test_lora_rank_must_be_positive():
    stage = build_stage(AutoConfig.from_pretrained(LLAMA), (0, 3), seed=0)
    with pytest.raises(LoraSetupError, match="--lora_r is 0"):
        apply_lora(stage, r=0)
