"""Model reader benchmark: a 405B-class config read into a ModelSpec, its time and memory.

    python3 benchmarks/model_reader.py [--type llama|qwen3] [--seq-len 4096] [--dtype bf16]

Builds a config of the LLaMA 3.1 405B shape (hidden 16384, MLP 53248, 126 blocks, 128 heads,
8 key/value heads, vocabulary 128256) of the given model type and reads its layer sequence
through the model reader (:func:`hapt_hf.profiling.model_reader.read_model`, the path
``hapt_hf.model_spec`` takes for every accepted type: whole blocks and
halves). Prints one JSON line: the
seconds taken, the growth of the process's peak resident memory over the read, and the model's
parameter count. For ``--type llama`` it also gives the largest relative difference of the kept
bytes from the hand formula's.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

__all__ = ["config_405b", "main"]

SHAPE_405B = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                  num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)


def config_405b(model_type: str):
    """A config of ``model_type`` with the LLaMA 3.1 405B shape (no weights anywhere)."""
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **SHAPE_405B, head_dim=128)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="llama", help="model type of the config (default llama)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args(argv)
    from hapt_hf.profiling.model_reader import read_model

    config = config_405b(args.type)
    before = _peak_rss_bytes()
    t0 = time.perf_counter()
    read = read_model(config, args.seq_len, args.dtype)
    layers = read.layers
    out = {"type": args.type, "seconds": round(time.perf_counter() - t0, 2),
           "peak_rss_growth_bytes": _peak_rss_bytes() - before,
           "params": sum(l.params for l in layers), "layers": len(layers),
           "half_layers": len(read.half_layers)}
    if args.type == "llama":
        from hapt_hf.planner.model_spec import ModelSpec
        formula = ModelSpec.from_formula(config, args.seq_len, args.dtype).layers
        out["kept_vs_formula"] = max(
            abs((a.act_keep_bytes + a.act_keep_fixed_bytes)
                / (b.act_keep_bytes + b.act_keep_fixed_bytes) - 1) for a, b in zip(layers, formula))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
