"""HaptTrainer and the plan's precision: TrainingArguments' bf16/fp16 must agree with the plan
(or be left to it), and a resumed fp16 run continues with the saved loss scale exactly as an
uninterrupted one."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hapt_hf.integration.trainer import HaptTrainer, TrainingArgsError
from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

SEQ, VOCAB, MBS, M = 8, 97, 2, 2
G = MBS * M
STEPS, SAVE_AT = 6, 3


def _plan(dtype: str, world_size: int = 2) -> Plan:
    plan = Plan("tiny-gpt2", 6, SEQ, G, MBS, M, "1f1b", (
        Stage.even(0, (0, 4), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
        Stage.even(1, (4, 6), "cpu", "cpu", tuple(range(1, world_size)), 1, micro_batch_size=MBS)))
    return replace(plan, dtype=dtype,
                   loss_scaling="dynamic" if dtype == "fp16" else None).validate()


def _args(out: str, world_size: int = 1, **kw):
    """One step is the plan's global batch: per device x accumulation (M) x processes."""
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=G // (M * world_size),
                             gradient_accumulation_steps=M, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, **kw)


def _unbuilt(plan: Plan) -> SimpleNamespace:
    """Stands for a runtime not built yet: the plan is all a refusal may read of it."""
    return SimpleNamespace(plan=plan)


# -- agreement --------------------------------------------------------------------------------

def test_accelerates_mixed_precision_must_agree_with_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(TrainingArgsError, match=r"mixed_precision=fp16 .* computes in bf16"):
        HaptTrainer(args=_args(str(tmp_path / "out")), runtime=_unbuilt(_plan("bf16")))
    from hapt_hf.integration.trainer_checks import training_args_precision_mismatch
    assert training_args_precision_mismatch(_args(str(tmp_path / "out")), _plan("fp16")) is None


@pytest.mark.parametrize("plan_dtype,flags,named", [
    ("fp32", {"bf16": True}, ["bf16=True", "fp32"]),
    ("fp32", {"fp16": True}, ["fp16=True", "fp32"]),
    ("bf16", {"fp16": True}, ["fp16=True", "bf16", "set bf16=True instead"]),
    ("fp16", {"bf16": True}, ["bf16=True", "fp16 with dynamic loss scaling"]),
    ("bf16", {"bf16_full_eval": True}, ["bf16_full_eval=True", "bf16"]),
])
def test_training_args_that_disagree_with_the_plan_are_refused_naming_both(
        tmp_path, plan_dtype, flags, named):
    out = tmp_path / "out"
    with pytest.raises(TrainingArgsError) as e:
        # refused before the runtime is touched and before anything is written
        HaptTrainer(args=_args(str(out), **flags), runtime=_unbuilt(_plan(plan_dtype)))
    for text in named:
        assert text in str(e.value), (text, str(e.value))
    assert not out.exists()


# -- agree -> trains; resume keeps the loss scale ----------------------------------------------

def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def _rows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (G * STEPS, SEQ), generator=torch.Generator().manual_seed(1))


def _train(dtype: str, out: str, flags: dict, resume: str | None = None, **runtime_kw) -> dict:
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    runtime = PipelineRuntime(_plan(dtype), _config(), RuntimeConfig(timeout_s=60, **runtime_kw))
    trainer = HaptTrainer(args=_args(
        out, 2, max_steps=STEPS, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT,
        learning_rate=1e-3, lr_scheduler_type="linear", **flags), runtime=runtime,
        train_dataset=_rows())
    trainer.train(resume_from_checkpoint=resume)
    scaler = runtime.loss_scaler
    result = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
              "weights": {k: v.detach().numpy().copy()
                          for k, v in runtime.stage.state_dict().items()},
              "scaler": None if scaler is None else scaler.state_dict()}
    runtime.shutdown()
    return result


# growth every clean step from a scale the tiny model's fp16 gradients overflow at within a few
# steps: the scale at the checkpoint is not the initial one, and steps are skipped after it
SCALER = {"loss_scale_init": 2.0 ** 17, "loss_scale_growth_interval": 1}


def _fp16_resume(rank: int, world_size: int, root: str) -> dict:
    full = _train("fp16", f"{root}/full", {"fp16": True}, **SCALER)
    if rank == 0:  # the checkpoint of step 3 only, in a fresh run directory
        shutil.copytree(f"{root}/full/checkpoint-{SAVE_AT}", f"{root}/resumed/checkpoint-{SAVE_AT}")
    torch.distributed.barrier()
    resumed = _train("fp16", f"{root}/resumed", {}, resume=f"{root}/resumed/checkpoint-{SAVE_AT}",
                     **SCALER)
    bf16 = _train("bf16", f"{root}/bf16", {"bf16": True})  # agrees: trains
    return {"full": full, "resumed": resumed, "bf16": bf16}


@pytest.mark.multiproc
def test_fp16_resume_continues_with_the_saved_loss_scale_exactly(tmp_path):
    outs = [o.value for o in run_ranks(_fp16_resume, 2, str(tmp_path))]
    full, resumed = outs[0]["full"], outs[0]["resumed"]
    # the job did overflow and back off, so the scale's history matters
    assert full["scaler"]["skipped_steps"] >= 1 and full["scaler"]["scale"] != SCALER["loss_scale_init"]
    assert resumed["scaler"] == full["scaler"]
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed["losses"][step] == full["losses"][step], step
    for out in outs:
        for k, v in out["full"]["weights"].items():
            assert (out["resumed"]["weights"][k] == v).all(), k
    assert outs[0]["bf16"]["scaler"] is None and len(outs[0]["bf16"]["losses"]) == STEPS
    assert Path(tmp_path, "bf16", f"checkpoint-{STEPS}").is_dir()


def test_a_checkpoint_of_another_precision_is_refused(tmp_path):
    from hapt_hf.integration.trainer_checkpoint import CheckpointError, check_resumable
    for name in ("trainer_state.json", "model.safetensors", "hapt_rank0.pt", "hapt_rank1.pt"):
        (tmp_path / name).write_text("")
    _plan("fp16").save(tmp_path / "plan.json")
    check_resumable(tmp_path, _plan("fp16"), 2)  # same plan, same precision: fine
    with pytest.raises(CheckpointError, match="fp16 with dynamic loss scaling, this run trains "
                                              "in bf16"):
        check_resumable(tmp_path, _plan("bf16"), 2)
