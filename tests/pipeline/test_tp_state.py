"""A tensor-parallel stage whose optimizer state is sharded (ZeRO-1) among its replicas trains as
one process does, and its exported model is that process's model.

LLaMA (two blocks, tied embeddings) on 5 Gloo ranks: stage 0 (the embedding and block 0) on
rank 0; stage 1 (block 1 and the head) held by two tensor-parallel replicas of two ranks each,
(1, 2) and (3, 4), taking 3 and 1 samples of every micro-batch, with ``optimizer: sharded``:
ranks 1 and 3 (tensor-parallel position 0, the same shards) split the Adam state of their
parameters, ranks 2 and 4 theirs. An AdamW made with ``make_optimizer`` and a linear LR
schedule that moves at every step; clipped at 0.5.

Against one process (the whole model, AdamW, the same clipping and schedule): every loss and,
after every step, every parameter of every rank (the shards gathered whole), rtol 1e-5 / atol
4e-5 in fp32 as the pipeline's other equivalence tests (the row-wise all-reduce sums the
projections' partial outputs in another order; nothing needed more). The export is written as a checkpoint writes it
(each stage its own file, the TP replica's shards gathered inside it), loaded with
``from_pretrained``. The
same steps with the stage's optimizer state replicated leave every parameter bit for bit where
the sharded one does (``torch.equal``: Adam is elementwise). Resume
from a checkpoint of such a stage is tested through HaptTrainer
(tests/integration/test_trainer_tp.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, MBS, M = 8, 4, 2
G = MBS * M
STEPS = 4
WORLD = 5
RTOL, ATOL = 1e-5, 4e-5


def _plan(optimizer: str = "sharded") -> Plan:
    tp = (Replica("cpu", "cpu", 3, (1, 2)), Replica("cpu", "cpu", 1, (3, 4)))
    return Plan("tiny-llama", 4, SEQ, G, MBS, M, "1f1b", (
        Stage.even(0, (0, 2), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
        Stage(1, (2, 4), tp, 1, optimizer=optimizer))).validate(WORLD)


def _config():
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                       max_position_embeddings=32, tie_word_embeddings=True)


def _batches() -> list:
    from hapt_hf.pipeline import Batch
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 97, (G, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1::3, -2:] = 0  # right padding on some samples
        out.append(Batch(ids, ids.masked_fill(mask == 0, -100), mask))
    return out


def _start(optimizer: str = "sharded"):
    from transformers import get_linear_schedule_with_warmup

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    rt = PipelineRuntime(_plan(optimizer), _config(), RuntimeConfig(timeout_s=60, seed=5))
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    return rt, opt, get_linear_schedule_with_warmup(opt, 0, STEPS)


def _whole(rt) -> dict[str, torch.Tensor]:
    """Every parameter of the stage, shards gathered whole (collective in the replica)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in rt.stage.named_parameters()}


def train(rank: int, world_size: int, root: str) -> dict:
    """STEPS steps against one process, then the export."""
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
    from hapt_hf.pipeline.export import write_stage_shards
    rt, opt, sched = _start()
    torch.manual_seed(5)
    ref = AutoModelForCausalLM.from_config(_config(), attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    ref_sched = get_linear_schedule_with_warmup(ref_opt, 0, STEPS)
    errors, losses = [], []
    for i, b in enumerate(_batches()):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_sched.step()
        losses.append(rt.train_step(b, opt, sched, max_grad_norm=0.5).loss)
        _close(f"step {i} loss", torch.tensor(losses[-1]), ref_loss.detach(), errors)
        for n, p in _whole(rt).items():
            _close(f"step {i} param {n}", p, ref.get_parameter(n).detach(), errors)
    write_stage_shards(rt, Path(root) / "export")
    if rank == 0:
        exported = AutoModelForCausalLM.from_pretrained(Path(root) / "export")
        for n, p in ref.state_dict().items():
            _close(f"exported {n}", exported.state_dict()[n], p, errors)
    held = getattr(opt, "optim", opt).state
    after = {n: p.to_local() if hasattr(p, "to_local") else p.detach()
             for n, p in rt.stage.named_parameters()}
    rt.shutdown()
    # the same steps with the state replicated: every parameter bit for bit where it is
    rt, opt_r, sched = _start("replicated")
    for b in _batches():
        rt.train_step(b, opt_r, sched, max_grad_norm=0.5)
    for n, p in rt.stage.named_parameters():
        mine = p.to_local() if hasattr(p, "to_local") else p.detach()
        if not torch.equal(mine, after[n]):
            errors.append(f"{n}: sharded and replicated differ by {(mine - after[n]).abs().max()}")
    out = {"errors": errors, "optimizer": type(opt).__name__, "replicated": type(opt_r).__name__,
           "owned": len(held), "params_n": len(list(rt.stage.parameters())),
           "sharded": sum(hasattr(p, "to_local") for p in rt.stage.parameters())}
    rt.shutdown()
    return out


def _close(tag: str, actual, expected, errors: list[str]) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        errors.append(f"{tag}: {str(e).splitlines()[:4]}")


def test_tp_stage_with_sharded_optimizer_matches_one_process_and_exports_whole(tmp_path):
    full = [o.value for o in run_ranks(train, WORLD, str(tmp_path), timeout_s=300)]
    for rank, out in enumerate(full):
        assert not out["errors"], f"rank {rank}:\n" + "\n".join(out["errors"])
    assert [o["optimizer"] for o in full] == ["AdamW"] + ["ShardedOptimizer"] * 4
    assert [o["replicated"] for o in full] == ["AdamW"] * 5
    # the projections of block 1 are sharded on stage 1's ranks, whole on stage 0's
    assert full[0]["sharded"] == 0 and all(full[r]["sharded"] == 7 for r in range(1, 5))
    # ranks at the same tensor-parallel position split their shards' Adam state between them
    for a, b in ((1, 3), (2, 4)):
        assert 0 < full[a]["owned"] < full[a]["params_n"] and 0 < full[b]["owned"]
        assert full[a]["owned"] + full[b]["owned"] == full[a]["params_n"]
