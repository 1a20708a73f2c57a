"""What splitting a stage's backward costs: the whole backward (``B``) against the input
gradient (``I``) then the weight gradients (``W``) as the runtime runs ``zero_bubble``
(``hapt_hf.compat.torch_api.backward_input`` / ``backward_weight``, torch's pipelining helpers).

One process, one middle stage of a GPT-2-shaped model (neither end: its input needs a
gradient), the two ways alternated micro-batch by micro-batch so that a busy machine slows
both alike; medians printed. The profiler measures the same ratios on every device it
profiles (``hapt_hf.profiling.overheads``, on a stage of two blocks) and the simulator prices
``I`` and ``W`` from them; without them it prices ``I + W`` as ``B``, and the difference
printed is what that leaves out on this device.

    python3 benchmarks/split_backward.py [--hidden 256] [--blocks 4] [--seq 128] [--batch 4]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()

    import torch
    from transformers import GPT2Config

    from hapt_hf.compat.torch_api import backward_input, backward_weight
    from hapt_hf.pipeline.stage import build_stage
    torch.set_num_threads(1)
    cfg = GPT2Config(n_layer=args.blocks, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                     n_positions=args.seq, vocab_size=512, bos_token_id=0, eos_token_id=0)
    stage = build_stage(cfg, (1, args.blocks + 1))  # every block, neither the embedding nor the head
    x0 = torch.randn(args.batch, args.seq, args.hidden)
    grad = torch.randn_like(x0)
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for _ in range(args.repeats):
        for split in (False, True):
            x = x0.clone().requires_grad_(True)
            t0 = time.perf_counter()
            out = stage(x)
            t1 = time.perf_counter()
            times["F"].append(t1 - t0)
            if not split:
                torch.autograd.backward(out, grad)
                times["B"].append(time.perf_counter() - t1)
                continue
            _, state = backward_input([out], [grad], [x], stage.parameters())
            t2 = time.perf_counter()
            backward_weight(list(stage.parameters()), state)
            times["I"].append(t2 - t1)
            times["W"].append(time.perf_counter() - t2)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"stage of {args.blocks} blocks, hidden {args.hidden}, {args.batch} x {args.seq} tokens, "
          f"one thread, median of {args.repeats}: F {ms['F']:.1f} ms, B {ms['B']:.1f} ms, "
          f"I {ms['I']:.1f} ms + W {ms['W']:.1f} ms = {ms['I'] + ms['W']:.1f} ms "
          f"({(ms['I'] + ms['W']) / ms['B']:.2f}x B)")


if __name__ == "__main__":
    main()
