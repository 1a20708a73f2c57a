"""A failure anywhere ends every rank within the bound, with a message naming the failed rank."""
from __future__ import annotations

import os
import signal
import time

import pytest

from hapt_hf.planner.plan import Plan, StagePlan
from hapt_hf.testing import run_ranks

pytestmark = pytest.mark.multiproc

BOUND_S = 6.0  # RuntimeConfig.timeout_s for these runs


def _plan(how: str) -> Plan:
    """Three stages of one block each: [embedding, b0], [b1], [b2, head]; 1F1B.

    For a failure inside the gradient all-reduce: a 2-wide first stage and a 1-wide last one.
    """
    if how == "kill_in_allreduce":
        stages = (StagePlan(0, (0, 3), "cpu", "cpu", (0, 1), warmup=2),
                  StagePlan(1, (3, 5), "cpu", "cpu", (2,), warmup=1))
        return Plan("tiny", 5, 8, 8, 2, 4, "1f1b", stages).validate()
    layers = ((0, 2), (2, 3), (3, 5))
    stages = tuple(StagePlan(i, span, "cpu", "cpu", (i,), warmup=3 - i)
                   for i, span in enumerate(layers))
    return Plan("tiny", 5, 8, 8, 2, 4, "1f1b", stages).validate()


def worker(rank: int, world_size: int, victim: int, how: str) -> dict:
    """Run one good iteration, then one where ``victim`` fails at its second forward (or, for
    ``kill_in_allreduce``, dies as the gradient all-reduce starts)."""
    import torch
    from transformers import GPT2Config

    from hapt_hf.pipeline import Batch, PipelineFailure, PipelineRuntime, RuntimeConfig
    config = GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=16, vocab_size=50)
    rt = PipelineRuntime(_plan(how), config, RuntimeConfig(timeout_s=BOUND_S))
    batch = Batch(torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(0)))
    rt.forward_backward(batch)  # every pair has talked once: a healthy pipeline
    calls = []

    def fail(module, args):
        calls.append(1)
        if len(calls) == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("boom")

    if rank == victim and how == "kill_in_allreduce":
        rt._sync_grads = lambda: os.kill(os.getpid(), signal.SIGKILL)
    elif rank == victim:
        rt.stage.register_forward_pre_hook(fail)
    start = time.monotonic()
    try:
        rt.forward_backward(batch)
    except PipelineFailure as e:
        if rank == victim and how == "raise":
            time.sleep(BOUND_S)  # stay alive: the others must not wait for this process
        return {"message": str(e), "elapsed": time.monotonic() - start}
    return {"message": None, "elapsed": time.monotonic() - start}


def test_killed_rank_is_named_by_the_others():
    outs = run_ranks(worker, 3, 1, "kill", timeout_s=120, pg_timeout_s=BOUND_S, check=False)
    assert outs[1].exitcode == -signal.SIGKILL
    for o in (outs[0], outs[2]):
        assert o.ok, o.error
        msg = o.value["message"]
        assert msg is not None, f"rank {o.rank} finished the iteration without its peer"
        assert "rank 1 stopped answering" in msg, msg
        assert f"rank {o.rank} (stage {o.rank}) was waiting for" in msg, msg
        assert o.value["elapsed"] < BOUND_S, o.value


def test_raising_rank_ends_the_others_while_it_stays_alive():
    outs = run_ranks(worker, 3, 1, "raise", timeout_s=120, pg_timeout_s=BOUND_S, check=False)
    expected = "rank 1 failed during F (stage 1, micro-batch 1): ValueError: boom"
    assert outs[1].ok and outs[1].value["message"] == expected, outs[1]
    # the victim stays alive for the whole bound; the blocked ranks must not wait for it:
    # their watchdog ends them (exit 1) with the recorded message before the victim exits
    for o in (outs[0], outs[2]):
        assert o.exitcode == 1 and not o.ok, o
        assert f"PipelineFailure: {expected}" in o.stderr_tail, o.stderr_tail


def test_rank_killed_in_the_gradient_all_reduce_is_named():
    outs = run_ranks(worker, 3, 1, "kill_in_allreduce", timeout_s=120, pg_timeout_s=BOUND_S,
                     check=False)
    assert outs[1].exitcode == -signal.SIGKILL
    for o in (outs[0], outs[2]):
        assert o.ok, o.error
        msg = o.value["message"]
        assert msg is not None and "rank 1 stopped answering" in msg, msg
        stage = 0 if o.rank == 0 else 1
        assert f"rank {o.rank} (stage {stage}) was in the gradient all-reduce" in msg, msg
        assert o.value["elapsed"] < BOUND_S, o.value
