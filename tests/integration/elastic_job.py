"""The training job of the elastic end-to-end test (test_elastic_torchrun.py), started by
torchrun's elastic agents: a tiny GPT-2 trained by HaptTrainer on fixed random rows.

``python elastic_job.py OUT HAPT_YAML PAUSE_AT REJOIN_AT``: rank 0 appends each logged step
(its pid, step, loss, world) to ``OUT/losses.jsonl``. On the first start the ranks of node 1
stop after step ``PAUSE_AT`` (each writes ``OUT/paused-<rank>`` holding its pid and its agent's
pid, then sleeps), so that the test kills that node while the others wait for it in the next
step. On 2 ranks (the node left) the ranks stop once step ``REJOIN_AT`` is logged (each writes
``OUT/waiting-<rank>``, then sleeps) until the test has started the lost node again and the
agent restarts the workers.
Called as ``main(...)`` instead (the reference runs), it resumes the checkpoint it is given.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

SEQ, VOCAB, STEPS, SAVE_EVERY = 8, 97, 8, 2
PER_DEVICE, ACCUMULATION, PROCESSES = 1, 2, 4  # a global batch of 8 samples on 4 processes


def rows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))


def main(out: str, hapt_config: str, pause_at: int, resume: str | None = None,
         accumulation: int = ACCUMULATION, rejoin_at: int = 0) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from hapt_hf.integration.trainer import HaptTrainer

    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # the test ends every worker it started
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"worker-{os.getpid()}").touch()

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                line = {"pid": os.getpid(), "step": state.global_step, "loss": logs["loss"],
                        "world": torch.distributed.get_world_size(), "t": time.time()}
                with open(Path(out) / "losses.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            if resume is None and state.global_step == rejoin_at and logs and "loss" in logs and \
                    torch.distributed.get_world_size() == 2:  # after the step's line is written
                rank = torch.distributed.get_rank()
                (Path(out) / f"waiting-{rank}").write_text(str(os.getpid()))
                time.sleep(600)  # stopped here by the agent when the lost node is back

        def on_step_end(self, args, state, control, **kwargs):
            if start == 0 and state.global_step == pause_at and \
                    os.environ.get("GROUP_RANK") == "1" and resume is None:
                rank = torch.distributed.get_rank()
                (Path(out) / f"paused-{rank}").write_text(f"{os.getpid()} {os.getppid()}")
                time.sleep(600)  # killed here with its node

    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_DEVICE,
                             gradient_accumulation_steps=accumulation, max_steps=STEPS,
                             save_strategy="steps", save_steps=SAVE_EVERY, logging_steps=1,
                             learning_rate=1e-3, lr_scheduler_type="linear", use_cpu=True,
                             report_to=[], disable_tqdm=True, seed=0)
    trainer = HaptTrainer(model=model, args=args, train_dataset=rows(), hapt_config=hapt_config,
                          callbacks=[Record()])
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.runtime.shutdown()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": {h["step"]: h["loss"] for h in history}, "plan": trainer.plan.to_dict()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), rejoin_at=int(sys.argv[4]))
