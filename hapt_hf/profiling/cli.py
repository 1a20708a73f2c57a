"""``hapt-hf profile``: time this machine's device for the planner and fill a profile store."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS
from hapt_hf.core.precision import DTYPES
from hapt_hf.core.tp import TP_DEGREES
from hapt_hf.errors import HaptError
from hapt_hf.planner.model_spec import model_config
from hapt_hf.planner.profile import Profile

from .profiler import profile_model
from .store import ProfilerError, ProfilerOptions, ProfileStore

__all__ = ["cli_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hapt-hf profile", description=(
        "Time one layer of each distinct shape of a model (forward, backward, update, memory) "
        "on this machine's device and store the figures for the planner."))
    p.add_argument("--model", required=True, help="built-in name or local config.json / dir")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batches", default="1,2,4", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--device-name", required=True,
                   help="device type name as the cluster file names it, e.g. A100-40")
    p.add_argument("--store", required=True, help="profile store JSON (created if absent)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                   help="compute dtype the job trains in (16 bits: autocast over fp32 weights)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=4.0,
                   help="timed seconds per entry; slow layers get fewer repeats (at least 3)")
    p.add_argument("--attn-implementation", default=None, choices=ATTN_IMPLEMENTATIONS,
                   help="as the job's hapt config sets it (default: the model's best, sdpa "
                        "where the model supports it, else eager)")
    p.add_argument("--tp-degrees", default=",".join(str(t) for t in TP_DEGREES if t > 1),
                   help="tensor-parallel degrees at which a block's compute split (one rank's "
                        "shard of the projections the model's plan shards) is timed too; those "
                        "the model's heads, key/value heads or MLP width refuse are left out, "
                        "saying why; 1 or an empty value: none (default: %(default)s)")
    return p


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ProfilerError(f"{flag} {text!r} must be comma-separated integers, "
                            "e.g. 1,2,4") from None


def _tp_summary(profile: Profile) -> list[str]:
    """What the profile holds of tensor parallelism: each split block beside the whole one,
    and each group's measured tensor-parallel all-reduce."""
    lines = []
    for key, hit in sorted(profile.timings.items()):
        if key.tp == 1:
            continue
        t, whole = key.tp, profile.timings.get(replace(key, tp=1))
        split = hit.forward_s + hit.backward_s
        ratio = f"{(whole.forward_s + whole.backward_s) / split:.2f}" \
            if whole is not None and split > 0 else "-"
        lines.append(f"  {key.device} {key.layer_signature} mb={key.micro_batch} tp={t}: "
                     f"fwd+bwd {split * 1e3:.2f} ms, whole / split {ratio} ({t} for an even "
                     "split)")
    for m in profile.links:
        if m.tp > 1:
            lines.append(f"  all-reduce inside {m.a}, tp={m.tp}: {m.bandwidth_gbps:.2f} Gbit/s, "
                         f"{m.latency_us:.1f} us per hop")
    return ["tensor-parallel figures:", *lines] if lines else []


def cli_main(argv: list[str]) -> int:
    """``hapt-hf profile``: returns the exit status; user mistakes print one line, status 2."""
    args = _parser().parse_args(argv)
    try:
        import torch

        from .model_figures import MeasuringReader, choose_attention
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        config = model_config(args.model)
        attn, _ = choose_attention(config, args.attn_implementation)
        options = ProfilerOptions(micro_batches=_ints("--micro-batches", args.micro_batches),
                                  repeats=args.repeats, budget_s=args.budget_s,
                                  attn_implementation=attn,
                                  tp_degrees=tuple(t for t in _ints("--tp-degrees",
                                                                    args.tp_degrees) if t > 1))
        store = ProfileStore.open(args.store)
        before = len(store.timings)
        t0 = time.perf_counter()
        profile = profile_model(config, device_name=args.device_name, seq_len=args.seq_len,
                                dtype=args.dtype, options=options, store=store, device=device,
                                log=print, reader=MeasuringReader())
    except HaptError as e:  # ProfilerError, ModelSpecError, StageBuildError: user input
        print(f"hapt-hf profile: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(profile.timings)} entries ({len(store.timings) - before} measured, the rest "
          f"from the store) in {time.perf_counter() - t0:.1f} s -> {args.store}")
    print("\n".join(_tp_summary(profile)) or "no tensor-parallel figures", flush=True)
    return 0
