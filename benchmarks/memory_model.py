"""Memory-model benchmark: the planner's kept bytes against what autograd keeps, per layer.

    python3 benchmarks/memory_model.py [--seq 64 256] [--dtypes fp32 bf16] [--micro-batch 1]

For every supported family (the tiny built-in configs, dropout off: PyTorch's CPU dropout
keeps wider masks than the GPU kernels the model counts), each attention implementation, each
sequence length and compute dtype, it builds the embedding, one block and the head as the
runtime builds them and prints a markdown table: the planner's bytes
(``act_keep_bytes * micro_batch + act_keep_fixed_bytes``), the bytes autograd saved for the
backward (saved-tensor hooks, weights excluded) and their ratio. 16-bit dtypes run under
autocast over fp32 weights, as the runtime trains.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS  # noqa: E402
from hapt_hf.planner.model_spec import model_config  # noqa: E402
from hapt_hf.profiling import layer_memory  # noqa: E402

__all__ = ["FAMILY_MODELS", "rows", "main"]

FAMILY_MODELS = ("gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny", "opt-tiny")
_DROPOUT = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout", "attention_dropout")


def _config(name: str):
    cfg = model_config(name)
    for k in _DROPOUT:
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    return cfg


def rows(seq_lens, dtypes, micro_batch: int = 1):
    """(model, attention, seq, dtype, LayerMemory) for every combination."""
    import torch
    for name in FAMILY_MODELS:
        for attn in ATTN_IMPLEMENTATIONS:
            for dtype in dtypes:
                for s in seq_lens:
                    torch.manual_seed(0)
                    for m in layer_memory(_config(name), s, dtype, attn, micro_batch):
                        yield name, attn, s, dtype, m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[64, 256])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--micro-batch", type=int, default=1)
    args = p.parse_args(argv)
    print("| model | attention | seq | dtype | layer | planner bytes | autograd bytes | ratio |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    worst = 0.0
    for name, attn, s, dtype, m in rows(args.seq, args.dtypes, args.micro_batch):
        worst = max(worst, abs(m.ratio - 1))
        print(f"| {name} | {attn} | {s} | {dtype} | {m.kind} | {m.planned_bytes:,.0f} | "
              f"{m.measured_bytes:,.0f} | {m.ratio:.3f} |")
    print(f"\nlargest deviation: {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
