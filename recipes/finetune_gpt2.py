"""Fine-tune a GPT-2 model with hapt_hf pipeline parallelism.

    accelerate launch --config_file recipes/configs/accelerate_cpu.yaml --num_processes 4 \
        recipes/finetune_gpt2.py --hapt_config recipes/configs/hapt_cpu_demo.yaml \
        --max_steps 20 --output_dir OUT

With no --model_name_or_path it builds the small model of recipes/models/gpt2-tiny; with no
--train_file it trains on the text shipped in recipes/data with the tokenizer shipped there.
It takes every TrainingArguments flag (--bf16, --optim, --save_steps, ...) besides its own;
docs/usage.md lists them, with the defaults the recipe changes.
"""
import sys
from pathlib import Path

from hapt_hf.integration.recipe import RecipeDefaults, main

HERE = Path(__file__).resolve().parent

DEFAULTS = RecipeDefaults(
    family="gpt2",
    model_dir=HERE / "models" / "gpt2-tiny",
    data_file=HERE / "data" / "tiny_corpus.jsonl",
    tokenizer_dir=HERE / "data" / "tokenizer",
)

if __name__ == "__main__":
    sys.exit(main(DEFAULTS))
