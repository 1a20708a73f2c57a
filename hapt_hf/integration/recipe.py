"""The fine-tuning recipe shared by ``recipes/finetune_gpt2.py`` and ``recipes/finetune_llama.py``.

Order matters for bad input: everything a user can get wrong (hapt config, model family, data
file and column, launch, plan vs world size) is checked before anything is written, so a
refused run leaves the output directory as it found it.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from hapt_hf.errors import HaptError
from hapt_hf.integration.config import HaptPlugin
from hapt_hf.integration.data import DataError, TextDataConfig, load_text_dataset
from hapt_hf.integration.launch import (LaunchEnv, LaunchError, check_model_family, format_plan,
                                        init_process_group, read_launch_env, resolve_plan,
                                        write_plan)
from hapt_hf.pipeline.comm import PipelineFailure

__all__ = ["RecipeDefaults", "build_parser", "main"]


@dataclass(frozen=True)
class RecipeDefaults:
    """What a recipe uses when the user names no model or data."""

    family: str
    """'gpt2': the recipe trains gpt2 models; 'llama': every other accepted model type."""
    model_dir: Path
    """Directory with the built-in small model's config.json."""
    data_file: Path
    tokenizer_dir: Path


def build_parser(defaults: RecipeDefaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"Fine-tune a {defaults.family} model with hapt_hf "
                                "pipeline parallelism (run it under `accelerate launch`).")
    p.add_argument("--hapt_config", help="hapt.yaml (default: $HAPT_CONFIG)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name_or_path", help="local directory or hub name (default: the "
                   f"built-in small model {defaults.model_dir.name})")
    p.add_argument("--tokenizer_name", help="default: the model's, else the shipped tokenizer")
    p.add_argument("--train_file", help="local .json/.jsonl/.txt (default: the shipped corpus)")
    p.add_argument("--validation_file")
    p.add_argument("--text_column", default="text")
    p.add_argument("--seq_len", type=int, help="default: the hapt config's, else 64")
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--logging_steps", type=float, default=1)
    p.add_argument("--save_steps", type=float, default=0, help="0: save only at the end")
    p.add_argument("--save_total_limit", type=int)
    p.add_argument("--eval_steps", type=float, default=0, help="0: evaluate only at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report_to", default="none", help="e.g. tensorboard")
    p.add_argument("--resume_from_checkpoint", help="a checkpoint-N directory, or 'last'")
    p.add_argument("--disable_tqdm", action="store_true")
    p.add_argument("--verify_checkpoint", action="store_true",
                   help="after saving, reload the model with from_pretrained on rank 0 and check "
                        "its logits equal the pipeline's on one batch")
    if defaults.family == "llama":
        p.add_argument("--lora_r", type=int, default=0, help="LoRA rank through peft (0: off)")
    return p


def _model_dir(args, defaults: RecipeDefaults, launch: LaunchEnv) -> tuple[Path, bool]:
    """(directory with config.json, whether it holds weights) for a local dir or a hub name."""
    name = args.model_name_or_path
    if name is None:
        return defaults.model_dir, False
    path = Path(name)
    if not path.is_dir():
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors",
                                                            "tokenizer*"]))
    if not (path / "config.json").is_file():
        raise LaunchError(f"--model_name_or_path {name!r} has no config.json; give a directory "
                          "written by save_pretrained or a hub model name")
    weights = any(path.glob("*.safetensors"))
    return path, weights


def _tokenizer(args, model_dir: Path, defaults: RecipeDefaults):
    from transformers import AutoTokenizer

    if args.tokenizer_name:
        return AutoTokenizer.from_pretrained(args.tokenizer_name)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(defaults.tokenizer_dir))


def _check_family(config, defaults: RecipeDefaults) -> None:
    """The GPT-2 recipe trains gpt2; the LLaMA recipe every other accepted type (its LoRA
    option adapts the q/k/v/o projections those models name alike)."""
    check_model_family(config)
    is_gpt2 = config.model_type == "gpt2"
    if is_gpt2 != (defaults.family == "gpt2"):
        other = "finetune_gpt2.py" if is_gpt2 else "finetune_llama.py"
        raise LaunchError(f"model type {config.model_type!r} is not a {defaults.family} model; "
                          f"use recipes/{other}")


def _training_args(args, plan, output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.num_microbatches, max_steps=args.max_steps,
        num_train_epochs=args.num_train_epochs, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type, max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps, logging_first_step=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or None,
        save_total_limit=args.save_total_limit,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        seed=args.seed, report_to=[] if args.report_to == "none" else args.report_to.split(","),
        disable_tqdm=args.disable_tqdm, use_cpu=not torch.cuda.is_available())


# (rtol, atol) of --verify_checkpoint. In fp32 the pipeline's logits equal one process's to
# float rounding. In 16 bits the pipeline also rounds the residual stream to the compute dtype at
# every stage boundary (it travels so), which one process does not, and a GPU's kernels round
# otherwise than the CPU's: the check then allows a few units of the dtype's rounding.
VERIFY_TOLERANCE = {"fp32": (1e-5, 4e-5), "bf16": (5e-2, 5e-2), "fp16": (1e-2, 1e-2)}


def _verify(trainer, runtime, rows: torch.Tensor, output_dir: Path, rank: int) -> None:
    from hapt_hf.pipeline.runtime import Batch

    batch = rows[: trainer.plan.global_batch_size]
    logits = runtime.predict_logits(Batch(input_ids=batch))
    if rank != 0:
        return
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline.precision import compute_context

    model = AutoModelForCausalLM.from_pretrained(
        str(output_dir), attn_implementation=trainer.plan.attn_implementation).eval()
    dtype = trainer.plan.dtype
    with torch.no_grad(), compute_context(dtype, "cpu"):  # one process, the plan's precision
        ref = model(input_ids=batch).logits.float()
    diff = (ref - logits).abs().max().item()
    torch.save({"input_ids": batch, "pipeline_logits": logits}, output_dir / "verify_logits.pt")
    rtol, atol = VERIFY_TOLERANCE[dtype]
    ok = torch.allclose(ref, logits, rtol=rtol, atol=atol)
    print(f"verify_checkpoint: from_pretrained logits vs pipeline logits max |diff| = {diff:.3e} "
          f"({'OK' if ok else 'MISMATCH'})", flush=True)
    if not ok:
        raise RuntimeError("the saved checkpoint's logits differ from the pipeline's")


def _run(args, defaults: RecipeDefaults) -> None:
    from transformers import AutoConfig

    plugin = HaptPlugin.from_args_or_env(args.hapt_config)
    launch = read_launch_env()
    model_dir, has_weights = _model_dir(args, defaults, launch)
    model_config = AutoConfig.from_pretrained(str(model_dir))
    _check_family(model_config, defaults)
    tokenizer = _tokenizer(args, model_dir, defaults)
    if len(tokenizer) > model_config.vocab_size:
        raise LaunchError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size "
                          f"is {model_config.vocab_size}; use the model's own tokenizer")
    seq_len = args.seq_len or plugin.seq_len or 64
    data = TextDataConfig(Path(args.train_file or defaults.data_file), args.text_column, seq_len,
                          Path(args.validation_file) if args.validation_file else None)
    train_rows, eval_rows = load_text_dataset(data, tokenizer)
    init_process_group(launch, plugin.timeout_s)
    plan = resolve_plan(plugin, model_config, seq_len, launch)
    if (args.eval_steps or args.validation_file) and len(eval_rows) < plan.global_batch_size:
        flag = "--eval_steps" if args.eval_steps else "--validation_file"
        raise DataError(f"{flag} needs at least one global batch ({plan.global_batch_size} "
                        f"samples) of eval data, but there are {len(eval_rows)}; give a larger "
                        "--validation_file or leave --eval_steps out")
    if launch.is_main:
        print(format_plan(plan), flush=True)
    _train(args, defaults, plugin, launch, plan, model_config, model_dir if has_weights else None,
           tokenizer, train_rows, eval_rows)


def _train(args, defaults, plugin, launch, plan, model_config, weights_dir, tokenizer,
           train_rows, eval_rows) -> None:
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig

    training_args = _training_args(args, plan, args.output_dir)
    # The plan's precision (the hapt config's, resolved on the cluster) is the one setting:
    # the runtime autocasts to it and scales the loss where it says so.
    runtime = PipelineRuntime(plan, model_config, RuntimeConfig(
        timeout_s=plugin.timeout_s, seed=args.seed,
        checkpoint_dir=str(weights_dir) if weights_dir else None))
    try:
        if getattr(args, "lora_r", 0):
            from hapt_hf.integration.lora import apply_lora
            apply_lora(runtime.stage, args.lora_r)
        _fit(args, plan, launch, runtime, training_args, tokenizer, train_rows, eval_rows)
    finally:
        runtime.shutdown()  # the watchdog thread ends before the process group goes
    if launch.is_main:
        print(f"saved a Hugging Face checkpoint to {args.output_dir} (load it with "
              f"AutoModelForCausalLM.from_pretrained({str(args.output_dir)!r})) and the plan "
              f"that ran to {Path(args.output_dir) / 'plan.json'}", flush=True)


class _WritePlanAtStart(TrainerCallback):
    """Writes plan.json as training begins: after a resumed checkpoint has loaded (and been
    agreed on) on every rank, so that a refused run leaves the output directory as it was."""

    def __init__(self, plan, output_dir: str, launch: LaunchEnv) -> None:
        self.plan, self.output_dir, self.launch = plan, output_dir, launch

    def on_train_begin(self, args, state, control, **kwargs):
        write_plan(self.plan, self.output_dir, self.launch)


def _fit(args, plan, launch, runtime, training_args, tokenizer, train_rows, eval_rows) -> None:
    from hapt_hf.integration.trainer import HaptTrainer

    # a held-out slice smaller than a global batch cannot be evaluated: the run goes without
    can_evaluate = len(eval_rows) >= plan.global_batch_size

    trainer = HaptTrainer(runtime, plan, training_args, train_dataset=train_rows,
                          eval_dataset=eval_rows if can_evaluate else None,
                          processing_class=tokenizer)
    # Everything else is checked: the output directory is written from the start of training.
    trainer.add_callback(_WritePlanAtStart(plan, args.output_dir, launch))
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    if can_evaluate and not args.eval_steps:
        trainer.evaluate()  # with --eval_steps the last step has evaluated already
    if getattr(args, "lora_r", 0):
        from hapt_hf.integration.lora import merge_lora
        merge_lora(runtime.stage)
    trainer.save_model()
    trainer.save_state()
    if args.verify_checkpoint:
        _verify(trainer, runtime, eval_rows if can_evaluate else train_rows,
                Path(args.output_dir), launch.rank)


def main(defaults: RecipeDefaults, argv: list[str] | None = None) -> int:
    args = build_parser(defaults).parse_args(argv)
    try:
        _run(args, defaults)
    except HaptError as e:
        # a user error: every rank raises the same refusal (checks run on every rank, or are
        # agreed on); anything else is a bug and keeps its traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except PipelineFailure as e:
        # each rank names the one that failed and adds what it was doing itself
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
