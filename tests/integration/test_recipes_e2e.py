"""The recipes end to end under `accelerate launch`, with 2 and 4 CPU processes (Gloo): the
README demo, the LLaMA recipe against ``transformers.Trainer`` on one process (and resumed, and
with LoRA from a saved model), a model type without a hand family with TrainingArguments flags.

Kept tiny (6-block models, seq 32-64, 10 steps): each launch pays the import of torch and
transformers in every rank, which dominates on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.integration.data import TextDataConfig, load_text_dataset, rows_dataset
from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
ACCELERATE_CFG = RECIPES / "configs" / "accelerate_cpu.yaml"
LLAMA = RECIPES / "models" / "llama-tiny"
SEQ, STEPS, LR = 32, 10, 3e-3


def _launch(nproc: int, script: str, hapt: Path, out: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ACCELERATE_CFG), "--num_processes", str(nproc), str(RECIPES / script),
           "--hapt_config", str(hapt), "--output_dir", str(out), "--disable_tqdm", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def _losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def _check_checkpoint(out: Path) -> AutoModelForCausalLM:
    """from_pretrained on one process; its logits equal the pipeline's on the same batch."""
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION).eval()
    saved = torch.load(out / "verify_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["pipeline_logits"], rtol=1e-5, atol=4e-5)
    return model


def _falls(losses: list[float]) -> bool:
    return sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05


def test_readme_demo_gpt2_four_processes_uneven_plan(tmp_path):
    out = tmp_path / "out"
    log = _launch(4, "finetune_gpt2.py", RECIPES / "configs" / "hapt_cpu_demo.yaml", out,
                  "--max_steps", str(STEPS), "--verify_checkpoint")
    plan = Plan.load(out / "plan.json")
    assert plan.world_size == 4 and f"{plan.num_stages} stages on 4 ranks" in log
    assert len({s.num_layers for s in plan.stages}) > 1, "the demo plan should be uneven"
    losses = _losses(out)
    assert len(losses) == STEPS and _falls(losses), losses
    model = _check_checkpoint(out)
    # Tied input/output embeddings survive the gather from the first and last stage.
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def _llama_plan(tmp_path: Path) -> Path:
    """An uneven 2-rank plan written by hand: 4 blocks + embedding | 2 blocks + head."""
    plan = Plan(model_name="llama-tiny", num_layers=8, seq_len=SEQ, global_batch_size=4,
                micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                stages=(Stage.even(0, (0, 5), "a", "cpu", (0,), 2, micro_batch_size=1),
                        Stage.even(1, (5, 8), "b", "cpu", (1,), 1, micro_batch_size=1)))
    plan.save(tmp_path / "plan.json")
    hapt = tmp_path / "hapt.yaml"
    hapt.write_text(f"plan: plan.json\nschedule: 1f1b\nglobal_batch_size: 4\nseq_len: {SEQ}\n"
                    "timeout_s: 120\n")
    return hapt


def one_process_trainer(rank: int, world: int, out: str, steps: int) -> list[float]:
    """``transformers.Trainer`` on one process, the full model, the recipe's data and defaults,
    with the per-device batch of the 2-rank run's whole step (2 x 2): the losses to expect.
    Run in a fresh process (run_ranks) so that this one's accelerate state stays as it was."""
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    config = AutoConfig.from_pretrained(LLAMA)
    set_seed(0)  # as the recipe builds a model without weights (--seed 0)
    model = AutoModelForCausalLM.from_config(config)
    tok = AutoTokenizer.from_pretrained(RECIPES / "data" / "tokenizer")
    rows, _ = load_text_dataset(TextDataConfig(RECIPES / "data" / "tiny_corpus.jsonl",
                                               seq_len=SEQ), tok)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=LR, logging_steps=1, seed=0, save_strategy="no",
                             use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows_dataset(rows),
                      data_collator=default_data_collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _reference_losses(tmp_path: Path, steps: int) -> list[float]:
    return run_ranks(one_process_trainer, 1, str(tmp_path / "reference"), steps,
                     init_process_group=False, timeout_s=300)[0].value


def test_llama_two_processes_equals_one_process_and_resumes_exactly(tmp_path):
    hapt = _llama_plan(tmp_path)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["--max_steps", str(STEPS), "--learning_rate", str(LR), "--seq_len", str(SEQ)]
    _launch(2, "finetune_llama.py", hapt, full, *common, "--save_steps", "5",
            "--verify_checkpoint", "--report_to", "tensorboard")
    losses = _losses(full)
    assert len(losses) == STEPS and _falls(losses), losses
    # The logged loss is the global batch's: what one process training the whole model logs.
    torch.testing.assert_close(losses, _reference_losses(tmp_path, STEPS), rtol=1e-5, atol=4e-5)
    _check_checkpoint(full)
    assert (full / "checkpoint-5" / "hapt_rank1.pt").is_file()
    assert any((full / "runs").rglob("events.out.tfevents.*")), "no TensorBoard events written"

    _launch(2, "finetune_llama.py", hapt, resumed, *common,
            "--resume_from_checkpoint", str(full / "checkpoint-5"))
    assert _losses(resumed) == losses  # steps 1-5 from the checkpoint, 6-10 recomputed


def test_llama_lora_from_a_saved_checkpoint(tmp_path):
    """Fine-tune the weights of a saved model directory (built on the meta device: each rank
    reads its own stage's tensors) with LoRA: only the adapted projections change."""
    hapt = _llama_plan(tmp_path)
    base, lora = tmp_path / "base", tmp_path / "lora"
    common = ["--learning_rate", str(LR), "--seq_len", str(SEQ)]
    _launch(2, "finetune_llama.py", hapt, base, "--max_steps", "2", *common)
    _launch(2, "finetune_llama.py", hapt, lora, "--max_steps", "3", *common,
            "--model_name_or_path", str(base), "--lora_r", "4", "--verify_checkpoint")
    assert len(_losses(lora)) == 3
    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    after = _check_checkpoint(lora).state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")
                           for k in changed), sorted(changed)


def test_llama_recipe_trains_a_type_without_a_hand_family(tmp_path):
    """A tiny Qwen3 written to a model directory: planned from the model reader's figures on the
    4-rank demo cluster, trained by the generic stage builder, saved whole and reloaded."""
    from benchmarks.chain_check import tiny_config

    config = tiny_config("qwen3", blocks=4)
    config.vocab_size = 1024  # the shipped tokenizer's
    config.max_position_embeddings = 128
    config.save_pretrained(tmp_path / "qwen3-tiny")
    out = tmp_path / "out"
    log = _launch(4, "finetune_llama.py", RECIPES / "configs" / "hapt_cpu_demo_llama.yaml", out,
                  "--model_name_or_path", str(tmp_path / "qwen3-tiny"), "--max_steps", "6",
                  "--seq_len", str(SEQ), "--learning_rate", str(LR), "--verify_checkpoint",
                  # TrainingArguments flags the recipe passes on as they are
                  "--lr_scheduler_type", "cosine", "--warmup_steps", "2", "--optim", "adamw_torch",
                  "--gradient_checkpointing", "--save_steps", "3", "--save_total_limit", "1")
    plan = Plan.load(out / "plan.json")
    assert plan.world_size == 4 and f"{plan.num_stages} stages on 4 ranks" in log
    assert plan.num_stages >= 2  # cut by the generic stage builder, not one copy per rank
    losses = _losses(out)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))), losses
    model = _check_checkpoint(out)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 4
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    lrs = [h["learning_rate"] for h in history if "loss" in h]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[1], lrs  # warm-up, then the cosine decay
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
