"""Recovery after losing a node: reading local copies first against fetching everything remote.

A LLaMA-shaped model whose state is large and whose step is cheap (hidden 2048, MLP 5632,
8 blocks, vocabulary 2048, fp32: 419M parameters, 5.0 GB of weights and AdamW state; a step of
2 micro-batches of 1 sequence of 8 tokens; fused AdamW) trains on 4 ranks, one per simulated
node (plan A: layers [0,3) [3,5) [5,7) [7,10)), and saves with
:class:`hapt_hf.pipeline.checkpoint_store.CheckpointStore`: each rank to its node's directory, a
background copy to the remote, timed with the steps that run while it copies (they are not
saved). Node 1 is then lost (its directory removed). The survivors, renumbered 0..2, resume on
a new plan B of 3 ranks ([0,4) [4,7) [7,10): the lost stage's blocks go to its neighbours) and
run one step, two ways:

* local first: each rank's reader takes the files its node holds from its directory and
  fetches only the rest (here: rank 0 and 1 each fetch one block of the lost rank's file);
* remote only: every byte from the remote copy (the same reader with no local directory).

The remote is ``throttled://`` (benchmarks/slow_store.py): each ranged GET, as s3fs serves
them, and each upload takes a latency plus its bytes at a bandwidth, per rank: by default
30 ms (an object store's first-byte latency) and 100 MB/s (about what one stream from S3 to
one node gives). A rank's share of the state is 1.3-1.9 GB: 13-19 s at that rate. Local reads
come from this machine's disk or page cache.

Time measured: from the launch of the new processes (the moment torchrun's agent restarts the
workers) to the end of the first step on plan B on every rank, on one monotonic clock. Each
rank's phases: start (the process and its process group), build (the runtime, its stage built
with ``RuntimeConfig(init_weights=False)``: allocated, not initialised, since the read
overwrites every weight; --seeded-init initialises them as a fresh run does), seeded_init,
read_meta (the remote's marker, DCP's metadata, the optimizer state's buffers), read, step.
The processes are forked from a server that has imported torch and transformers; a worker
torchrun starts imports them itself: ``cold_start_s``, 3 fresh interpreters importing them at
once, measured in the same run, adds to both ways (``speedup_cold_start``). Not included:
detecting the failure and the rendezvous, the same both ways. The two ways alternate,
--repeats times; medians. The first step's loss on plan B is compared with one process that
seeds its model, then loads the same checkpoint (rtol 1e-5). Last line: JSON.

    python3 benchmarks/recovery.py --quick    # one repeat each: 2 minutes, 9 GB of RAM, 10 GB of disk
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import slow_store  # noqa: E402
from benchmarks.ranks import PRELOAD, run_ranks  # noqa: E402

NAME = "checkpoint-1"
SEQ, MBS, M = 8, 1, 2
PLANS = {"A": [(0, 3), (3, 5), (5, 7), (7, 10)], "B": [(0, 4), (4, 7), (7, 10)], "one": [(0, 10)]}
LOST_NODE = 1
SURVIVORS = [0, 2, 3]
"""The nodes (old ranks) left, in the order of the new ranks."""
PHASES = ("start", "build", "seeded_init", "read_meta", "read", "step")
"""What a rank's time to its first step is made of (:func:`recover`)."""


def _config(hidden: int, blocks: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=blocks,
                       num_attention_heads=16, num_key_value_heads=16, vocab_size=2048,
                       max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=0)


def _plan(name: str, layers: int):
    from hapt_hf.planner.plan import Plan, Stage
    spans = PLANS[name]
    stages = tuple(Stage.even(i, s, "cpu", "cpu", (i,), len(spans) - i, micro_batch_size=MBS)
                   for i, s in enumerate(spans))
    return Plan("llama-recovery", layers, SEQ, MBS * M, MBS, M, "1f1b", stages).validate(len(spans))


def _start(plan: str, hidden: int, blocks: int, init_weights: bool = True):
    import torch

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    torch.manual_seed(0)
    rt = PipelineRuntime(_plan(plan, blocks + 2), _config(hidden, blocks),
                         RuntimeConfig(timeout_s=300, init_weights=init_weights))
    return rt, rt.make_optimizer(torch.optim.AdamW, lr=1e-3, fused=True)


def _batch(vocab: int):
    import torch

    from hapt_hf.pipeline import Batch
    ids = torch.randint(0, vocab, (MBS * M, SEQ), generator=torch.Generator().manual_seed(1))
    return Batch(ids, ids.clone(), torch.ones_like(ids))


def _store(root: str, node: int):
    from hapt_hf.pipeline.checkpoint_store import CheckpointStore
    return CheckpointStore(Path(root) / f"node{node}", f"throttled://{root}/remote")


def _timed_step(rt, opt, batch) -> float:
    t0 = time.perf_counter()
    rt.train_step(batch, opt)
    return time.perf_counter() - t0


def _time_calls(module, name: str, spent: dict[str, float]) -> None:
    """Add the seconds every call of ``module.name`` takes to ``spent[name]`` (this process)."""
    fn = getattr(module, name)

    def timed(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.monotonic() - t0
    setattr(module, name, timed)


def _all_copying(done: bool) -> bool:
    """Whether every rank's background copy is still running (a MIN all-reduce)."""
    import torch
    import torch.distributed as dist
    flag = torch.tensor([0 if done else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def write(rank: int, world_size: int, root: str, hidden: int, blocks: int,
          throttle: tuple[float, float]) -> dict:
    """Plan A: a step, the save, steps while the (throttled) copy runs, then wait for it."""
    from hapt_hf.pipeline import portable
    slow_store.configure(*throttle)
    rt, opt = _start("A", hidden, blocks)
    batch = _batch(rt.stage.config.vocab_size)
    steps = [_timed_step(rt, opt, batch)]
    t0 = time.perf_counter()
    upload = _store(root, rank).save(NAME, portable.portable_state_dict(rt.stage, opt))
    save_s = time.perf_counter() - t0
    steps.append(_timed_step(rt, opt, batch))  # the state saved is after the first step
    during = []
    # not saved: do steps wait for the copy? Every rank runs the same number of steps, so the
    # ranks agree each time on whether all their copies are still running (one rank deciding
    # alone left its peers waiting in a step it never ran)
    while len(during) < 20 and _all_copying(upload.done):
        during.append(_timed_step(rt, opt, batch))
    upload.wait()
    rt.shutdown()
    return {"step_s": steps[-1], "save_s": save_s, "steps_during_copy": during,
            "upload_s": upload.seconds}


def recover(rank: int, world_size: int, root: str, hidden: int, blocks: int, plan: str,
            local: bool, throttle: tuple[float, float], launched: float, seeded: bool) -> dict:
    """A new process of plan ``plan``: the checkpoint (local first or remote only), one step.
    Its phases: start (process and process group), build (the runtime's, but for:),
    seeded_init (``seeded``: the stage's seeded weights, a replay of the whole model's random
    draws; else the weights are only allocated, ``RuntimeConfig.init_weights=False``),
    read_meta (the reader: the remote's marker, DCP's metadata, the optimizer state's buffers),
    read (the tensors), step (the first step)."""
    from hapt_hf.pipeline import init_replay, portable
    t_start = time.monotonic()
    slow_store.configure(*throttle)
    spent: dict[str, float] = {}
    _time_calls(init_replay, "seeded_values", spent)
    rt, opt = _start(plan, hidden, blocks, init_weights=seeded)
    t_built = time.monotonic()
    node = SURVIVORS[rank] if plan == "B" else 0
    reader = _store(root, node).reader(NAME, local=local)
    load = portable.prepare_load(NAME, rt.stage, opt, reader)
    t_meta = time.monotonic()
    load.read()
    t_loaded = time.monotonic()
    loss = rt.train_step(_batch(rt.stage.config.vocab_size), opt).loss
    done = time.monotonic()
    params = sum(p.numel() for p in rt.stage.parameters())
    rt.shutdown()
    seeded_s = spent.get("seeded_values", 0.0)
    phases = {"start": t_start - launched, "build": t_built - t_start - seeded_s, "seeded_init": seeded_s,
              "read_meta": t_meta - t_built, "read": t_loaded - t_meta, "step": done - t_loaded}
    return {"loss": loss, "done": done, "phases": phases, "params": params,
            "local_bytes": reader.stats.local_bytes, "fetched_bytes": reader.stats.fetched_bytes,
            "direct_bytes": reader.stats.direct_bytes, "direct_s": reader.stats.direct_s,
            "fetched_files": reader.stats.fetched_files,
            "transferred_bytes": sum(e - s for _, s, e in slow_store.FETCHES)}


def _recovery(root: str, args, local: bool) -> dict:
    launched = time.monotonic()
    outs = [o.value for o in run_ranks(recover, 3, root, args.hidden, args.blocks, "B", local,
                                       (args.bandwidth_mb_s, args.latency_s), launched,
                                       args.seeded_init, timeout_s=600)]
    return {"recovery_s": max(o["done"] for o in outs) - launched, "ranks": outs}


def cold_start(n: int) -> float:
    """Seconds for ``n`` fresh interpreters, started at once, to import what a worker imports
    (the modules the ranks here get from the fork server's preload)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import " + ", ".join(PRELOAD)
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(n)]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError(f"{sys.executable} -c {code!r} failed")
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat of each way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--bandwidth-mb-s", type=float, default=100.0,
                    help="the remote's bandwidth per rank, each way (MB = 10**6 bytes)")
    ap.add_argument("--latency-s", type=float, default=0.03, help="per ranged GET and upload")
    ap.add_argument("--seeded-init", action="store_true",
                    help="the new processes initialise their stage's weights (seeded) before reading "
                         "them, as without RuntimeConfig(init_weights=False)")
    ap.add_argument("--dir", default=None, help="where the copies go (default: a temporary directory)")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    root = Path(args.dir or tempfile.mkdtemp(prefix="hapt-recovery-"))
    try:
        _run(str(root), args, repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _describe(way: str, out: dict) -> None:
    print(f"{way}: {out['recovery_s']:.2f} s to the first step on plan B", flush=True)
    for r, o in enumerate(out["ranks"]):
        phases = ", ".join(f"{k} {v:.2f}" for k, v in o["phases"].items())
        print(f"  rank {r} (node {SURVIVORS[r]}): {phases} s; local {o['local_bytes'] / 1e6:.0f} MB "
              f"({o['direct_bytes'] / 1e6:.0f} MB read directly in {o['direct_s']:.2f} s), "
              f"fetched {o['fetched_bytes'] / 1e6:.0f} MB ({o['transferred_bytes'] / 1e6:.0f} MB "
              f"transferred) from {o['fetched_files'] or 'no file'}", flush=True)


def _run(root: str, args, repeats: int) -> None:
    t0 = time.monotonic()
    wrote = [o.value for o in run_ranks(write, 4, root, args.hidden, args.blocks,
                                        (args.bandwidth_mb_s, args.latency_s), timeout_s=600)]
    state_mb = sum(p.stat().st_size for p in (Path(root) / "remote" / NAME).glob("*.distcp")) / 1e6
    during = [s for w in wrote for s in w["steps_during_copy"]]
    print(f"checkpoint: {state_mb:.0f} MB of weights and Adam state over 4 ranks; save (local write) "
          f"{max(w['save_s'] for w in wrote):.2f} s, the copy in the background "
          f"{max(w['upload_s'] for w in wrote):.2f} s; a step before it "
          f"{statistics.median(w['step_s'] for w in wrote):.2f} s, {len(wrote[0]['steps_during_copy'])} "
          f"steps while it ran, median {statistics.median(during) if during else float('nan'):.2f} s",
          flush=True)
    shutil.rmtree(Path(root) / f"node{LOST_NODE}")  # the lost node
    ref = run_ranks(recover, 1, root, args.hidden, args.blocks, "one", False,
                    (float("inf"), 0.0), time.monotonic(), True, timeout_s=600)[0].value
    cold = cold_start(3)
    print(f"cold start: 3 fresh interpreters importing {', '.join(PRELOAD)}: {cold:.2f} s", flush=True)
    times: dict[str, list[float]] = {"local_first": [], "remote_only": []}
    last: dict[str, dict] = {}
    for _ in range(repeats):
        for way, local in (("local_first", True), ("remote_only", False)):
            out = _recovery(root, args, local)
            times[way].append(out["recovery_s"])
            last[way] = out
            _describe(way, out)
    losses = {way: last[way]["ranks"][-1]["loss"] for way in last}
    matches = all(abs(v - ref["loss"]) <= 1e-5 * abs(ref["loss"]) for v in losses.values())
    med = {way: statistics.median(v) for way, v in times.items()}
    print(f"first-step loss on plan B: local first {losses['local_first']:.7f}, remote only "
          f"{losses['remote_only']:.7f}, one process {ref['loss']:.7f}; whole run "
          f"{time.monotonic() - t0:.0f} s")
    slowest = {way: {k: round(max(o["phases"][k] for o in last[way]["ranks"]), 2) for k in PHASES}
               for way in last}
    print(json.dumps({"recovery_s_local_first": round(med["local_first"], 3),
                      "recovery_s_remote_only": round(med["remote_only"], 3),
                      "speedup": round(med["remote_only"] / med["local_first"], 2),
                      "loss_matches_reference": matches, "cold_start_s": round(cold, 2),
                      "speedup_cold_start": round((med["remote_only"] + cold) / (med["local_first"] + cold), 2),
                      "slowest_rank_phases_s": slowest, "repeats": repeats, "params_m": round(ref["params"] / 1e6),
                      "state_mb": round(state_mb), "bandwidth_mb_s": args.bandwidth_mb_s,
                      "latency_s": args.latency_s, "seeded_init": args.seeded_init}))


if __name__ == "__main__":
    main()
