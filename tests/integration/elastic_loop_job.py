"""The training job of the ``accelerate launch`` elastic test (test_elastic_accelerate_launch.py):
an Accelerate loop on HaptAccelerator (a tiny GPT-2 on fixed random rows) that resumes by itself
on an elastic restart (``accelerator.resume_if_restarted()``).

``python elastic_loop_job.py OUT CLUSTER PAUSE_AT``: the plan is made by rank 0 from the cluster
file (each node's group found by its hostname, ``HAPT_HOSTNAME``); the state is saved after
step ``SAVE_AT`` (Accelerate's automatic naming: ``OUT/checkpoints/checkpoint_0``); rank 0
appends each step (its pid, the state it resumed, step, loss, world) to ``OUT/losses.jsonl``.
On the first start the ranks of node 1 stop after step ``PAUSE_AT`` (each writes
``OUT/paused-<rank>`` holding its pid and its agent's pid, then sleeps), so that the test kills
that node while the others wait for it in the next step.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

SEQ, VOCAB, STEPS, SAVE_AT = 8, 97, 6, 2
PER_DEVICE, ACCUMULATION, GLOBAL_BATCH = 1, 2, 8  # 1 x 2 x 4 processes


class Progress:
    """The loop's step counter, saved with the state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(out: str, cluster: str, pause_at: int) -> None:
    from accelerate.utils import ProjectConfiguration, set_seed
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig

    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"worker-{os.getpid()}").touch()  # the test ends every worker it started
    hapt = HaptConfig(cluster=Path(cluster), global_batch_size=GLOBAL_BATCH, seq_len=SEQ,
                      timeout_s=20)
    acc = HaptAccelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, hapt_plugin=hapt,
                          project_config=ProjectConfiguration(project_dir=out,
                                                              automatic_checkpoint_naming=True))
    set_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    dl = torch.utils.data.DataLoader(Rows(STEPS * GLOBAL_BATCH), batch_size=PER_DEVICE, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, acc.num_processes,
                                                STEPS * acc.num_processes)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    model, optimizer, dl, scheduler = acc.prepare(model, optimizer, dl, scheduler)
    resumed = acc.resume_if_restarted()
    first_start = resumed is None and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    micro: list[float] = []
    while progress.step < STEPS:
        for batch in dl:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                micro.append(loss.item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not acc.sync_gradients:
                continue
            progress.step += 1
            if acc.is_main_process:
                line = {"pid": os.getpid(), "resumed": resumed, "step": progress.step,
                        "loss": sum(micro) / len(micro), "world": acc.num_processes,
                        "t": time.time()}
                with open(Path(out) / "losses.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            micro = []
            if progress.step == SAVE_AT and first_start:
                acc.save_state()
            if first_start and progress.step == pause_at and os.environ.get("GROUP_RANK") == "1":
                rank = torch.distributed.get_rank()
                (Path(out) / f"paused-{rank}").write_text(f"{os.getpid()} {os.getppid()}")
                time.sleep(600)  # killed here with its node
            if progress.step == STEPS:
                break
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
