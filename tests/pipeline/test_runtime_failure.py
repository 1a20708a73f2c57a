"""A failure anywhere ends every rank within the bound, with a message naming the failed rank."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

BOUND_S = 6.0  # RuntimeConfig.timeout_s for these runs


def _plan(how: str) -> Plan:
    """Three stages of one block each: [embedding, b0], [b1], [b2, head]; 1F1B.

    For a failure inside the gradient all-reduce: a 2-wide first stage and a 1-wide last one.
    """
    if how == "kill_in_allreduce":
        stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0, 1), warmup=2, micro_batch_size=2),
                  Stage.even(1, (3, 5), "cpu", "cpu", (2,), warmup=1, micro_batch_size=2))
        return Plan("tiny", 5, 8, 8, 2, 4, "1f1b", stages).validate()
    layers = ((0, 2), (2, 3), (3, 5))
    stages = tuple(Stage.even(i, span, "cpu", "cpu", (i,), warmup=3 - i, micro_batch_size=2)
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


# -- four ranks, the faulty one in the middle: blaming a neighbour would be caught ---------------

VICTIM = 2
BOUND4_S = 4.0  # RuntimeConfig.timeout_s and the process group's timeout for these runs


def _plan4() -> Plan:
    """Four stages, one rank each: [embedding, b0], [b1], [b2], [head]; 1F1B."""
    layers = ((0, 2), (2, 3), (3, 4), (4, 5))
    stages = tuple(Stage.even(i, span, "cpu", "cpu", (i,), warmup=4 - i, micro_batch_size=2)
                   for i, span in enumerate(layers))
    return Plan("tiny", 5, 8, 8, 2, 4, "1f1b", stages).validate()


def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=16, vocab_size=50)


def _mark_fault(tmp: Path) -> None:
    (tmp / "fault").write_text(repr(time.monotonic()))


def _kill_once_the_others_end(tmp: Path, world_size: int) -> None:
    """A helper process that SIGKILLs this (frozen) rank once every other rank has ended, or
    after 30 s: the survivors must have given up while it was still frozen."""
    others = " ".join((tmp / f"pid{r}").read_text() for r in range(world_size) if r != VICTIM)
    why = tmp / "victim_killed_because"
    script = (f"for i in $(seq 150); do alive=0; for p in {others}; do "
              f"kill -0 $p 2>/dev/null && alive=1; done; [ $alive = 0 ] && break; sleep 0.2; "
              f"done; if [ $alive = 0 ]; then echo others-ended > {why}; "
              f"else echo timeout > {why}; fi; kill -9 {os.getpid()}")
    subprocess.Popen(["sh", "-c", script], start_new_session=True)


def four_rank_worker(rank: int, world_size: int, how: str, tmp: str) -> str:
    """``how`` happens to rank 2: "kill" (SIGKILL) or "raise" at its second forward of the
    second iteration; "stop" (SIGSTOP) as the second iteration starts, while its neighbours
    (ranks 1 and 3) are still busy for a moment, so that rank 0, waiting for rank 1, is the
    first to time out, on a live rank; or "corrupt": its checkpoint file is truncated."""
    import torch

    from hapt_hf.pipeline import Batch, PipelineFailure, PipelineRuntime, RuntimeConfig
    from hapt_hf.pipeline.stage import StageBuildError
    tmp_path = Path(tmp)
    (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    ckpt = None
    if how == "corrupt":
        ckpt = str(tmp_path / ("bad" if rank == VICTIM else "good"))
    try:
        rt = PipelineRuntime(_plan4(), _config(),
                             RuntimeConfig(timeout_s=BOUND4_S, checkpoint_dir=ckpt))
    except StageBuildError:  # the damaged file, refused on every rank
        if rank == VICTIM:
            _mark_fault(tmp_path)
        raise
    batch = Batch(torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(0)))
    rt.forward_backward(batch)
    calls = []

    def fault(module, args):
        calls.append(1)
        if len(calls) == 2:
            _mark_fault(tmp_path)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("boom")

    if how == "stop" and rank == VICTIM:
        _mark_fault(tmp_path)
        _kill_once_the_others_end(tmp_path, world_size)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "stop" and rank in (VICTIM - 1, VICTIM + 1):
        time.sleep(1.5)
    elif rank == VICTIM:
        rt.stage.register_forward_pre_hook(fault)
    try:
        rt.forward_backward(batch)
    except PipelineFailure:
        if rank == VICTIM and how == "raise":
            time.sleep(BOUND4_S)  # stay alive: the others must not wait for this process
        raise
    return "finished the iteration"


def _corrupt_checkpoints(tmp: Path) -> None:
    from transformers import GPT2LMHeadModel
    GPT2LMHeadModel(_config()).save_pretrained(tmp / "good")
    shutil.copytree(tmp / "good", tmp / "bad")
    data = (tmp / "bad" / "model.safetensors").read_bytes()
    (tmp / "bad" / "model.safetensors").write_bytes(data[: len(data) // 2])


EXPECTED = {
    "kill": "rank 2 stopped answering",
    "stop": "rank 2 stopped answering (no heartbeat",
    "raise": "rank 2 failed during F (stage 2, micro-batch 1): ValueError: boom",
    "corrupt": "rank 2: checkpoint file",
}


@pytest.mark.parametrize("how", list(EXPECTED))
def test_four_ranks_every_survivor_names_the_faulty_middle_rank(tmp_path, how):
    if how == "corrupt":
        _corrupt_checkpoints(tmp_path)
    outs = run_ranks(four_rank_worker, 4, how, str(tmp_path), timeout_s=120,
                     pg_timeout_s=BOUND4_S, check=False)
    fault_at = float((tmp_path / "fault").read_text())
    victim = outs[VICTIM]
    if how in ("kill", "stop"):
        assert victim.exitcode == -signal.SIGKILL, victim
    else:
        assert victim.exitcode == 1 and not victim.ok, victim
    for o in outs:
        if o.rank == VICTIM:
            continue
        text = f"{o.error}\n{o.stderr_tail}"
        # what each survivor reported, first: a long traceback would hide it in the assertion
        said = [line for line in text.splitlines() if "PipelineFailure" in line or "error:" in line]
        assert o.exitcode == 1 and not o.ok, (o.rank, o.exitcode, said, text)
        assert EXPECTED[how] in text, (o.rank, said, text)
        for other in (0, 1, 3):
            assert f"rank {other} stopped answering" not in text, (o.rank, text)
            assert f"rank {other} failed" not in text, (o.rank, text)
        # within the bound: what a wait may last (the process group's timeout), plus finding
        # who stopped (two 1 s heartbeat windows and two 0.5 s grace waits), rank 0 keeping
        # the store up until the others have read the failure, and slack for a loaded machine
        took = o.ended_at - fault_at
        assert took < BOUND4_S + 6.0, (o.rank, took, text)
    if how == "stop":  # every survivor gave up while rank 2 was still frozen: it was killed
        # only once the others had ended (the parent's 0.2 s polling cannot order two ends
        # that fall into one poll, so the killer says why it killed)
        assert (tmp_path / "victim_killed_because").read_text().strip() == "others-ended"
    if how == "corrupt":
        assert "bad/model.safetensors" in victim.error and "damaged" in victim.error
