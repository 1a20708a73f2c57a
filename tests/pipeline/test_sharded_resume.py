"""A run whose embedding stage shards its optimizer state between two replicas, checkpointed at
step K and resumed in fresh processes, continues bit for bit as the uninterrupted run: every
loss after K and every parameter of every rank at the end are equal (``torch.equal``).

LLaMA (the recipes' tiny config, two blocks; the input embedding tied to the LM head and not)
on 3 Gloo ranks: stage 0 (embedding and block 0) on ranks 0 and 1 with ``optimizer: sharded``,
stage 1 (block 1 and the head) on rank 2. Two ways to get the sharded optimizer, each with a
linear LR schedule that changes the learning rate at every step:

* ``made``: ``runtime.make_optimizer``, the scheduler built on the sharded optimizer;
* ``prepared``: the script's own AdamW and the scheduler built on it, then
  ``runtime.prepare_optimizer`` (as ``HaptTrainer(optimizers=...)`` and ``HaptAccelerator``
  do): the scheduler drives the sharded optimizer through the AdamW's group dicts, which must
  stay the sharded optimizer's groups after it loads a checkpoint.

The checkpoint is the one HaptTrainer writes: the gathered model and each rank's own file
(its optimizer shard, scheduler and RNG states); the resumed run builds its optimizer before
it reads them, as HaptTrainer does.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "models" / "llama-tiny" / "config.json"
SEQ, MBS, M = 8, 4, 2
G = MBS * M
STEPS, K = 5, 2  # three steps after the checkpoint: the schedule moves the LR at each
CASES = [(False, "made"), (False, "prepared"), (True, "prepared")]  # (tied, how)


def _plan() -> Plan:
    return Plan("llama-tiny", 4, SEQ, G, MBS, M, "1f1b", (
        Stage.even(0, (0, 2), "cpu", "cpu", (0, 1), 2, optimizer="sharded", micro_batch_size=MBS),
        Stage.even(1, (2, 4), "cpu", "cpu", (2,), 1, micro_batch_size=MBS))).validate(3)


def _config(tied: bool):
    from transformers import LlamaConfig
    config = json.loads(CONFIG.read_text())
    config.update(num_hidden_layers=2, tie_word_embeddings=tied)
    return LlamaConfig.from_dict(config)


def _batches(vocab: int) -> list:
    from hapt_hf.pipeline import Batch
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, vocab, (G, SEQ), generator=g) for _ in range(STEPS)]
    return [Batch(i, i.clone(), torch.ones_like(i)) for i in ids]


def _start(tied: bool, how: str):
    """A runtime and its sharded (on stage 0) optimizer and linear schedule."""
    from transformers import get_linear_schedule_with_warmup

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    rt = PipelineRuntime(_plan(), _config(tied), RuntimeConfig(timeout_s=60))
    if how == "made":
        opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        return rt, opt, get_linear_schedule_with_warmup(opt, 0, STEPS)
    own = torch.optim.AdamW(rt.stage.parameters(), lr=1e-3, weight_decay=0.1)
    sched = get_linear_schedule_with_warmup(own, 0, STEPS)
    return rt, rt.prepare_optimizer(own), sched


def _step(rt, opt, sched, batch) -> float:
    return rt.train_step(batch, opt, sched, max_grad_norm=1.0).loss


def _end(rt, opt, sched, losses: list[float]) -> dict:
    out = {"losses": losses, "optimizer": type(opt).__name__,
           "params": {n: p.detach().numpy().copy() for n, p in rt.stage.named_parameters()},
           # the LR the optimizer steps with, and the one the schedule set
           "lr": [g["lr"] for g in opt.param_groups], "scheduled": sched.get_last_lr()}
    rt.shutdown()
    return out


def uninterrupted(rank: int, world_size: int, root: str) -> dict:
    """STEPS steps, checkpointed after K of them."""
    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    from hapt_hf.pipeline.export import write_stage_shards
    out = {}
    for tied, how in CASES:
        rt, opt, sched = _start(tied, how)
        losses = []
        for i, batch in enumerate(_batches(rt.stage.config.vocab_size)):
            losses.append(_step(rt, opt, sched, batch))
            if i + 1 == K:
                ckpt = Path(root) / f"{tied}-{how}"
                if rank == 0:
                    ckpt.mkdir()
                ckpt_io.barrier()
                write_stage_shards(rt, ckpt)
                ckpt_io.save_rank_state(ckpt, rank, opt, sched)
                ckpt_io.barrier()
        out[tied, how] = _end(rt, opt, sched, losses)
    return out


def resumed(rank: int, world_size: int, root: str) -> dict:
    """Fresh processes: the checkpoint's weights and this rank's state, then steps K+1.."""
    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    out = {}
    for tied, how in CASES:
        rt, opt, sched = _start(tied, how)
        ckpt = Path(root) / f"{tied}-{how}"
        ckpt_io.load_stage_weights(rt.stage, ckpt)
        ckpt_io.load_rank_state(ckpt, rank, opt, sched)
        held = len(getattr(opt, "optim", opt).state)
        losses = [_step(rt, opt, sched, b) for b in _batches(rt.stage.config.vocab_size)[K:]]
        out[tied, how] = {**_end(rt, opt, sched, losses), "loaded_state": held}
    return out


def test_sharded_embedding_stage_resumes_bit_for_bit(tmp_path):
    full = [o.value for o in run_ranks(uninterrupted, 3, str(tmp_path), timeout_s=240)]
    again = [o.value for o in run_ranks(resumed, 3, str(tmp_path), timeout_s=240)]
    for case in CASES:
        # each replica of stage 0 holds a part of its Adam state, loaded from its own file
        assert [full[r][case]["optimizer"] for r in range(3)] == ["ShardedOptimizer"] * 2 + ["AdamW"]
        assert all(again[r][case]["loaded_state"] > 0 for r in range(3)), case
        for rank in range(3):
            a, b = full[rank][case], again[rank][case]
            assert b["lr"] == b["scheduled"], (case, rank, b["lr"], b["scheduled"])
            assert b["lr"] == a["lr"], (case, rank)
            assert torch.equal(torch.tensor(b["losses"], dtype=torch.float64),
                               torch.tensor(a["losses"][K:], dtype=torch.float64)), \
                (case, rank, a["losses"][K:], b["losses"])
            for n, p in a["params"].items():
                assert torch.equal(torch.from_numpy(b["params"][n]), torch.from_numpy(p)), \
                    (case, rank, n, float(abs(b["params"][n] - p).max()))
