"""The recipes' command line: their own options and every ``TrainingArguments`` flag.

As run_clm.py, ``HfArgumentParser((RecipeArguments, TrainingArguments))`` parses them; the
recipes change a few of Trainer's defaults (:data:`RECIPE_TRAINING_DEFAULTS`, and saving and
evaluating once at the end unless asked for). Parsing happens on every rank before any process
group: a flag argparse refuses is one ``error:`` line from rank 0 (the others exit with the same
status, silently), and a combination ``TrainingArguments`` refuses is a
:class:`RecipeArgumentError`, which the recipe reports as every user error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool

from hapt_hf.errors import ConfigError

__all__ = ["RecipeArguments", "LoraRecipeArguments", "RecipeArgumentError",
           "RECIPE_TRAINING_DEFAULTS", "RecipeParser", "build_parser", "parse_args",
           "is_main_process"]


class RecipeArgumentError(ConfigError):
    """A recipe flag, or a combination of TrainingArguments flags, that cannot be used."""


@dataclass
class RecipeArguments:
    """The recipe's own options; every other flag is a ``TrainingArguments`` field."""

    hapt_config: str | None = field(default=None, metadata={
        "help": "hapt.yaml: the cluster to plan on or a ready plan (default: $HAPT_CONFIG)"})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "local directory (config.json, safetensors weights, tokenizer) or hub name "
                "(default: the built-in small model, random weights from --seed)"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "default: the model directory's tokenizer, else the shipped one"})
    train_file: str | None = field(default=None, metadata={
        "help": "local .json/.jsonl (one object per line) or .txt (one sample per line) "
                "(default: the shipped corpus)"})
    validation_file: str | None = field(default=None, metadata={
        "help": "held-out data, as --train_file (default: the last 10%% of packed samples)"})
    text_column: str = field(default="text", metadata={"help": "the column with the text"})
    seq_len: int | None = field(default=None, metadata={
        "help": "tokens per packed sample (default: the hapt config's, else 64)"})
    verify_checkpoint: bool = field(default=False, metadata={
        "help": "after saving, reload the model with from_pretrained on rank 0 and check its "
                "logits equal the pipeline's on one batch"})


@dataclass
class LoraRecipeArguments(RecipeArguments):
    """The LLaMA recipe's options: the shared ones and LoRA."""

    lora_r: int = field(default=0, metadata={
        "help": "train LoRA adapters of this rank on the attention projections (peft), "
                "merged into the weights at the final save (0: off)"})


RECIPE_TRAINING_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-3, "num_train_epochs": 1.0, "logging_steps": 1,
    "logging_first_step": True, "report_to": "none", "seed": 0,
    # 2 x 1 x 4 processes = the README demo's global batch of 8 (hapt_cpu_demo.yaml)
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
}
"""TrainingArguments defaults the recipes change (``use_cpu`` too: True where there is no CUDA).
Saving and evaluating default to once, at the end: see :func:`_save_and_eval`."""

# Parsed with a None default, so that the recipe sees whether they were given at all.
_RESOLVED_AFTER_PARSING = ("output_dir", "save_strategy", "save_steps", "eval_strategy",
                           "eval_steps")


def is_main_process() -> bool:
    """Rank 0 (or no launcher): the rank that prints messages, read before any process group
    exists from the variables torchrun and mpirun set."""
    for name in ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(name, "") != "":
            return os.environ[name] == "0"
    return True


class RecipeParser(HfArgumentParser):
    """HfArgumentParser speaking from rank 0 only: ``--help``, and a usage error as one line
    (each rank exits with argparse's status 2, the others silently)."""

    def _print_message(self, message, file=None):
        if is_main_process():
            super()._print_message(message, file)

    def error(self, message):
        self.exit(2, f"error: {message}; `{self.prog} --help` lists every option\n")


def build_parser(family: str) -> RecipeParser:
    """The parser of the recipe for ``family`` ('gpt2', or 'llama' with LoRA)."""
    own = LoraRecipeArguments if family == "llama" else RecipeArguments
    parser = RecipeParser((own, TrainingArguments), description=(
        f"Fine-tune a {family} model with hapt_hf pipeline parallelism (run it under "
        "`accelerate launch`). Takes every TrainingArguments flag; docs/usage.md lists the "
        "recipe's defaults."))
    parser.set_defaults(**RECIPE_TRAINING_DEFAULTS, use_cpu=not torch.cuda.is_available(),
                        **dict.fromkeys(_RESOLVED_AFTER_PARSING))
    # HfArgumentParser makes a plain bool field a switch (--logging_first_step) but wants a
    # value for a `bool | None` one (--disable_tqdm True); the recipes take both as switches
    for action in parser._actions:
        if action.type is string_to_bool and action.nargs is None:
            action.nargs, action.const = "?", True
    return parser


def _field_default(name: str) -> Any:
    return next(f.default for f in fields(TrainingArguments) if f.name == name)


def _save_and_eval(values: dict[str, Any]) -> None:
    """``--save_steps N`` / ``--eval_steps N`` alone save / evaluate every N steps; with
    neither the step count nor the strategy given (or a count of 0) the recipe saves and
    evaluates once, at the end. A strategy given is kept as given."""
    for kind in ("save", "eval"):
        steps, strategy = values[f"{kind}_steps"], values[f"{kind}_strategy"]
        if strategy is None:
            values[f"{kind}_strategy"] = "steps" if steps else "no"
        if not steps:
            values[f"{kind}_steps"] = _field_default(f"{kind}_steps")


def parse_args(family: str, argv: list[str] | None = None
               ) -> tuple[RecipeArguments, TrainingArguments]:
    """The recipe's options and the TrainingArguments; a flag argparse refuses (unknown, a
    wrong type or choice) exits with status 2 after one line from rank 0, a combination
    TrainingArguments refuses raises :class:`RecipeArgumentError`."""
    parser = build_parser(family)
    values = vars(parser.parse_args(argv))
    if values["output_dir"] is None:
        parser.error("the following arguments are required: --output_dir")
    _save_and_eval(values)
    own_type = parser.dataclass_types[0]
    names = {f.name for f in fields(own_type)}
    own = own_type(**{k: v for k, v in values.items() if k in names})
    try:
        training = TrainingArguments(**{k: v for k, v in values.items() if k not in names})
    except ValueError as e:  # TrainingArguments' own checks of its fields, one by one
        raise RecipeArgumentError("TrainingArguments refuses the flags given: "
                                  + " ".join(str(e).split())) from None
    if own.seq_len is not None and own.seq_len < 2:
        raise RecipeArgumentError(f"--seq_len is {own.seq_len}; give at least 2 tokens")
    if getattr(own, "lora_r", 0) < 0:
        raise RecipeArgumentError(f"--lora_r is {own.lora_r}; give a rank >= 1, or 0 for none")
    return own, training
