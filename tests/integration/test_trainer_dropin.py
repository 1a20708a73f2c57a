"""HaptTrainer as a drop-in for ``transformers.Trainer``: the calls transformers' own
``examples/pytorch/language-modeling/run_clm.py`` makes (the same constructor keywords, in the
same order), with only the class name changed, on Gloo ranks, against ``Trainer`` itself on ONE
process whose per-device batch is the whole data-parallel batch (the same global batch).

What must hold: every logged training loss and learning rate equal (rtol 1e-5), the eval loss
over every row and ``compute_metrics``' accuracy equal, the saved model loads with
``from_pretrained`` and equals one process's, and a run checkpointed and resumed in fresh
processes reproduces the uninterrupted run bit for bit (also with a sharded-optimizer stage).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "hapt_hf" / "data" / "clusters" / "cpu_demo_4.yaml"
SEQ = 16
RTOL, ATOL = 1e-5, 4e-5


def _config(kind: str):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(ROOT / "recipes" / "models" / f"{kind}-tiny"))
    config.num_hidden_layers = 4  # small and quick; every dropout stays 0 (the configs' own)
    return config


def _datasets(n_train: int = 40, n_eval: int = 13):
    """Packed rows as run_clm's group_texts makes them: input_ids, attention_mask, labels."""
    import datasets
    g = torch.Generator().manual_seed(7)

    def make(n):
        ids = torch.randint(0, 1024, (n, SEQ), generator=g).tolist()
        return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ] * n,
                                           "labels": ids})
    return make(n_train), make(n_eval)


def _metrics_fns():
    """run_clm's own: accuracy of the next-token argmax."""
    def preprocess_logits_for_metrics(logits, labels):
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}
    return preprocess_logits_for_metrics, compute_metrics


def _script(rank: int, world: int, cls_name: str, kind: str, out: str, per_device: int,
            steps: int, hapt: dict | None, resume: str | None = None, save_steps: int = 0,
            lora: bool = False):
    """run_clm.py's calls, with ``cls_name`` the trainer class."""
    from transformers import (AutoModelForCausalLM, Trainer, TrainingArguments,
                              default_data_collator, set_seed)

    from hapt_hf import HaptConfig, HaptTrainer  # the one line a Trainer script changes
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                             per_device_eval_batch_size=per_device, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=3e-3, warmup_steps=2,
                             lr_scheduler_type="linear", logging_steps=1, seed=42,
                             save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, report_to=[], disable_tqdm=True)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(_config(kind))
    if lora:  # as a PEFT user does
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
    train_dataset, eval_dataset = _datasets()
    preprocess, compute = _metrics_fns()
    extra = {} if cls_name == "Trainer" or not hapt else {"hapt_config": HaptConfig(**hapt)}
    cls = Trainer if cls_name == "Trainer" else HaptTrainer
    trainer = cls(model=model, args=args, train_dataset=train_dataset,
                  eval_dataset=eval_dataset, processing_class=None,
                  data_collator=default_data_collator, compute_metrics=compute,
                  preprocess_logits_for_metrics=preprocess, **extra)
    train_result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    trainer.create_model_card(finetuned_from=kind, tasks="text-generation")
    logs = [(h["step"], h["loss"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h]
    return {"logs": logs, "eval_loss": eval_metrics["eval_loss"],
            "accuracy": eval_metrics["eval_accuracy"],
            "world": (args.world_size, args.process_index, trainer.is_world_process_zero())}


def _one_process(kind, out, per_device, steps, resume=None, save_steps=0, lora=False):
    return run_ranks(_script, 1, "Trainer", kind, out, per_device, steps, None, resume, save_steps,
                     lora, init_process_group=False)[0].value


def _hapt(world, kind, out, per_device, steps, hapt, resume=None, save_steps=0, lora=False):
    return [o.value for o in run_ranks(_script, world, "HaptTrainer", kind, out, per_device, steps,
                                       hapt, resume, save_steps, lora, timeout_s=300)]


def _assert_same_training(ref: dict, got: dict, exact: bool = False) -> None:
    assert [s for s, _, _ in got["logs"]] == [s for s, _, _ in ref["logs"]]
    for (step, loss, lr), (_, ref_loss, ref_lr) in zip(got["logs"], ref["logs"]):
        if exact:
            assert (loss, lr) == (ref_loss, ref_lr), step
        else:
            assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL), step
            assert lr == pytest.approx(ref_lr, rel=1e-12), step


def _load(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_run_clm_calls_train_as_trainer_on_one_process(tmp_path, kind):
    world, per_device, steps = 4, 1, 6  # 4 x 1 x 2 = 8 samples a step: 5 steps an epoch
    ref = _one_process(kind, str(tmp_path / "ref"), per_device * world, steps)
    got = _hapt(world, kind, str(tmp_path / "hapt"), per_device, steps,
                {"cluster": CLUSTER, "schedule": "h1f1b"})
    _assert_same_training(ref, got[0])
    assert all(g["logs"] == got[0]["logs"] for g in got)  # every rank logs the same losses
    # Trainer sees the launched world: one main process
    assert [g["world"] for g in got] == [(4, r, r == 0) for r in range(4)]
    # eval over all 13 rows (not whole global batches only), and run_clm's accuracy
    assert got[0]["eval_loss"] == pytest.approx(ref["eval_loss"], rel=RTOL, abs=ATOL)
    assert got[0]["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    ref_sd, got_sd = _load(str(tmp_path / "ref")), _load(str(tmp_path / "hapt"))
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(got_sd[k], ref_sd[k], rtol=1e-4, atol=1e-5, msg=k)
    results = json.loads((tmp_path / "hapt" / "all_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(got[0]["eval_loss"])
    assert (tmp_path / "hapt" / "plan.json").is_file()
    assert (tmp_path / "hapt" / "README.md").is_file()  # the model card, from rank 0


def test_the_class_name_alone_changed_plans_the_launched_processes_as_alike(tmp_path, monkeypatch):
    """No hapt config, no HAPT_CONFIG: the two CPU processes are planned as one group of alike
    devices, and the run still equals Trainer on one process."""
    monkeypatch.delenv("HAPT_CONFIG", raising=False)
    ref = _one_process("llama", str(tmp_path / "ref"), 4, 3)
    got = _hapt(2, "llama", str(tmp_path / "hapt"), 2, 3, {})
    _assert_same_training(ref, got[0])
    plan = json.loads((tmp_path / "hapt" / "plan.json").read_text())
    assert plan["cluster"] == "local" and plan["global_batch_size"] == 8


def _sharded_plan(path: Path, kind: str) -> Path:
    """4 ranks: the embedding and a block on 2 replicas with sharded optimizer state (ZeRO-1),
    the other blocks and the head on one rank each; 8 samples a step."""
    from hapt_hf.core.precision import SHARDED
    from hapt_hf.planner.plan import Plan, Stage
    layers = 4 + 2  # embedding + 4 blocks + head
    plan = Plan(f"{kind}-tiny", layers, SEQ, 8, 2, 4, "1f1b", (
        Stage.even(0, (0, 2), "cpu", "cpu", (0, 1), 3, optimizer=SHARDED, micro_batch_size=2),
        Stage.even(1, (2, 4), "cpu", "cpu", (2,), 2, micro_batch_size=2),
        Stage.even(2, (4, layers), "cpu", "cpu", (3,), 1, micro_batch_size=2))).validate(world_size=4)
    return plan.save(path)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_resume_reproduces_the_uninterrupted_run_with_a_sharded_optimizer_stage(tmp_path, kind):
    plan = {"plan": _sharded_plan(tmp_path / "plan.json", kind), "schedule": "1f1b"}
    whole = _hapt(4, kind, str(tmp_path / "whole"), 1, 6, plan, save_steps=3)
    assert (tmp_path / "whole" / "checkpoint-3").is_dir()
    # fresh processes, a fresh output directory holding the checkpoint, as a user resumes
    import shutil
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    resumed = _hapt(4, kind, str(tmp_path / "resumed"), 1, 6, plan, save_steps=3,
                    resume=str(tmp_path / "resumed" / "checkpoint-3"))
    # the history up to step 3 comes with the checkpoint (as Trainer's); 4 to 6 ran again
    assert [s for s, _, _ in resumed[0]["logs"]] == [1, 2, 3, 4, 5, 6]
    assert resumed[0]["logs"] == whole[0]["logs"]  # bit for bit: losses and LRs
    assert resumed[0]["eval_loss"] == whole[0]["eval_loss"]
    a, b = _load(str(tmp_path / "whole")), _load(str(tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_a_peft_lora_model_trains_as_trainer_and_saves_its_adapter(tmp_path):
    """get_peft_model(model, LoraConfig(...)) given to HaptTrainer: the same adapters on each
    stage, only they train, and save_model writes the adapter as Trainer does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    plan = {"plan": _sharded_plan(tmp_path / "plan.json", "llama"), "schedule": "1f1b"}
    ref = _one_process("llama", str(tmp_path / "ref"), 4, 4, lora=True)
    got = _hapt(4, "llama", str(tmp_path / "hapt"), 1, 4, plan, lora=True)
    _assert_same_training(ref, got[0])
    assert got[0]["eval_loss"] == pytest.approx(ref["eval_loss"], rel=RTOL, abs=ATOL)
    assert (tmp_path / "hapt" / "adapter_config.json").is_file()
    loaded = {}
    for name in ("ref", "hapt"):
        base = AutoModelForCausalLM.from_config(_config("llama"))
        loaded[name] = {k: v for k, v in PeftModel.from_pretrained(
            base, str(tmp_path / name)).state_dict().items() if "lora_" in k}
    assert loaded["ref"].keys() == loaded["hapt"].keys() and loaded["ref"]
    for k, v in loaded["ref"].items():
        torch.testing.assert_close(loaded["hapt"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def _rows_stream():
    g = torch.Generator().manual_seed(1)
    for _ in range(64):
        ids = torch.randint(0, 1024, (SEQ,), generator=g).tolist()
        yield {"input_ids": ids, "attention_mask": [1] * SEQ, "labels": ids}


def _iterable(rank: int, world: int, cls_name: str, per_device: int) -> list[float]:
    """A datasets.IterableDataset (no length: max_steps), as Trainer takes it."""
    import datasets
    from transformers import (AutoModelForCausalLM, Trainer, TrainingArguments,
                              default_data_collator, set_seed)

    from hapt_hf import HaptTrainer
    args = TrainingArguments(output_dir=f"unused-{cls_name}", per_device_train_batch_size=per_device,
                             max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, save_strategy="no")
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config("llama"))
    stream = datasets.IterableDataset.from_generator(_rows_stream)
    cls = Trainer if cls_name == "Trainer" else HaptTrainer
    trainer = cls(model=model, args=args, train_dataset=stream, data_collator=default_data_collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_an_iterable_dataset_trains_as_trainer_on_one_process(tmp_path, monkeypatch):
    monkeypatch.delenv("HAPT_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    ref = run_ranks(_iterable, 1, "Trainer", 4, init_process_group=False)[0].value
    got = run_ranks(_iterable, 2, "HaptTrainer", 2)[0].value
    assert got == pytest.approx(ref, rel=RTOL, abs=ATOL) and len(got) == 3
