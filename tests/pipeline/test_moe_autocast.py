"""DBRX, whose experts transformers writes without the cast its other MoEs make, trains under
bf16 autocast on 2 Gloo ranks (2 stages, 1F1B) as one process does under the same autocast.

transformers' ``DbrxExperts.forward`` fails under autocast (``index_add_`` of a 16-bit source
into the fp32 residual stream); the stages cast the source as Mixtral's experts do
(:mod:`hapt_hf.compat.moe_autocast`). The reference is the full model with the same cast, run
micro-batch by micro-batch under ``torch.autocast`` with the stage boundary's bf16 rounding
(the runtime sends activations and their gradients in the compute dtype): the loss of every
step, every gradient of the first step and the parameters after the last equal it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan, Stage

pytestmark = pytest.mark.multiproc

MBS, M, SEQ, STEPS, BLOCKS = 2, 2, 8, 2, 2


def _plan() -> Plan:
    bounds = [(0, 2), (2, BLOCKS + 2)]  # the embedding and block 0 | block 1, the norm and head
    stages = tuple(Stage.even(i, b, "cpu", "cpu", (i,), warmup=2 - i, micro_batch_size=MBS)
                   for i, b in enumerate(bounds))
    plan = Plan("tiny-dbrx", BLOCKS + 2, SEQ, MBS * M, MBS, M, "1f1b", stages)
    return replace(plan, dtype="bf16").validate()


class _Wire(torch.autograd.Function):
    """The stage boundary: the hidden state, and its gradient, rounded to bf16."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


def _close(tag, a, b, errors) -> None:
    try:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=4e-5)
    except AssertionError as e:
        errors.append(f"{tag}: {str(e).splitlines()[:3]}")


def _train(rank: int, world_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from benchmarks.chain_check import tiny_config
    from hapt_hf.compat.moe_autocast import cast_index_add_sources
    from hapt_hf.pipeline import Batch, PipelineRuntime, RuntimeConfig
    config = tiny_config("dbrx", BLOCKS)
    rt = PipelineRuntime(_plan(), config, RuntimeConfig(timeout_s=60, seed=7))
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    cast_index_add_sources(ref)
    ref.transformer.blocks[0].register_forward_hook(lambda m, i, o: _Wire.apply(o))
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(11)
    errors: list[str] = []
    for step in range(STEPS):
        ids = torch.randint(3, config.vocab_size, (MBS * M, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        tokens = int((labels[:, 1:] != -100).sum())
        ref_opt.zero_grad()
        ref_loss = torch.zeros(())
        for k in range(M):
            rows = slice(k * MBS, (k + 1) * MBS)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ref(ids[rows], attention_mask=mask[rows], labels=labels[rows])
            part = out.loss * int((labels[rows, 1:] != -100).sum()) / tokens
            part.backward()
            ref_loss += part.detach()
        ref_opt.step()
        opt.zero_grad()
        loss = rt.forward_backward(Batch(ids, labels, mask))
        if step == 0:
            for n, p in rt.stage.named_parameters():
                _close(f"grad {n}", p.grad, ref.get_parameter(n).grad, errors)
        opt.step()
        _close(f"step {step} loss", torch.tensor(float(loss)), ref_loss, errors)
    for n, p in rt.stage.named_parameters():
        _close(f"param {n}", p.detach(), ref.get_parameter(n).detach(), errors)
    experts = [n for n, m in rt.stage.named_modules() if type(m).__name__ == "DbrxExperts"]
    rt.shutdown()
    return {"errors": errors, "experts": experts,
            "grads": sum(1 for _ in rt.stage.parameters())}


@pytest.fixture(scope="module")
def results() -> list:
    return [o.value for o in run_ranks(_train, 2, timeout_s=120)]


def test_dbrx_trains_under_bf16_autocast_as_one_process(results):
    for rank, out in enumerate(results):
        assert not out["errors"], f"rank {rank}: " + "\n".join(out["errors"])
    # each rank ran one block's experts through the cast
    assert [out["experts"] for out in results] == [["transformer.blocks.0.ffn.experts"],
                                                   ["transformer.blocks.1.ffn.experts"]]
