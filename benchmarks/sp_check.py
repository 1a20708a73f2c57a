"""What sequence parallelism and the vocabulary-split head change on one rank of a TP-2 replica.

On 2 Gloo ranks (CPU), a LLaMA-shaped stage of blocks only (no embedding, no head) is built
three ways: whole on one rank (t = 1), sharded over both ranks (TP 2) and sharded with
sequence parallelism (TP 2 + sp). For each: the bytes one rank's forward leaves allocated
until its backward (glibc's heap in use after the forward less before it: what autograd keeps
for the backward, and the output), per block, and the median time of a forward and
backward. Korthikanti et al. (2-byte activations, with dropout masks) put a
block's activations per rank at ``s·b·h·(10 + 24/t)`` without sequence parallelism and
``s·b·h·34/t`` with it, attention scores aside; the ratios are compared with theirs.

Then the head stage alone (final norm, LM head, loss) at TP 2 with the head whole on each rank
(a tied config keeps it whole) and split by vocabulary rows: the head weight each rank holds
and the median forward and backward.

    python benchmarks/sp_check.py [--hidden 512 --seq 256 --batch 2 --blocks 2 --vocab 32000]

Times on a shared CPU are noisy and Gloo's collectives are slow: what the figures show is the
memory; the times say what the collectives cost here, not on a GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ranks import run_ranks  # noqa: E402


def _config(a: argparse.Namespace, tied: bool = False):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=a.blocks, hidden_size=a.hidden,
                       intermediate_size=a.hidden * 11 // 4, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=a.vocab,
                       max_position_embeddings=a.seq, tie_word_embeddings=tied)


class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (torch's CPU tensors included)."""
    info = ctypes.CDLL("libc.so.6").mallinfo2
    info.restype = _MallInfo
    m = info()
    return m.uordblks + m.hblkhd


def _kept_bytes(run) -> int:
    """Bytes the forward ``run`` leaves allocated for its backward: the heap in use after it,
    less before it and less its output."""
    gc.collect()
    before = _heap_in_use()
    out = run()
    kept = _heap_in_use() - before - out.untyped_storage().nbytes()
    del out
    return kept


def _timed(step, repeats: int) -> float:
    step()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rank: int, world_size: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.pipeline.tensor_parallel import full_state_dict, shard_stage
    torch.manual_seed(0)
    out: dict = {}
    x = torch.randn(a.batch, a.seq, a.hidden)
    for name, t, sp in (("t=1", 1, False), ("TP 2", 2, False), ("TP 2 + sp", 2, True)):
        stage = build_stage(_config(a), (1, 1 + a.blocks), seed=0)
        if t > 1:
            shard_stage(stage, stage.config, dist.group.WORLD, torch.device("cpu"),
                        sequence_parallel=sp)

        def run(stage=stage):
            return stage(x.detach().requires_grad_(True))

        def step(stage=stage, run=run):
            run().square().mean().backward()
        saved = statistics.median(_kept_bytes(run) for _ in range(3)) / a.blocks
        dist.barrier()
        out[name] = {"saved_per_block": saved, "step_s": _timed(step, a.repeats)}
        dist.barrier()
    for name, tied in (("head whole", True), ("head split", False)):
        config = _config(a, tied)
        stage = build_stage(config, (1 + a.blocks, 2 + a.blocks), seed=0)
        shards = shard_stage(stage, config, dist.group.WORLD, torch.device("cpu"))
        labels = torch.randint(0, a.vocab, (a.batch, a.seq))
        weight = stage.get_parameter("lm_head.weight")
        held = weight.to_local() if hasattr(weight, "to_local") else weight

        def head_step(stage=stage, labels=labels):
            stage(x.detach().requires_grad_(True), labels=labels).backward()
        out[name] = {"split": shards.head, "weight_bytes": held.numel() * held.element_size(),
                     "step_s": _timed(head_step, a.repeats),
                     "whole_rows": full_state_dict({"w": weight})["w"].shape[0]}
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    res = [o.value for o in run_ranks(measure, 2, a, timeout_s=600)]
    r0 = res[0]
    sbh = a.seq * a.batch * a.hidden * 4  # bytes of one fp32 [b, s, h] activation
    print(f"LLaMA-shaped blocks, hidden {a.hidden}, seq {a.seq}, batch {a.batch}, fp32, "
          f"2 Gloo ranks; rank 0's figures")
    print(f"{'':12s}{'kept/block (MiB)':>18s}{'rank 1':>9s}{'in s·b·h units':>16s}"
          f"{'fwd+bwd (s)':>13s}")
    for k in ("t=1", "TP 2", "TP 2 + sp"):
        v = r0[k]
        print(f"{k:12s}{v['saved_per_block'] / 2**20:18.2f}"
              f"{res[1][k]['saved_per_block'] / 2**20:9.2f}{v['saved_per_block'] / sbh:16.2f}"
              f"{v['step_s']:13.4f}")
    whole, tp, sp = (r0[k]["saved_per_block"] for k in ("t=1", "TP 2", "TP 2 + sp"))
    print(f"of one GPU's: TP 2 {tp / whole:.3f} (Korthikanti: (10 + 24/2) / 34 = {22 / 34:.3f}); "
          f"TP 2 + sp {sp / whole:.3f} (34/2 / 34 = 0.5)")
    for k in ("head whole", "head split"):
        v = r0[k]
        print(f"{k:12s} split={v['split']!s:5s} weight on rank 0 {v['weight_bytes'] / 2**20:7.2f} MiB "
              f"(of {v['whole_rows']} rows)  fwd+bwd {v['step_s']:.4f} s")


if __name__ == "__main__":
    main()
