"""The calls transformers' run_clm_no_trainer.py makes, in its order, with HaptAccelerator on 3-4
Gloo ranks against plain Accelerate on ONE process whose batch is the global one divided by the
accumulation: per-step losses, learning rates, eval loss and final weights agree; the model
saved with save_function=accelerator.save loads with from_pretrained; a run resumed from a
mid-epoch save_state (written inside an accumulation window, as the script's
checkpointing_steps does) with skip_first_batches ends bit for bit where the whole run ends."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SEQ, GA, PER_DEVICE, PER_EVAL, STEPS, CKPT = 16, 2, 1, 2, 6, 2
STEPS_PER_EPOCH = 7  # per-process batches: windows of 2, 2, 2 and a short one of 1
RTOL, ATOL = 1e-5, 4e-5


def _rows(n: int, seed: int):
    """A datasets.Dataset of packed token rows as run_clm's group_texts makes them."""
    from datasets import Dataset

    ids = torch.randint(0, 1024, (n, SEQ), generator=torch.Generator().manual_seed(seed)).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ for _ in ids],
                              "labels": [list(r) for r in ids]})


def _hapt_config(tmp: Path, kind: str, world: int):
    """A hand-written uneven plan: embedding + 2 blocks | 4 blocks + head on the other ranks
    (a stage of two replicas), or for 4 ranks | 3 blocks on two replicas | 1 block + head."""
    from hapt_hf.integration.config import HaptConfig

    g = PER_DEVICE * world * GA
    if world == 4:
        stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=2),
                  Stage.even(1, (3, 6), "cpu", "cpu", (1, 2), 2, micro_batch_size=2),
                  Stage.even(2, (6, 8), "cpu", "cpu", (3,), 1, micro_batch_size=2))
    else:
        stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=2),
                  Stage.even(1, (3, 8), "cpu", "cpu", (1, 2), 1, micro_batch_size=2))
    plan = Plan(f"{kind}-tiny", 8, SEQ, g, 2, g // 2, "h1f1b", stages).validate(world_size=world)
    # no global_batch_size: the training DataLoader defines it
    return HaptConfig(plan=plan.save(tmp / "plan.json"), schedule="h1f1b", seq_len=SEQ, timeout_s=60)


def _np(t):
    return t.detach().float().numpy().copy()


def clm(rank: int, world: int, tmp: str, kind: str, procs: int, resume: str | None = None) -> dict:
    """run_clm_no_trainer's calls; ``procs``: the processes of the hapt run (a one-process
    reference takes their batches together)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import (AutoConfig, AutoModelForCausalLM, default_data_collator,
                              get_scheduler)

    from hapt_hf import HaptAccelerator  # the script's one changed import

    hapt = world > 1
    if hapt:
        accelerator = HaptAccelerator(gradient_accumulation_steps=GA, cpu=True,
                                      hapt_plugin=_hapt_config(Path(tmp), kind, world))
    else:
        accelerator = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    set_seed(0)
    config = AutoConfig.from_pretrained(str(ROOT / f"recipes/models/{kind}-tiny"))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    per_device, per_eval = (PER_DEVICE, PER_EVAL) if hapt else (PER_DEVICE * procs, PER_EVAL * procs)
    train_dataloader = torch.utils.data.DataLoader(
        _rows(STEPS_PER_EPOCH * procs * PER_DEVICE, 3), shuffle=True,
        collate_fn=default_data_collator, batch_size=per_device)
    eval_dataloader = torch.utils.data.DataLoader(
        _rows(procs * PER_EVAL + 3, 5), collate_fn=default_data_collator, batch_size=per_eval)
    no_decay = ["bias", "layer_norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0}], lr=1e-2)
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer,
                                 num_warmup_steps=1 * accelerator.num_processes,
                                 num_training_steps=STEPS * accelerator.num_processes)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / GA)
    num_train_epochs = math.ceil(STEPS / num_update_steps_per_epoch)
    completed_steps, starting_epoch, resume_step = 0, 0, None
    if resume:
        accelerator.load_state(resume)
        resume_step = int(os.path.basename(resume).replace("step_", "")) * GA
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // GA
        resume_step -= starting_epoch * len(train_dataloader)
    got = {"len": len(train_dataloader), "updates": [], "lr": [], "eval": []}
    micro, lr_sum = [], 0.0
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        if resume and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                micro.append(loss.item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    lr_sum += optimizer.param_groups[0]["lr"]  # the tests' own figure
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            got["lr"].append(lr_scheduler.get_last_lr()[0])
            if accelerator.sync_gradients:
                completed_steps += 1
                got["updates"].append(sum(micro) / len(micro))
                micro = []
            if completed_steps % CKPT == 0:
                accelerator.save_state(os.path.join(tmp, f"step_{completed_steps}"))
            if completed_steps >= STEPS:
                break
        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(per_eval)))
        losses = torch.cat(losses)
        got["eval"].append((torch.mean(losses).item(), len(losses)))
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(os.path.join(tmp, "out"), is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        got["weights"] = {k: _np(v) for k, v in state.items()}
    if not hapt:  # the reference's Adam second moments: which gradients stayed below its eps
        got["adam_rms"] = {n: _np(optimizer.state[p]["exp_avg_sq"].sqrt())
                           for n, p in accelerator.unwrap_model(model).named_parameters()
                           if p in optimizer.state}
        got["adam"] = {k: optimizer.param_groups[0][k] for k in ("eps", "betas")}
        got["lr_sum"] = lr_sum
    return got


@pytest.mark.multiproc
@pytest.mark.parametrize("kind, procs", [("gpt2", 4), ("llama", 3)])
def test_run_clm_calls_match_one_process_and_resume_exactly(tmp_path, kind, procs):
    from transformers import AutoModelForCausalLM

    for name in ("ref", "run", "resumed"):
        (tmp_path / name).mkdir()
    ref = run_ranks(clm, 1, str(tmp_path / "ref"), kind, procs, timeout_s=240)[0].value
    outs = run_ranks(clm, procs, str(tmp_path / "run"), kind, procs, timeout_s=240)
    got = outs[0].value
    assert got["len"] == ref["len"] == STEPS_PER_EPOCH
    assert len(got["updates"]) == STEPS and all(o.value["updates"] == got["updates"] for o in outs)
    torch.testing.assert_close(torch.tensor(got["updates"]), torch.tensor(ref["updates"]),
                               rtol=RTOL, atol=ATOL)
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    assert [n for _, n in got["eval"]] == [n for _, n in ref["eval"]] == [procs * PER_EVAL + 3] * 2
    assert [e for e, _ in got["eval"]] == pytest.approx([e for e, _ in ref["eval"]], rel=RTOL)
    for k, v in ref["weights"].items():
        torch.testing.assert_close(torch.from_numpy(got["weights"][k]), torch.from_numpy(v),
                                   rtol=RTOL, atol=ATOL, msg=k)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "out")).state_dict()
    for k, v in got["weights"].items():
        assert torch.equal(loaded[k], torch.from_numpy(v)), k
    # step_2 was last written inside the third window (its first micro-step had run)
    resumed = run_ranks(clm, procs, str(tmp_path / "resumed"), kind, procs,
                        str(tmp_path / "run" / "step_2"), timeout_s=240)[0].value
    assert resumed["updates"] == got["updates"][2:]
    assert resumed["lr"] == got["lr"][2 * GA:]
    assert resumed["eval"] == got["eval"]
    for k, v in got["weights"].items():
        assert (resumed["weights"][k] == v).all(), k
