"""Fine-tune a LLaMA-shaped model (LLaMA, Mistral, Qwen2), or any other accepted model type but
gpt2 (Qwen3, Gemma 2, Phi... docs/models.md), with hapt_hf pipeline parallelism.

    accelerate launch --config_file recipes/configs/accelerate_cpu.yaml --num_processes 4 \
        recipes/finetune_llama.py --hapt_config recipes/configs/hapt_cpu_demo_llama.yaml \
        --max_steps 20 --output_dir OUT

With no --model_name_or_path it builds the small model of recipes/models/llama-tiny; with no
--train_file it trains on the text shipped in recipes/data with the tokenizer shipped there.
Add --lora_r 8 to train LoRA adapters (through peft) instead of every weight.
It takes every TrainingArguments flag (--bf16, --optim, --save_steps, ...) besides its own;
docs/usage.md lists them, with the defaults the recipe changes.
"""
import sys
from pathlib import Path

from hapt_hf.integration.recipe import RecipeDefaults, main

HERE = Path(__file__).resolve().parent

DEFAULTS = RecipeDefaults(
    family="llama",
    model_dir=HERE / "models" / "llama-tiny",
    data_file=HERE / "data" / "tiny_corpus.jsonl",
    tokenizer_dir=HERE / "data" / "tokenizer",
)

if __name__ == "__main__":
    sys.exit(main(DEFAULTS))
