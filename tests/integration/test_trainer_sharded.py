"""HaptTrainer on a plan whose last stage shards its optimizer state between two replicas that
take uneven shares (3:1) of every micro-batch: it trains as ``transformers.Trainer`` on one
process does (the same batches, losses and weights), its exported model is that process's model,
and a run resumed from a checkpoint (every rank's shard in its own file) continues bit for bit as
the uninterrupted run; a script's own AdamW and the scheduler built on it (``optimizers=``) are
sharded the same way, without the scheduler's "step before optimizer.step()" warning."""
from __future__ import annotations

import shutil

import pytest
import torch

from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, VOCAB, MBS, M = 8, 97, 4, 3
G = MBS * M  # 12 samples a step: 2 per device x 2 accumulation x 3 processes
WORLD, PER_DEVICE, ACCUMULATION = 3, 2, 2
STEPS, SAVE_AT = 4, 2
RTOL, ATOL = 1e-5, 4e-5


def _plan() -> Plan:
    last = (Replica("cpu", "cpu", 3, (1,)), Replica("cpu", "cpu", 1, (2,)))
    return Plan("tiny-gpt2", 6, SEQ, G, MBS, M, "1f1b", (
        Stage.even(0, (0, 4), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
        Stage(1, (4, 6), last, 1, optimizer="sharded"))).validate(WORLD)


def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def _rows() -> torch.Tensor:
    # fewer rows than STEPS global batches: the run crosses an epoch (a new sample order)
    return torch.randint(0, VOCAB, (G * 3, SEQ), generator=torch.Generator().manual_seed(1))


def _args(out: str, per_device: int = PER_DEVICE, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=ACCUMULATION, report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0, max_steps=STEPS,
                             logging_steps=1, learning_rate=1e-3, lr_scheduler_type="linear",
                             max_grad_norm=1.0, **kw)


def _train(out: str, resume: str | None = None, own_optimizer: bool = False) -> dict:
    """A run; ``own_optimizer``: the script passes its AdamW and a scheduler built on it."""
    import warnings

    from transformers import get_linear_schedule_with_warmup

    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    runtime = PipelineRuntime(_plan(), _config(), RuntimeConfig(timeout_s=60))
    optimizers = (None, None)
    if own_optimizer:
        opt = torch.optim.AdamW(runtime.stage.parameters(), lr=1e-3, weight_decay=0.0)
        optimizers = (opt, get_linear_schedule_with_warmup(opt, 0, STEPS))
    trainer = HaptTrainer(args=_args(out, save_strategy="steps", save_steps=SAVE_AT),
                          runtime=runtime, train_dataset=_rows(), optimizers=optimizers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer
    result = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
              "lrs": {h["step"]: h["learning_rate"] for h in trainer.state.log_history
                      if "loss" in h},
              "weights": {k: v.detach().numpy().copy()
                          for k, v in runtime.stage.named_parameters()},
              "optimizer": type(opt).__name__,
              "state": len(getattr(opt, "optim", opt).state),
              "scheduler_warnings": [str(w.message) for w in seen
                                     if "lr_scheduler" in str(w.message)]}
    runtime.shutdown()
    return result


def _one_process(rank: int, world_size: int, out: str) -> dict:
    """``transformers.Trainer`` on ONE process, its per-device batch the whole data-parallel
    batch (the same accumulation and seed): its AdamW, linear schedule, clipping and batches.
    Without a model, HaptTrainer divides a step's loss by its predicted tokens (the token
    mean); ``loss_type`` makes Trainer count them so for GPT-2 too."""
    from transformers import AutoModelForCausalLM, Trainer

    from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
    torch.manual_seed(0)  # RuntimeConfig's default seed builds these weights
    model = AutoModelForCausalLM.from_config(_config(),
                                             attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    model.loss_type = "ForCausalLM"
    rows = [{"input_ids": r, "labels": r} for r in _rows()]
    trainer = Trainer(model=model, args=_args(out, per_device=PER_DEVICE * WORLD),
                      train_dataset=rows)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": {h["step"]: h["loss"] for h in history},
            "lrs": {h["step"]: h["learning_rate"] for h in history},
            "weights": {n: p.detach().numpy().copy()
                        for n, p in model.named_parameters(remove_duplicate=False)}}


def _worker(rank: int, world_size: int, root: str) -> dict:
    full = _train(f"{root}/full")
    if rank == 0:  # the checkpoint of step SAVE_AT only, in a fresh run directory
        shutil.copytree(f"{root}/full/checkpoint-{SAVE_AT}",
                        f"{root}/resumed/checkpoint-{SAVE_AT}")
    torch.distributed.barrier()
    resumed = _train(f"{root}/resumed", resume=f"{root}/resumed/checkpoint-{SAVE_AT}")
    own = _train(f"{root}/own", own_optimizer=True)
    return {"full": full, "resumed": resumed, "own": own}


def _close(got: dict, ref: dict, what: str) -> list[str]:
    errors = []
    for n, w in got.items():
        try:
            torch.testing.assert_close(torch.as_tensor(w), torch.from_numpy(ref[n]),
                                       rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            errors.append(f"{what} {n}: {str(e).splitlines()[:3]}")
    return errors


def test_sharded_uneven_trainer_matches_one_process_and_resumes_exactly(tmp_path):
    from transformers import AutoModelForCausalLM
    ref = run_ranks(_one_process, 1, str(tmp_path / "ref"), init_process_group=False)[0].value
    assert sorted(ref["losses"]) == list(range(1, STEPS + 1))
    outs = [o.value for o in run_ranks(_worker, WORLD, str(tmp_path), timeout_s=240)]
    for rank, out in enumerate(outs):
        full, resumed = out["full"], out["resumed"]
        errors = _close(full["weights"], ref["weights"], "weight")
        # the script's own AdamW and scheduler, sharded, train the same
        errors += _close(out["own"]["weights"], ref["weights"], "own optimizer")
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        for step in range(1, STEPS + 1):
            assert full["losses"][step] == pytest.approx(ref["losses"][step],
                                                         rel=RTOL, abs=ATOL), step
            assert full["lrs"][step] == pytest.approx(ref["lrs"][step], rel=1e-12), step
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert resumed["losses"][step] == full["losses"][step], (rank, step)
            assert resumed["lrs"][step] == full["lrs"][step], (rank, step)
        for k, v in full["weights"].items():
            assert (resumed["weights"][k] == v).all(), (rank, k)
    # the exported model of the last checkpoint is the one process's model
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full" / f"checkpoint-{STEPS}"))
    errors = _close({n: p.detach() for n, p in exported.named_parameters()}, ref["weights"],
                    "exported")
    assert not errors, "\n".join(errors)
    # the script's own optimizer was sharded too, and its scheduler saw it step
    assert [outs[r]["own"]["optimizer"] for r in (1, 2)] == ["ShardedOptimizer"] * 2
    assert not any(o[k]["scheduler_warnings"] for o in outs for k in ("full", "own", "resumed"))
    # the last stage's two replicas each hold a part of its Adam state, together all of it
    last = [outs[r]["full"] for r in (1, 2)]
    assert all(o["optimizer"] == "ShardedOptimizer" for o in last)
    assert all(0 < o["state"] < len(o["weights"]) for o in last)
    assert sum(o["state"] for o in last) == len(last[0]["weights"])
    assert outs[0]["full"]["optimizer"] != "ShardedOptimizer"


# -- a checkpoint whose optimizer state was kept otherwise is refused --------------------------

def test_a_checkpoint_of_another_optimizer_setting_is_refused(tmp_path):
    from dataclasses import replace

    from hapt_hf.integration.trainer_checkpoint import CheckpointError, check_resumable
    for name in ("trainer_state.json", "model.safetensors", "hapt_rank0.pt", "hapt_rank1.pt",
                 "hapt_rank2.pt"):
        (tmp_path / name).write_text("")
    sharded = _plan()
    sharded.save(tmp_path / "plan.json")
    check_resumable(tmp_path, sharded, 3)  # the same plan: fine
    replicated = replace(sharded, stages=(sharded.stages[0],
                                          replace(sharded.stages[1], optimizer="replicated")))
    with pytest.raises(CheckpointError, match=r"optimizer state \['replicated', 'sharded'\], "
                                              r"this run's plan keeps it \['replicated', "
                                              r"'replicated'\]"):
        check_resumable(tmp_path, replicated, 3)


class _SavedShard:
    """Stands for a sharded optimizer at save time: its state dict is one replica's shard."""

    def state_dict(self) -> dict:
        from hapt_hf.pipeline.zero import SHARD_KEY
        return {"state": {}, "param_groups": [{"params": [0], "lr": 1e-3}],
                SHARD_KEY: {"stage": 1, "replica": 0, "replicas": 2, "owned": [0]}}


def test_a_plain_optimizer_never_takes_a_shard(tmp_path):
    from hapt_hf.integration.trainer_checkpoint import (CheckpointError, load_rank_state,
                                                        save_rank_state)
    save_rank_state(tmp_path, 1, _SavedShard(), None)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(CheckpointError, match="holds one shard of a sharded optimizer state"):
        load_rank_state(tmp_path, 1, plain, None)
    assert not plain.state
