"""An ordinary Accelerate training loop, run on a hapt pipeline plan.

    HAPT_CONFIG=recipes/configs/hapt_cpu_demo.yaml accelerate launch \
        --config_file recipes/configs/accelerate_cpu.yaml --num_processes 4 \
        examples/accelerate_loop.py --output_dir OUT

The lines that differ from plain Accelerate are marked ``# hapt``. The hapt config comes
from ``HAPT_CONFIG`` (or ``--hapt_config``). An optimizer step takes, as under Accelerate,
per-device batch x processes x gradient_accumulation_steps rows: 1 x 4 x 2 = 8, the demo
config's global_batch_size. On the tensor-parallel demo plan (a stage held by ranks 0 and 1
together) the same loop trains the LLaMA-shaped model:
``HAPT_CONFIG=recipes/configs/hapt_cpu_demo_tp.yaml ... --model recipes/models/llama-tiny``.

Under torchrun's elastic agent (docs/usage.md, Elastic runs) the loop goes on after a node is
lost or comes back with no hand step: with ``--save_steps N`` it saves its state every N steps
as ``OUT/checkpoints/checkpoint_<step>``, and ``accelerator.resume_if_restarted(...)`` loads the
newest of them on a restart (the step counter is registered for checkpointing, so it comes
back with the state).
"""
import argparse
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from hapt_hf import HaptAccelerator  # hapt
from hapt_hf.integration.data import TextDataConfig, collate_causal_lm, load_text_dataset

ROOT = Path(__file__).resolve().parents[1]


class Progress:
    """The loop's step counter, saved and loaded with the state (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--hapt_config")
    p.add_argument("--model", default=str(ROOT / "recipes/models/gpt2-tiny"),
                   help="directory of the config.json to build the model from (random weights)")
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=1)
    p.add_argument("--per_device_eval_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--save_steps", type=int, default=0,
                   help="save the state every N steps into OUT/checkpoints (0: at the end only)")
    args = p.parse_args()
    checkpoints = Path(args.output_dir) / "checkpoints"

    accelerator = HaptAccelerator(  # hapt
        gradient_accumulation_steps=args.gradient_accumulation_steps, log_with="tensorboard",
        project_dir=args.output_dir, hapt_plugin=args.hapt_config)
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "recipes/data/tokenizer"))
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_config(config)
    train_rows, eval_rows = load_text_dataset(TextDataConfig(
        ROOT / "recipes/data/tiny_corpus.jsonl", seq_len=args.seq_len), tokenizer)

    def collate(rows):
        return collate_causal_lm(torch.stack(rows))

    train_dl = torch.utils.data.DataLoader(train_rows, batch_size=args.per_device_train_batch_size,
                                           shuffle=True, collate_fn=collate)
    eval_dl = torch.utils.data.DataLoader(eval_rows, batch_size=args.per_device_eval_batch_size,
                                          collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Accelerate steps the scheduler num_processes times per optimizer step
    scheduler = get_scheduler("linear", optimizer,
                              num_warmup_steps=1 * accelerator.num_processes,
                              num_training_steps=args.max_steps * accelerator.num_processes)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    accelerator.resume_if_restarted(checkpoints)  # hapt: an elastic restart resumes by itself
    accelerator.init_trackers("accelerate_loop")

    window = []
    while progress.step < args.max_steps:
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                window.append(loss.item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.step += 1
                step, step_loss = progress.step, sum(window) / len(window)
                window = []
                accelerator.log({"loss": step_loss, "lr": scheduler.get_last_lr()[0]}, step=step)
                accelerator.print(f"step {step} loss {step_loss:.4f}")
                if args.save_steps and step % args.save_steps == 0:
                    accelerator.save_state(str(checkpoints / f"checkpoint_{step}"))
                if step == args.max_steps:
                    break

    model.eval()
    losses = []
    for batch in eval_dl:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    accelerator.print(f"eval loss {torch.cat(losses).mean().item():.4f}")

    accelerator.save_state(str(Path(args.output_dir) / "state"))
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process,
        save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
