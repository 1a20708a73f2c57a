"""Which accepted model types shard exactly under tensor parallelism (not shipped).

For each type (default: every hand-written family and verified generic type whose
``config.base_model_tp_plan`` the runtime accepts), a tiny config (benchmarks/chain_check.py
``tiny_config``, 2 blocks) is built whole as one stage on ``--tp`` Gloo ranks, sharded as the
runtime shards it (``tensor_parallel.shard_stage``; the whole parameters that see one shard's
heads summed over the ranks, as ``GradSync`` does), and one forward and backward with labels is
compared with one process: the loss, and every gradient (largest difference relative to the
largest reference gradient of that parameter). Prints one line per type.

    python benchmarks/tp_check.py [--tp 2] [--types llama,gemma3_text]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ranks import run_ranks  # noqa: E402

TOLERANCE = 1e-4
"""Largest relative gradient difference called a match (what was seen: below 1e-5)."""


def candidate_types() -> list[str]:
    """Accepted types whose plan the runtime takes, or refuses only for its plan's contents."""
    from transformers import AutoConfig

    from hapt_hf.core.families import verified_generic_types
    types = sorted(set(verified_generic_types()) | {"llama", "mistral", "qwen2", "gpt2", "opt"})
    return [t for t in types if getattr(AutoConfig.for_model(t), "base_model_tp_plan", None)]


def check_types(rank: int, world_size: int, types: list[str]) -> dict[str, tuple]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from benchmarks.chain_check import attention_for, tiny_config
    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.pipeline.tensor_parallel import shard_stage, tp_plan_refusal
    out: dict[str, tuple] = {}
    for t in types:
        try:
            config = tiny_config(t, blocks=2)
            why = tp_plan_refusal(config, world_size)
            if why:
                out[t] = ("refused", why)
                continue
            attn = attention_for(config)
            stage = build_stage(config, (0, config.num_hidden_layers + 2), seed=7,
                                attn_implementation=attn)
            shards = shard_stage(stage, config, dist.group.WORLD, torch.device("cpu"))
            torch.manual_seed(7)
            ref = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
            ids = torch.randint(0, config.vocab_size, (2, 8),
                                generator=torch.Generator().manual_seed(1))
            loss = stage(ids, labels=ids)
            ref_loss = ref(ids, labels=ids).loss * ids[:, 1:].numel()
            loss.backward()
            ref_loss.backward()
            for p in shards.partial:
                dist.all_reduce(p.grad)
            worst, compared = 0.0, 0
            for name, p in stage.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                r = ref.get_parameter(name).grad
                worst = max(worst, float((g - r).abs().max() / (r.abs().max() + 1e-12)))
                compared += 1
            dloss = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
            ok = dloss < TOLERANCE and worst < TOLERANCE
            out[t] = ("match" if ok else "DIFFERS", f"loss {dloss:.1e}, gradients {worst:.1e} "
                      f"({compared} parameters, {len(shards.modules)} modules sharded, "
                      f"{len(shards.partial)} whole ones summed)")
        except Exception as e:  # noqa: BLE001 - reported per type
            out[t] = ("crashed", f"{type(e).__name__}: {str(e)[:160]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--types", default=None, help="comma-separated model types")
    args = ap.parse_args(argv)
    types = args.types.split(",") if args.types else candidate_types()
    result = run_ranks(check_types, args.tp, types, timeout_s=1800)[0].value
    for t, (status, detail) in result.items():
        print(f"{t:24s} {status:8s} {detail}")
    counts = {s: sum(v[0] == s for v in result.values()) for s in ("match", "DIFFERS", "refused",
                                                                    "crashed")}
    print(counts)
    return 0 if not counts["DIFFERS"] and not counts["crashed"] else 1


if __name__ == "__main__":
    sys.exit(main())
