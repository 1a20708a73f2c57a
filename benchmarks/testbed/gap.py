"""What gap the profiler measures for a delay-hook slow-down: profile, slow, profile again.

    python3 -m benchmarks.testbed.gap --factor 2.5 --rounds 3

Profiles a GPT-2 (hidden 256, sequence 64, the race's layer shapes) in this one process, first as
it is, then with the testbed's slow-down hook installed, and prints slowed / plain forward+backward
per layer kind for every round (one JSON line each). No other process is involved: this measures
the hook itself, not the machine's load balance between ranks.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _hooks():
    spec = importlib.util.spec_from_file_location("testbed_hooks",
                                                  Path(__file__).parent / "site/testbed_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_round(factor: float, hooks) -> dict[str, float]:
    from transformers import GPT2Config
    from hapt_hf.profiling import ProfilerOptions, profile_model
    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=64, vocab_size=2048,
                        bos_token_id=0, eos_token_id=0)
    options = ProfilerOptions(micro_batches=(1,), budget_s=1.0)
    plain = profile_model(config, device_name="plain", seq_len=64, options=options)
    handles = hooks.install_slowdown(factor)
    try:
        slowed = profile_model(config, device_name="slowed", seq_len=64, options=options)
    finally:
        for h in handles:
            h.remove()
    kind = {k.layer_signature: k.layer_signature.split(":")[0] for k in plain.timings}
    total = {kind[k.layer_signature]: t.forward_s + t.backward_s for k, t in plain.timings.items()}
    return {kind[k.layer_signature]: round((t.forward_s + t.backward_s)
                                           / total[kind[k.layer_signature]], 2)
            for k, t in slowed.timings.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factor", type=float, default=2.5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    hooks = _hooks()
    for _ in range(args.rounds):
        print(json.dumps({"factor": args.factor, **one_round(args.factor, hooks)}), flush=True)


if __name__ == "__main__":
    main()
