"""HaptTrainer resumes a checkpoint written under another plan: 3 processes (the last stage's
optimizer state sharded between two replicas taking 3:1 shares) write it at step 2; 2 processes
under another split and other per-device batches (the same global batch) resume it and
continue as the uninterrupted run: the same losses, learning rates and final weights (fp32,
rtol 1e-5), the data order from the saved position. A checkpoint whose global batch differs
from the run's is refused, naming it."""
from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan, Replica, Stage

pytestmark = pytest.mark.multiproc

SEQ, VOCAB, MBS, M = 8, 97, 4, 3
G = MBS * M  # 12 samples a step: 2 per device x 2 accumulation x 3 processes, or 3 x 2 x 2
ACCUMULATION = 2
STEPS, SAVE_AT = 4, 2
RTOL, ATOL = 1e-5, 1e-6


def _plan(world: int) -> Plan:
    if world == 3:
        last = (Replica("cpu", "cpu", 3, (1,)), Replica("cpu", "cpu", 1, (2,)))
        stages = (Stage.even(0, (0, 4), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
                  Stage(1, (4, 6), last, 1, optimizer="sharded"))
    else:
        stages = (Stage.even(0, (0, 2), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
                  Stage.even(1, (2, 6), "cpu", "cpu", (1,), 1, micro_batch_size=MBS))
    return Plan("tiny-gpt2", 6, SEQ, G, MBS, M, "1f1b", stages).validate(world)


def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def _rows() -> torch.Tensor:
    # fewer rows than STEPS global batches: the run crosses an epoch (a new sample order)
    return torch.randint(0, VOCAB, (G * 3, SEQ), generator=torch.Generator().manual_seed(1))


def _train(world: int, out: str, resume: str | None = None) -> dict:
    from transformers import TrainingArguments

    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    runtime = PipelineRuntime(_plan(world), _config(), RuntimeConfig(timeout_s=60))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=G // ACCUMULATION // world,
                             gradient_accumulation_steps=ACCUMULATION, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, max_steps=STEPS, logging_steps=1,
                             learning_rate=1e-3, lr_scheduler_type="linear", max_grad_norm=1.0,
                             save_strategy="steps", save_steps=SAVE_AT)
    trainer = HaptTrainer(args=args, runtime=runtime, train_dataset=_rows())
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer
    history = [h for h in trainer.state.log_history if "loss" in h]
    result = {"losses": {h["step"]: h["loss"] for h in history},
              "lrs": {h["step"]: h["learning_rate"] for h in history},
              "weights": {k: v.detach().numpy().copy() for k, v in runtime.stage.named_parameters()},
              "optimizer": type(opt).__name__, "state": len(getattr(opt, "optim", opt).state)}
    runtime.shutdown()
    return result


def _written(rank: int, world_size: int, root: str) -> dict:
    return _train(world_size, f"{root}/full")


def _resumed(rank: int, world_size: int, root: str) -> dict:
    if rank == 0:  # the checkpoint of step SAVE_AT only, in a fresh run directory
        shutil.copytree(f"{root}/full/checkpoint-{SAVE_AT}", f"{root}/resumed/checkpoint-{SAVE_AT}")
    torch.distributed.barrier()
    return _train(world_size, f"{root}/resumed", resume=f"{root}/resumed/checkpoint-{SAVE_AT}")


def _merged(outs: list[dict]) -> dict:
    weights: dict = {}
    for o in outs:
        weights.update(o["weights"])
    return weights


def test_a_3_process_checkpoint_resumes_on_2_processes_as_the_run_goes_on(tmp_path):
    full = [o.value for o in run_ranks(_written, 3, str(tmp_path), timeout_s=240)]
    assert [o["optimizer"] for o in full[1:]] == ["ShardedOptimizer"] * 2
    resumed = [o.value for o in run_ranks(_resumed, 2, str(tmp_path), timeout_s=240)]
    assert all(o["state"] > 0 for o in resumed)  # the Adam state was read, not started afresh
    for o in resumed:
        # the saved history (steps 1, 2), then the steps run after the resume
        assert sorted(o["losses"]) == list(range(1, STEPS + 1))
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert o["lrs"][step] == full[0]["lrs"][step], step
            assert o["losses"][step] == pytest.approx(full[0]["losses"][step], rel=RTOL), step
    want, got = _merged(full), _merged(resumed)
    assert got.keys() == want.keys()
    for n, w in want.items():
        torch.testing.assert_close(torch.from_numpy(got[n]), torch.from_numpy(w), rtol=RTOL,
                                   atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")


def test_another_global_batch_is_refused_naming_it(tmp_path):
    from dataclasses import replace

    from hapt_hf.integration.trainer_checkpoint import CheckpointError, check_portable
    _plan(3).save(tmp_path / "plan.json")
    for name in ("trainer_state.json", "hapt_portable.pt"):
        (tmp_path / name).write_text("")
    check_portable(tmp_path, _plan(2))  # another split of the same run: fine
    other = replace(_plan(2), global_batch_size=2 * G, num_microbatches=2 * M)
    with pytest.raises(CheckpointError, match=r"global batch 12, this run's plan has 24"):
        check_portable(tmp_path, other)
