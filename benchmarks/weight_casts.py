"""Bytes a pipeline stage keeps per micro-batch in flight under autocast, with each micro-batch's
own 16-bit weight casts and with the step's shared ones (:class:`SharedWeightCasts`).

    python3 benchmarks/weight_casts.py [--hidden 1024 --intermediate 2816 --blocks 2 --seq 512]
                                       [--lora 16] [--family gpt2]

Builds a LLaMA stage (``--family gpt2``: GPT-2's, whose projections are transformers' ``Conv1D``,
``--intermediate`` its MLP width ``n_inner``) of ``--blocks`` blocks (hidden states in, no
embedding nor head), runs
``--in-flight`` forwards under bf16 autocast on the CPU as the runtime runs them (each in its own
autocast region) and counts what autograd keeps for their backwards: every saved tensor's
storage once, split into 16-bit casts of the weights and the rest (activations). The bytes a
micro-batch in flight adds are ``(kept(N) - kept(1)) / (N - 1)``. Then the same with
``--recompute-layers`` of the blocks recomputing (they keep their input only). With ``--time R``,
also the median seconds of a step (the forwards, then their backwards) with each micro-batch's
own casts and with the shared ones, alternating, over ``R`` repetitions each (one thread).
``--lora R``: the stage with LoRA adapters of rank ``R`` on its attention projections (GPT-2:
on ``c_attn`` and both ``c_proj``, peft's ``fan_in_fan_out`` for ``Conv1D``), every other weight
frozen (the casts of the frozen weights count as weight casts).
``--survey``: instead, for every model type the stage builder accepts (a tiny config of 2
blocks, the whole model as one stage), whether one forward under bf16 autocast without its
cache casts any trained weight twice: where none does, running without the cache (as a
training forward with shared casts runs) sums every weight gradient as before, bit for bit.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402
from transformers import Conv1D  # noqa: E402

from hapt_hf.compat.torch_api import cast_parameter, saved_tensors_hooks_in_force  # noqa: E402
from hapt_hf.pipeline.precision import SharedWeightCasts, compute_context  # noqa: E402
from hapt_hf.pipeline.stage import build_stage  # noqa: E402


class Kept:
    """Every tensor autograd keeps, as the hooks in force leave it (held, so storages stay
    apart while counted)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        outer = saved_tensors_hooks_in_force()

        def pack(t):
            packed = outer[0](t) if outer is not None else t
            if isinstance(packed, torch.Tensor):
                self.tensors.append(packed)
            return packed, outer

        def unpack(saved):
            packed, hooks = saved
            return hooks[1](packed) if hooks is not None else packed
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def bytes(self, frozen: list[torch.Tensor] = ()) -> tuple[int, int]:
        """(bytes of 16-bit weight casts, bytes of everything else), each storage once.
        ``frozen``: the 16-bit casts of the weights that do not train, which autograd records
        nothing for (a saved tensor equal to one, or to its transpose, is its cast)."""
        seen: dict[int, tuple[int, bool]] = {}
        for t in self.tensors:
            s = t.untyped_storage()
            weight = t.dtype in (torch.bfloat16, torch.float16) and (
                cast_parameter(t) is not None or _is_cast_of(t, frozen))
            seen[s.data_ptr()] = (s.nbytes(), weight)
        casts = sum(n for n, w in seen.values() if w)
        return casts, sum(n for n, _ in seen.values()) - casts


def _is_cast_of(t: torch.Tensor, casts: list[torch.Tensor]) -> bool:
    return not t.requires_grad and any(
        (c.shape == t.shape and torch.equal(c, t)) or (c.t().shape == t.shape and torch.equal(c.t(), t))
        for c in casts)


def frozen_casts(stage) -> list[torch.Tensor]:
    """bf16 casts of the stage's frozen projection weights (LoRA's base weights)."""
    return [m.weight.detach().to(torch.bfloat16) for m in stage.modules()
            if type(m) in (torch.nn.Linear, Conv1D) and not m.weight.requires_grad]


def kept_bytes(stage, xs: list[torch.Tensor], share: bool) -> tuple[int, int]:
    casts = SharedWeightCasts() if share else None
    kept, outs = Kept(), []
    for x in xs:
        with compute_context("bf16", "cpu", casts), kept.hooks():
            outs.append(stage(x.requires_grad_(True)))
    return kept.bytes(frozen_casts(stage))


def step_seconds(stage, xs: list[torch.Tensor], share: bool) -> float:
    """One step's forwards then backwards, timed."""
    start = time.perf_counter()
    casts = SharedWeightCasts() if share else None
    outs = []
    for x in xs:
        with compute_context("bf16", "cpu", casts):
            outs.append(stage(x.detach().requires_grad_(True)))
    for out in outs:
        out.float().sum().backward()
    return time.perf_counter() - start


def survey() -> int:
    """Print the model types whose forward casts a trained weight twice, and those that fail."""
    import warnings

    from benchmarks.chain_check import attention_for, tiny_config
    from hapt_hf.core.families import accepted_model_types
    from hapt_hf.core.layers import num_layers
    from hapt_hf.pipeline.families import num_blocks
    warnings.filterwarnings("ignore")
    twice, failed, types = [], [], accepted_model_types()
    for t in types:
        casts: dict[int, set[int]] = {}

        def pack(x, casts=casts):
            if x.dtype == torch.bfloat16 and x.requires_grad and cast_parameter(x) is not None:
                base = x._base if x._base is not None else x
                casts.setdefault(id(cast_parameter(x)), set()).add(base.untyped_storage().data_ptr())
            return x
        try:
            config = tiny_config(t, 2)
            stage = build_stage(config, (0, num_layers(num_blocks(config))), seed=0,
                                attn_implementation=attention_for(config))
            ids = torch.randint(3, 128, (2, 16))
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                stage(ids, labels=ids)
        except Exception as e:  # noqa: BLE001 - reported
            failed.append(f"{t} ({type(e).__name__}: {str(e)[:80]})")
            continue
        if any(len(v) > 1 for v in casts.values()):
            twice.append(t)
    print(f"{len(types)} model types; a trained weight cast twice in one forward: {twice or 'none'}; "
          f"failing under bf16 autocast: {failed or 'none'}")
    return 0


GPT2_TARGETS = ("c_attn", "c_proj")


def _build(config, a: argparse.Namespace, recompute_layers: int = 0):
    stage = build_stage(config, (1, 1 + a.blocks), seed=0, recompute_layers=recompute_layers)
    if a.lora and a.family == "gpt2":
        from peft import LoraConfig

        from hapt_hf.integration.lora import apply_lora_config
        apply_lora_config(stage, LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                            target_modules=list(GPT2_TARGETS), fan_in_fan_out=True))
        for n, p in stage.named_parameters():
            p.requires_grad = "lora_" in n
    elif a.lora:
        from hapt_hf.integration.lora import apply_lora
        apply_lora(stage, r=a.lora)
    return stage


def _config(a: argparse.Namespace):
    if a.family == "gpt2":
        from transformers import GPT2Config
        return GPT2Config(n_layer=a.blocks + 1, n_embd=a.hidden, n_inner=a.intermediate,
                          n_head=a.heads, vocab_size=128, n_positions=a.seq,
                          tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=a.blocks + 1, hidden_size=a.hidden,
                       intermediate_size=a.intermediate, num_attention_heads=a.heads,
                       num_key_value_heads=a.heads, vocab_size=128,
                       max_position_embeddings=a.seq, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1, help="samples per micro-batch")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--recompute-layers", type=int, default=1)
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="LoRA of rank R on the attention projections: every other weight frozen")
    ap.add_argument("--time", type=int, default=0, metavar="R",
                    help="also time R steps each way (after 2 untimed)")
    ap.add_argument("--survey", action="store_true",
                    help="only: which model types cast a trained weight twice in one forward")
    a = ap.parse_args(argv)
    if a.survey:
        return survey()
    config = _config(a)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(a.rows, a.seq, a.hidden, generator=g) for _ in range(a.in_flight)]
    family = "GPT-2" if a.family == "gpt2" else "LLaMA"
    print(f"{family} stage: {a.blocks} blocks, hidden {a.hidden}, MLP {a.intermediate}, seq {a.seq}, "
          f"{a.rows} sample(s) a micro-batch, bf16 autocast on the CPU; MB = 1e6 bytes\n")
    print("| stage | weight casts | kept at 1 in flight (casts + rest) | kept at "
          f"{a.in_flight} in flight | per micro-batch in flight (casts + rest) |")
    print("|---|---|---|---|---|")
    for k in (0, a.recompute_layers) if a.recompute_layers else (0,):
        for share in (False, True):
            stage = _build(config, a, recompute_layers=k)
            one, many = kept_bytes(stage, xs[:1], share), kept_bytes(stage, xs, share)
            per = [(m - o) / (a.in_flight - 1) for m, o in zip(many, one)]
            name = (f"{a.blocks} blocks" + (f", LoRA r={a.lora}" if a.lora else "")
                    + (f", first {k} recomputed" if k else "")
                    + (", shared casts" if share else ", own casts"))
            print(f"| {name} | {'one per step' if share else 'one per micro-batch'} | "
                  f"{one[0] / 1e6:.1f} + {one[1] / 1e6:.1f} MB | "
                  f"{many[0] / 1e6:.1f} + {many[1] / 1e6:.1f} MB | "
                  f"{per[0] / 1e6:.1f} + {per[1] / 1e6:.1f} MB |")
    if a.time:
        torch.set_num_threads(1)
        stage = _build(config, a)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.time + 2):
            for share in (False, True):
                times[share].append(step_seconds(stage, xs, share))
        own, shared = (statistics.median(times[k][2:]) for k in (False, True))
        print(f"\nstep ({a.in_flight} forwards, then their backwards): own casts {own:.3f} s, "
              f"shared casts {shared:.3f} s (median of {a.time}), ratio {shared / own:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
