"""torch's interleaved schedules as the race's contenders train as one process would.

Two Gloo ranks run a tiny GPT-2 (untied embeddings) split uniformly and interleaved into two
chunks per rank under torch's ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
(through ``hapt_hf.pipeline.torch_pipelining``); every rank compares its loss and every gradient
of its chunks, after one iteration, with one process chaining the same stage modules
(rtol 1e-5, atol 4e-5 in fp32). The capability check refuses what torch's schedules cannot run.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.core.schedules import default_warmups
from hapt_hf.pipeline.torch_pipelining import torch_supports
from hapt_hf.planner.plan import Plan, Stage

BLOCKS, SEQ, VOCAB, M = 4, 16, 97, 4


def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=BLOCKS, n_embd=32, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)


def _plan(ranks: int = 2, virtual: int = 2) -> Plan:
    """The uniform split of BLOCKS + 2 layers over ``ranks``, interleaved ``virtual`` ways."""
    n = BLOCKS + 2
    per = [n // ranks + (i < n % ranks) for i in range(ranks)]
    stages, start = [], 0
    for i, k in enumerate(per):
        stages.append(Stage.even(i, (start, start + k), "g", "cpu", (i,), warmup=ranks - i,
                                 micro_batch_size=1))
        start += k
    return Plan("t", n, SEQ, M, 1, M, "1f1b", tuple(stages)).validate().interleave(virtual)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (M, SEQ), generator=g)
    return ids, ids.clone()


def _reference(plan: Plan) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: the same stage modules chained, the loss as torch's schedule takes it."""
    from hapt_hf.compat.transformers_api import causal_lm_loss_sum
    from hapt_hf.pipeline.stage import build_stage
    mods = [build_stage(_config(), s.layers, seed=0) for s in plan.stages]
    ids, labels = _batch()
    x = ids
    for m in mods:
        x = m(x)
    loss = causal_lm_loss_sum(x, labels, VOCAB) / int((labels[:, 1:] != -100).sum())
    loss.backward()
    return float(loss.detach()), {f"{s.index}.{n}": p.grad for s, m in zip(plan.stages, mods)
                         for n, p in m.named_parameters()}


def _rank(rank: int, world: int, schedule: str):
    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.pipeline.torch_pipelining import build_torch_pipeline
    plan = _plan(world)
    mods = {s.index: build_stage(_config(), s.layers, seed=0) for s in plan.stages_of_rank(rank)}
    pp = build_torch_pipeline(plan, rank, mods, VOCAB, schedule=schedule)
    loss = pp.forward_backward(*_batch())
    # numpy arrays: tensors would travel back as shared memory the exiting rank takes along
    return loss, {f"{i}.{n}": p.grad.numpy().copy() for i, m in mods.items()
                  for n, p in m.named_parameters()}


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"])
def test_torch_interleaved_schedules_match_one_process(schedule):
    loss, grads = _reference(_plan())
    outcomes = run_ranks(_rank, 2, schedule)
    seen = set()
    for o in outcomes:
        rank_loss, rank_grads = o.value
        if o.rank == 1:  # holds the last chunk
            assert rank_loss == pytest.approx(loss, rel=1e-5)
        for name, g in rank_grads.items():
            torch.testing.assert_close(torch.from_numpy(g), grads[name], rtol=1e-5, atol=4e-5)
            seen.add(name)
    assert seen == set(grads)


def test_torch_interleaved_capability_check():
    plan = _plan()
    assert torch_supports(plan) is None
    assert torch_supports(plan, "ScheduleInterleavedZeroBubble") is None
    assert "runs plans of schedule 'interleaved'" in torch_supports(
        plan.with_schedule("1f1b"), "ScheduleInterleaved1F1B")
    deeper = plan.with_schedule("interleaved", [w + 1 for w in plan.warmups()])
    assert "warm-up depths" in torch_supports(deeper)
    assert "is not one of" in torch_supports(plan, "ScheduleLoopedBFS")
    odd = replace(plan, global_batch_size=5, num_microbatches=5)
    odd = odd.with_schedule("interleaved", default_warmups("interleaved", 4, 5, 2))
    assert "multiple of its rounds" in torch_supports(odd)
