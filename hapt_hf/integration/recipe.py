"""The fine-tuning recipe shared by ``recipes/finetune_gpt2.py`` and ``recipes/finetune_llama.py``.

As run_clm.py: ``HfArgumentParser((RecipeArguments, TrainingArguments))`` takes the recipe's own
options and every ``TrainingArguments`` flag (HaptTrainer honours or refuses each, by name); the
model comes from ``AutoModelForCausalLM``, the data is a ``datasets.Dataset`` of packed rows, and
``HaptTrainer`` takes Trainer's arguments plus the hapt config.

Bad input ends the run with one ``error:`` line from rank 0 and exit status 2 (a usage error:
argparse's own status), and leaves the output directory as it found it: what the recipe can
check (arguments, hapt config, resume checkpoint, model, tokenizer, data) is checked before the
trainer is built, HaptTrainer checks the rest before it writes, and an output directory this run
created and left empty is removed.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import TrainingArguments

from hapt_hf.errors import CheckpointError, HaptError
from hapt_hf.integration.config import HaptConfig
from hapt_hf.integration.data import DataError, TextDataConfig, load_text_dataset, rows_dataset
from hapt_hf.integration.launch import LaunchError
from hapt_hf.integration.plan_resolution import check_model_family
from hapt_hf.integration.recipe_args import (RecipeArgumentError, RecipeArguments,
                                             is_main_process, parse_args)
from hapt_hf.pipeline.failure import PipelineFailure

__all__ = ["RecipeDefaults", "VERIFY_TOLERANCE", "main"]


@dataclass(frozen=True)
class RecipeDefaults:
    """What a recipe uses when the user names no model or data."""

    family: str
    """'gpt2': the recipe trains gpt2 models; 'llama': every other accepted model type."""
    model_dir: Path
    """Directory with the built-in small model's config.json."""
    data_file: Path
    tokenizer_dir: Path


# -- model, tokenizer, data -------------------------------------------------------------------
def _looks_like_path(name: str) -> bool:
    """A hub name is 'model' or 'org/model'; anything else can only be a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _model_dir(name: str | None, defaults: RecipeDefaults) -> Path:
    """The directory with config.json (and weights, if any): local, or fetched from the hub."""
    if name is None:
        return defaults.model_dir.resolve()
    path = Path(name).expanduser()
    fix = ("give a directory written by save_pretrained (with config.json) or the name of a "
           "model on the Hugging Face Hub")
    if not path.is_dir():
        if path.exists() or _looks_like_path(name):
            what = "is not a directory" if path.exists() else "does not exist"
            raise RecipeArgumentError(f"--model_name_or_path {name!r} {what}; {fix}")
        path = _from_hub(name, fix)
    if not (path / "config.json").is_file():
        raise RecipeArgumentError(f"--model_name_or_path {name!r} has no config.json; {fix}")
    return path.resolve()


def _from_hub(name: str, fix: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors",
                                                            "tokenizer*"]))
    except (HFValidationError, OSError) as e:  # the hub's HTTP and cache errors are OSErrors
        reason = " ".join(str(e).split())
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise RecipeArgumentError(f"--model_name_or_path {name!r} is no local directory and "
                                  f"could not be fetched from the Hugging Face Hub "
                                  f"({type(e).__name__}: {reason}); {fix}") from None


def _tokenizer(name: str | None, model_dir: Path, defaults: RecipeDefaults):
    from transformers import AutoTokenizer

    if name:
        return AutoTokenizer.from_pretrained(name)
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


def _model(model_dir: Path, config, seed: int):
    """The model HaptTrainer cuts into stages. A directory with safetensors weights: built on
    the meta device, so that each rank reads only its own stage's tensors from the directory
    (``config.name_or_path``) and no rank holds the whole model. Other weights (``.bin``) are
    loaded whole; no weights: random ones from ``seed``, as run_clm.py (``set_seed`` and
    ``from_config``), so one process with the same seed builds the very same model."""
    from transformers import AutoModelForCausalLM, set_seed

    if any(model_dir.glob("*.safetensors")):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    if any(model_dir.glob("*.bin")):
        return AutoModelForCausalLM.from_pretrained(str(model_dir))
    set_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _resume_checkpoint(training_args: TrainingArguments) -> str | None:
    """``--resume_from_checkpoint`` as a directory (``last``: the newest ``checkpoint-N`` of the
    output directory); one that is not there is refused before anything is built."""
    from transformers.trainer_utils import get_last_checkpoint

    given, out = training_args.resume_from_checkpoint, training_args.output_dir
    if given is None:
        return None
    if given == "last":
        last = get_last_checkpoint(out) if os.path.isdir(out) else None
        if last is None:
            raise CheckpointError(f"--resume_from_checkpoint last but {out!r} holds no "
                                  "checkpoint-N directory; name a checkpoint, or leave the flag "
                                  "out to start afresh")
        return last
    if not os.path.isdir(given):
        raise CheckpointError(f"--resume_from_checkpoint {given!r} is not a directory; give a "
                              "checkpoint-N directory an earlier run wrote, or 'last'")
    return given


# -- the run ----------------------------------------------------------------------------------
# (rtol, atol) of --verify_checkpoint. In fp32 the pipeline's logits equal one process's to
# float rounding. In 16 bits the pipeline also rounds the residual stream to the compute dtype at
# every stage boundary (it travels so), which one process does not, and a GPU's kernels round
# otherwise than the CPU's: the check then allows a few units of the dtype's rounding.
VERIFY_TOLERANCE = {"fp32": (1e-5, 4e-5), "bf16": (5e-2, 5e-2), "fp16": (1e-2, 1e-2)}


def _verify(trainer, rows: torch.Tensor, output_dir: Path, rank: int) -> None:
    from hapt_hf.pipeline.runtime import Batch

    batch = rows[: trainer.plan.global_batch_size]
    logits = trainer.runtime.predict_logits(Batch(input_ids=batch))
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


def _run(args: RecipeArguments, training_args: TrainingArguments,
         defaults: RecipeDefaults) -> None:
    from transformers import AutoConfig, default_data_collator

    from hapt_hf.integration.trainer import HaptTrainer

    hapt = HaptConfig.from_args_or_env(args.hapt_config)
    seq_len = args.seq_len or hapt.seq_len or 64
    hapt = replace(hapt, seq_len=seq_len)  # --seq_len overrides the hapt config's
    resume = _resume_checkpoint(training_args)
    model_dir = _model_dir(args.model_name_or_path, defaults)
    model_config = AutoConfig.from_pretrained(str(model_dir))
    _check_family(model_config, defaults)
    tokenizer = _tokenizer(args.tokenizer_name, model_dir, defaults)
    if len(tokenizer) > model_config.vocab_size:
        raise LaunchError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size "
                          f"is {model_config.vocab_size}; use the model's own tokenizer")
    if not is_main_process():
        import datasets
        datasets.disable_progress_bars()
    data = TextDataConfig(Path(args.train_file or defaults.data_file), args.text_column, seq_len,
                          Path(args.validation_file) if args.validation_file else None)
    train_rows, eval_rows = load_text_dataset(data, tokenizer)
    if training_args.eval_strategy != "no" and len(eval_rows) == 0:
        raise DataError(f"--eval_strategy {training_args.eval_strategy.value} needs eval data, "
                        f"but the held-out tenth of {len(train_rows)} samples is empty; give "
                        "--validation_file or more training data")
    # rows of equal length: stacked as they are (as run_clm.py; the tokenizer has no pad token)
    trainer = HaptTrainer(model=_model(model_dir, model_config, training_args.seed),
                          args=training_args, data_collator=default_data_collator,
                          train_dataset=rows_dataset(train_rows),
                          eval_dataset=rows_dataset(eval_rows) if len(eval_rows) else None,
                          processing_class=tokenizer, hapt_config=hapt)
    try:
        _fit(args, trainer, resume, eval_rows if len(eval_rows) else train_rows)
    finally:
        trainer.runtime.shutdown()  # the watchdog thread ends before the process group goes
    if trainer.is_world_process_zero():
        out = training_args.output_dir
        print(f"saved a Hugging Face checkpoint to {out} (load it with "
              f"AutoModelForCausalLM.from_pretrained({out!r})) and the plan that ran to "
              f"{Path(out) / 'plan.json'}", flush=True)


def _evaluated_at_last_step(trainer) -> bool:
    step = trainer.state.global_step
    return any("eval_loss" in h and h.get("step") == step for h in trainer.state.log_history)


def _fit(args: RecipeArguments, trainer, resume: str | None, verify_rows: torch.Tensor) -> None:
    lora_r = getattr(args, "lora_r", 0)
    if lora_r:
        from hapt_hf.integration.lora import apply_lora, check_lora_plan
        check_lora_plan(trainer.runtime.plan)
        apply_lora(trainer.runtime.stage, lora_r)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    if trainer.eval_dataset is not None and not _evaluated_at_last_step(trainer):
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if lora_r:
        from hapt_hf.integration.lora import merge_lora
        merge_lora(trainer.runtime.stage)
    trainer.save_model()
    trainer.save_state()
    if args.verify_checkpoint:
        _verify(trainer, verify_rows, Path(trainer.args.output_dir), trainer.args.process_index)


def _remove_if_left_empty(root: Path) -> None:
    """Remove ``root`` (made by this run) if the refused run left nothing in it; every file
    written stays."""
    if not root.is_dir():
        return
    for where, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(where)  # only an empty directory goes
        except OSError:
            pass


def main(defaults: RecipeDefaults, argv: list[str] | None = None) -> int:
    """Run the recipe; the exit status: 0, 2 for a user error (one ``error:`` line on rank 0),
    1 when a rank of the pipeline failed."""
    out: Path | None = None
    try:
        try:
            args, training_args = parse_args(defaults.family, argv)
        except SystemExit as e:  # argparse: --help (0), or a usage error (2) printed already
            return e.code if isinstance(e.code, int) else 2
        out = Path(training_args.output_dir)
        out = None if out.exists() else out  # only a directory this run creates is removed
        _run(args, training_args, defaults)
    except HaptError as e:
        # a user error: every rank raises the same refusal (checks run on every rank, or are
        # agreed on); anything else is a bug and keeps its traceback
        if is_main_process():
            print(f"error: {e}", file=sys.stderr, flush=True)
            if out is not None:
                _remove_if_left_empty(out)
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
