"""An ordinary Accelerate training loop, run on a hapt pipeline plan.

    HAPT_CONFIG=recipes/configs/hapt_cpu_demo.yaml accelerate launch \
        --config_file recipes/configs/accelerate_cpu.yaml --num_processes 4 \
        examples/accelerate_loop.py --output_dir OUT

The two lines that differ from plain Accelerate are marked ``# hapt``. The hapt config comes
from ``HAPT_CONFIG`` (or ``--hapt_config``); the global batch is the DataLoader's batch_size x
gradient_accumulation_steps (2 x 4 = 8, the demo config's global_batch_size).
"""
import argparse
import math
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from hapt_hf.integration.accelerate_plugin import HaptAccelerator  # hapt
from hapt_hf.integration.data import TextDataConfig, collate_causal_lm, load_text_dataset

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--hapt_config")
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--seq_len", type=int, default=64)
    args = p.parse_args()

    accelerator = HaptAccelerator(gradient_accumulation_steps=4, log_with="tensorboard",  # hapt
                                  project_dir=args.output_dir, hapt_plugin=args.hapt_config)
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "recipes/data/tokenizer"))
    config = AutoConfig.from_pretrained(str(ROOT / "recipes/models/gpt2-tiny"))
    model = AutoModelForCausalLM.from_config(config)
    train_rows, eval_rows = load_text_dataset(TextDataConfig(
        ROOT / "recipes/data/tiny_corpus.jsonl", seq_len=args.seq_len), tokenizer)
    train_dl = torch.utils.data.DataLoader(train_rows, batch_size=2, shuffle=True,
                                           collate_fn=lambda rows: collate_causal_lm(torch.stack(rows)))
    eval_dl = torch.utils.data.DataLoader(eval_rows, batch_size=8,
                                          collate_fn=lambda rows: collate_causal_lm(torch.stack(rows)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1,
                              num_training_steps=args.max_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    accelerator.init_trackers("accelerate_loop")

    model.train()
    step = 0
    for _epoch in range(math.ceil(args.max_steps / len(train_dl))):
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step += 1
            accelerator.log({"loss": loss.item()}, step=step)
            accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break

    model.eval()
    losses = []
    with torch.no_grad():
        for batch in eval_dl:
            losses.append(accelerator.gather_for_metrics(model(**batch).loss))
    accelerator.print(f"eval loss {torch.stack(losses).mean().item():.4f}")

    accelerator.save_state(str(Path(args.output_dir) / "state"))
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        args.output_dir, state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
