"""``hapt-hf profile``: time this machine's device for the planner and fill a profile store."""
from __future__ import annotations

import argparse
import sys
import time

from hapt_hf.core.defaults import ATTN_IMPLEMENTATIONS
from hapt_hf.core.precision import DTYPES
from hapt_hf.errors import HaptError
from hapt_hf.planner.model_spec import model_config

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
    return p


def _micro_batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ProfilerError(f"--micro-batches {text!r} must be comma-separated integers, "
                            "e.g. 1,2,4") from None


def cli_main(argv: list[str]) -> int:
    """``hapt-hf profile``: returns the exit status; user mistakes print one line, status 2."""
    args = _parser().parse_args(argv)
    try:
        import torch

        from .model_figures import MeasuringReader, choose_attention
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        config = model_config(args.model)
        attn, _ = choose_attention(config, args.attn_implementation)
        options = ProfilerOptions(micro_batches=_micro_batches(args.micro_batches),
                                  repeats=args.repeats, budget_s=args.budget_s,
                                  attn_implementation=attn)
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
    return 0
