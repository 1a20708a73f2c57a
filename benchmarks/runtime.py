"""hapt_hf's 1F1B against torch.distributed.pipelining's Schedule1F1B, in the same run.

Homogeneous CPU ranks (Gloo), a small GPT-2, the same uniform split, the same micro-batches and
the same stage modules (hapt_hf's stage builder, same seed) under both runtimes. Iterations of
the two alternate (hapt, torch, torch, hapt, ...) so that a slow phase of a shared machine hits
both alike; each iteration is timed on rank 0 between two barriers. Both run forward and
backward only (no optimizer), and the embeddings are untied because torch's schedule does not
sum tied gradients across stages. The losses of the two are compared as a sanity check.

    python3 benchmarks/runtime.py --quick        # < 3 minutes; JSON on the last line

The last line is JSON with ``ratio_vs_torch_1f1b`` = median hapt tokens/s / median torch
tokens/s.

``--overlap`` measures something else: hapt_hf's gradient all-reduce overlapped with the last
backward (``RuntimeConfig.overlap_grad_sync``) against the same runtime with it off, on 4 ranks
as two 2-wide stages, iterations alternating on/off; the JSON then carries both medians and
``overlap_speedup`` = median off s / median on s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hapt_hf.core.layers import num_layers  # noqa: E402
from hapt_hf.core.schedules import ScheduleKind, default_warmups  # noqa: E402
from benchmarks.ranks import run_ranks  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    ranks: int = 2
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    seq: int = 128
    vocab: int = 4096
    micro_batch: int = 2
    microbatches: int = 8
    reps: int = 15
    warmup_reps: int = 2


def uniform_plan(cfg: BenchConfig):
    from hapt_hf.planner.plan import Plan, Stage
    per = [cfg.layers // cfg.ranks + (i < cfg.layers % cfg.ranks) for i in range(cfg.ranks)]
    warm = default_warmups(ScheduleKind.ONE_F_ONE_B, cfg.ranks, cfg.microbatches)
    stages, start = [], 0
    for i, b in enumerate(per):
        end = start + b + (i == 0) + (i == cfg.ranks - 1)
        stages.append(Stage.even(i, (start, end), "cpu", "cpu", (i,), warmup=warm[i],
                                 micro_batch_size=cfg.micro_batch))
        start = end
    g = cfg.micro_batch * cfg.microbatches
    return Plan("gpt2-bench", start, cfg.seq, g, cfg.micro_batch, cfg.microbatches,
                ScheduleKind.ONE_F_ONE_B, tuple(stages)).validate()


def two_wide_plan(cfg: BenchConfig):
    """Two stages of two replicas each (4 ranks), blocks split evenly."""
    from hapt_hf.planner.plan import Plan, Stage
    half = cfg.layers // 2
    mbs = cfg.micro_batch
    stages = (Stage.even(0, (0, half + 1), "cpu", "cpu", (0, 1), warmup=2, micro_batch_size=mbs),
              Stage.even(1, (half + 1, num_layers(cfg.layers)), "cpu", "cpu", (2, 3), warmup=1,
                         micro_batch_size=mbs))
    g = cfg.micro_batch * cfg.microbatches
    return Plan("gpt2-bench", num_layers(cfg.layers), cfg.seq, g, cfg.micro_batch,
                cfg.microbatches, ScheduleKind.ONE_F_ONE_B, stages).validate()


def bench_overlap(rank: int, world_size: int, cfg: BenchConfig, bucket_bytes: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config

    from hapt_hf.pipeline import Batch, PipelineRuntime, RuntimeConfig
    config = GPT2Config(n_layer=cfg.layers, n_embd=cfg.hidden, n_head=cfg.heads,
                        n_positions=cfg.seq, vocab_size=cfg.vocab, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    plan = two_wide_plan(cfg)
    rts = {name: PipelineRuntime(plan, config, RuntimeConfig(
        timeout_s=300, seed=0, overlap_grad_sync=(name == "on"), grad_bucket_bytes=bucket_bytes))
        for name in ("on", "off")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (plan.global_batch_size, cfg.seq), generator=g)
    batch = Batch(ids, ids.clone())
    times: dict[str, list[float]] = {"on": [], "off": []}
    launches: list[float] = []
    for r in range(cfg.warmup_reps + cfg.reps):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            for p in rts[name].parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            rts[name].forward_backward(batch)
            dist.barrier()
            if r >= cfg.warmup_reps:
                times[name].append(time.perf_counter() - t0)
    launches = rts["on"].bucket_launch_s
    for rt in rts.values():
        rt.shutdown()
    return {"times": times, "launches": launches}


def main_overlap(cfg: BenchConfig, bucket_bytes: int) -> dict:
    cfg = BenchConfig(**{**asdict(cfg), "ranks": 4})
    start = time.monotonic()
    outs = run_ranks(bench_overlap, 4, cfg, bucket_bytes, timeout_s=900, pg_timeout_s=600,
                     env={"OMP_NUM_THREADS": "1"})
    times = outs[0].value["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "overlap_speedup": round(med["off"] / med["on"], 4),
        "median_on_s": round(med["on"], 4), "median_off_s": round(med["off"], 4),
        "on_step_s": [round(t, 4) for t in times["on"]],
        "off_step_s": [round(t, 4) for t in times["off"]],
        "bucket_launch_s_rank0": [round(t, 4) for t in outs[0].value["launches"]],
        "bucket_bytes": bucket_bytes, "config": asdict(cfg),
        "wall_s": round(time.monotonic() - start, 1),
    }
    for k in ("on", "off"):
        print(f"overlap {k:>3}: median {med[k] * 1e3:8.1f} ms/iteration over "
              f"{len(times[k])} iterations")
    print(json.dumps(result))
    return result


def bench(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config

    from hapt_hf.pipeline import Batch, PipelineRuntime, RuntimeConfig
    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.pipeline.torch_pipelining import build_torch_pipeline

    config = GPT2Config(n_layer=cfg.layers, n_embd=cfg.hidden, n_head=cfg.heads,
                        n_positions=cfg.seq, vocab_size=cfg.vocab, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    plan = uniform_plan(cfg)
    hapt = PipelineRuntime(plan, config, RuntimeConfig(timeout_s=300, seed=0))
    stage = build_stage(config, plan.stage_of_rank(rank).layers, seed=0)
    torch_pp = build_torch_pipeline(plan, rank, stage, cfg.vocab)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (plan.global_batch_size, cfg.seq), generator=g)
    batch = Batch(ids, ids.clone())

    def run(name: str) -> float | None:
        params = hapt.parameters() if name == "hapt" else list(stage.parameters())
        for p in params:
            p.grad = None
        if name == "hapt":
            return hapt.forward_backward(batch)
        return torch_pp.forward_backward(ids, ids.clone())

    times: dict[str, list[float]] = {"hapt": [], "torch": []}
    losses: dict[str, float | None] = {}
    for r in range(cfg.warmup_reps + cfg.reps):
        for name in (("hapt", "torch") if r % 2 == 0 else ("torch", "hapt")):
            dist.barrier()
            t0 = time.perf_counter()
            losses[name] = run(name)
            dist.barrier()
            if r >= cfg.warmup_reps:
                times[name].append(time.perf_counter() - t0)
    hapt.shutdown()
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions")
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--overlap", action="store_true",
                    help="gradient all-reduce overlap on vs off, 4 ranks as two 2-wide stages")
    ap.add_argument("--bucket-mib", type=float, default=25.0,
                    help="with --overlap: gradient bucket size (the default is the runtime's)")
    args = ap.parse_args(argv)
    cfg = (BenchConfig(layers=4, hidden=128, seq=64, vocab=2048, reps=13) if args.quick
           else BenchConfig())
    if args.ranks:
        cfg = BenchConfig(**{**asdict(cfg), "ranks": args.ranks})
    if args.reps:
        cfg = BenchConfig(**{**asdict(cfg), "reps": args.reps})
    if args.overlap:
        return main_overlap(cfg, int(args.bucket_mib * 2**20))
    start = time.monotonic()
    outs = run_ranks(bench, cfg.ranks, cfg, timeout_s=900, pg_timeout_s=600,
                     env={"OMP_NUM_THREADS": "1"})
    times = outs[0].value["times"]
    last = outs[-1].value["losses"]
    tokens = cfg.micro_batch * cfg.microbatches * cfg.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "ratio_vs_torch_1f1b": round(med["torch"] / med["hapt"], 4),
        "hapt_tokens_per_s": round(tokens / med["hapt"], 1),
        "torch_1f1b_tokens_per_s": round(tokens / med["torch"], 1),
        "hapt_step_s": [round(t, 4) for t in times["hapt"]],
        "torch_step_s": [round(t, 4) for t in times["torch"]],
        "loss_hapt": last["hapt"], "loss_torch": last["torch"],
        "config": asdict(cfg), "wall_s": round(time.monotonic() - start, 1),
    }
    for k in ("hapt", "torch"):
        print(f"{k:>6}: median {med[k] * 1e3:8.1f} ms/iteration, "
              f"{tokens / med[k]:9.1f} tokens/s over {len(times[k])} iterations")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
