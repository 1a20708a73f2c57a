"""The runtime trains generic-builder models as one process would (4 Gloo ranks, 3 AdamW steps).

One parallel-block family (GPT-NeoX), one MoE (Mixtral) and one with alternating sliding / full
attention (Gemma 3), each cut into 4 stages of one rank; the losses of every step and every
gradient of the first step equal a single-process model's, and the parameters after 3 steps too.
"""
from __future__ import annotations

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

MBS, M, SEQ, STEPS, BLOCKS = 2, 2, 8, 3, 4
TYPES = ("gpt_neox", "mixtral", "gemma3_text")


def _plan() -> Plan:
    bounds = [(0, 2), (2, 3), (3, 4), (4, BLOCKS + 2)]
    stages = tuple(Stage.even(i, b, "cpu", "cpu", (i,), warmup=4 - i, micro_batch_size=MBS)
                   for i, b in enumerate(bounds))
    return Plan("tiny", BLOCKS + 2, SEQ, MBS * M, MBS, M, "1f1b", stages).validate()


def _close(tag, a, b, errors) -> None:
    try:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=4e-5)
    except AssertionError as e:
        errors.append(f"{tag}: {str(e).splitlines()[:3]}")


def run_type(rank: int, model_type: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import Batch, PipelineRuntime, RuntimeConfig
    from benchmarks.chain_check import tiny_config
    config = tiny_config(model_type, BLOCKS)
    rt = PipelineRuntime(_plan(), config, RuntimeConfig(timeout_s=60, seed=7))
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(11)
    errors: list[str] = []
    for step in range(STEPS):
        ids = torch.randint(3, config.vocab_size, (MBS * M, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        b = Batch(ids, ids.masked_fill(mask == 0, -100), mask)
        ref_opt.zero_grad()
        ref_loss = ref(ids, attention_mask=mask, labels=b.labels).loss
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss = rt.forward_backward(b)
        if step == 0:
            for n, p in rt.stage.named_parameters():
                _close(f"grad {n}", p.grad, ref.get_parameter(n).grad, errors)
        opt.step()
        _close(f"step {step} loss", torch.tensor(float(loss)), ref_loss.detach(), errors)
    for n, p in rt.stage.named_parameters():
        _close(f"param {n}", p.detach(), ref.get_parameter(n).detach(), errors)
    rt.shutdown()
    return errors


def run_all(rank: int, world_size: int) -> dict:
    return {t: run_type(rank, t) for t in TYPES}


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(run_all, 4, timeout_s=300)


@pytest.mark.parametrize("model_type", TYPES)
def test_four_stages_train_as_one_process(results, model_type):
    for o in results:
        assert not o.value[model_type], f"rank {o.rank}: " + "\n".join(o.value[model_type])
