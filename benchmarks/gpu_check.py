"""GPU check of mixed-precision training against the planner: memory, layer times, loss curves.

    python3 benchmarks/gpu_check.py                     # one CUDA GPU: LLaMA-shaped 125m and 350m
    python3 benchmarks/gpu_check.py --device cpu        # tiny sizes, 2 Gloo ranks, 10 steps

For each model size (LLaMA-shaped configs built from their fields, random weights, nothing
downloaded) and each 16-bit dtype it prints these markdown tables:

1. **Memory.** The model cut into ``--stages`` stages (blocks spread evenly). Each stage is built
   on the device as the runtime builds it (fp32 weights, AdamW state created by a first step),
   runs its 1F1B warm-up depth of micro-batches forward (``n - i`` kept in flight), then their
   backwards, then the optimizer step. Predicted: the cost model's ``memory_bytes`` (16 bytes per
   parameter + in-flight activations + one layer's working set). Measured on CUDA:
   ``torch.cuda.max_memory_allocated`` over that sequence, less what was allocated before the
   stage was built. On CPU there is no allocator peak: the measured column is the bytes of the
   weights, gradients and Adam state tensors plus the bytes autograd saved for the in-flight
   micro-batches (saved-tensor hooks), i.e. without the working set.
2. **Layer times.** The profiler's forward/backward time of the embedding, one block and the
   head (CUDA events on a GPU, wall clock on a CPU; ``hapt_hf.profiling.profile_model``) beside
   the catalogue's estimate the planner uses without a profile (FLOPs / (peak TFLOP/s x
   efficiency)).
3. **Loss curves.** ``--steps`` optimizer steps of the pipeline runtime on the same synthetic
   data (a noisy fixed token-successor map, so the loss falls) in fp32, bf16 and fp16 with
   dynamic loss scaling: final loss, largest |loss - fp32 loss| over the steps, steps skipped
   for an overflow. On CUDA the pipeline runs ``--ranks`` processes on as many GPUs (1 by
   default: one stage); on CPU ``--ranks`` Gloo processes (2 by default), so the activations
   cross a stage boundary in the compute dtype.
4. **Tensor-parallel block.** One block split ``t`` ways as one rank of a ``t``-way replica
   computes it (``hapt_hf.profiling.tp_split``: the projections the model's plan shards cut to
   one rank's shard), for every degree of 2, 4, 8 the model's heads, key/value heads and MLP
   width allow, timed by the profiler on the one device, beside the cost model's prediction of
   that compute: the whole block's measured time over ``t * tp_efficiency(t)`` (the cost model
   fed the whole block's timing only), and the catalogue's estimate. One device cannot time the
   rest of a tensor-parallel block: its all-reduces (two forward, two backward) run among ``t``
   devices; the table gives what the cost model prices them at on the check's nominal
   intra-node link, and says that timing them needs ``t`` GPUs
   (``hapt_hf.profiling.profile_group_leaders`` with ``ProfilerOptions.tp_degrees``).
5. **The loss on logits split by vocabulary columns.** One micro-batch of 16-bit logits, its
   loss and backward taken by transformers' ``ForCausalLMLoss`` and by
   ``hapt_hf.pipeline.vocab_parallel.vocab_parallel_loss_sum`` on a one-rank mesh (NCCL on a
   GPU): the two losses, the largest gradient difference, the bytes autograd saves for the
   backward, the peak allocated over forward and backward (CUDA only) and the median time,
   beside what the planner prices for the fp32 softmax the loss keeps. One device runs it at
   ``t = 1`` only: each rank keeping ``ceil(V/t)`` columns, and the all-reduces among ``t``
   ranks, need ``t`` GPUs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from hapt_hf.core.precision import Precision  # noqa: E402
from hapt_hf.planner.catalogue import find_gpu  # noqa: E402
from hapt_hf.planner.cluster import Cluster  # noqa: E402
from hapt_hf.planner.cost_model import CostModel  # noqa: E402
from hapt_hf.planner.model_spec import ModelSpec  # noqa: E402
from hapt_hf.planner.plan import Plan, Stage  # noqa: E402
from hapt_hf.planner.profile import Profile  # noqa: E402

__all__ = ["SIZES", "Size", "main"]


@dataclass(frozen=True)
class Size:
    """A LLaMA-shaped model built from its config fields."""

    hidden: int
    blocks: int
    heads: int
    intermediate: int
    vocab: int

    def config(self):
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden, num_hidden_layers=self.blocks,
                           num_attention_heads=self.heads, num_key_value_heads=self.heads,
                           intermediate_size=self.intermediate, vocab_size=self.vocab,
                           max_position_embeddings=4096, tie_word_embeddings=False)


SIZES = {
    "125m": Size(768, 12, 12, 2048, 32000),    # 134 M parameters
    "350m": Size(1024, 24, 16, 2816, 32000),   # 373 M parameters
    "tiny": Size(64, 4, 4, 176, 512),          # CPU sizes
    "small": Size(128, 6, 4, 352, 1024),
}
GPU_DEFAULTS = {"sizes": ["125m", "350m"], "seq": 512, "micro_batch": 4, "microbatches": 4,
                "steps": 50, "ranks": 1}
CPU_DEFAULTS = {"sizes": ["tiny", "small"], "seq": 64, "micro_batch": 2, "microbatches": 4,
                "steps": 10, "ranks": 2}


# -- plans and the planner's figures ----------------------------------------------------------

def _plan(size: Size, stages: int, dtype: str, mbs: int, m: int, seq: int) -> Plan:
    """Blocks spread evenly over ``stages`` stages (the first holds the embedding, the last the
    head), one rank each, 1F1B."""
    per, extra = divmod(size.blocks, stages)
    out, start = [], 0
    for i in range(stages):
        end = start + per + (i < extra) + (i == 0) + (i == stages - 1)
        out.append(Stage.even(i, (start, end), "gpu", "gpu", (i,), warmup=min(m, stages - i),
                              micro_batch_size=mbs))
        start = end
    plan = Plan(f"llama-{size.hidden}x{size.blocks}", start, seq, mbs * m, mbs, m, "1f1b",
                tuple(out))
    return replace(plan, dtype=dtype, loss_scaling=Precision.of(dtype).loss_scaling).validate()


def _cost_model(size: Size, seq: int, dtype: str, gpu: str, stages: int,
                profile: Profile | None = None) -> CostModel:
    spec = ModelSpec.from_config(size.config(), seq, dtype)
    cluster = Cluster.from_dict({"name": "gpu-check", "groups": [{
        "name": "gpu", "gpu": gpu, "nodes": 1, "gpus_per_node": stages,
        "intra_node": {"bandwidth_gbps": 100, "latency_us": 5}}]})
    return CostModel(spec, cluster, profile)


def _gpu_name(device: str, given: str | None) -> str:
    """The catalogue's name of the device (its tflops price the estimate)."""
    if given:
        if find_gpu(given) is None:
            raise SystemExit(f"--gpu {given!r} is not in the catalogue (hapt_hf/planner/"
                             "catalogue.py); give one of its names, e.g. H100-80")
        return given
    if device == "cpu":
        return "cpu"
    import torch
    name = torch.cuda.get_device_name(torch.device(device))
    for token in name.replace("-", " ").split():
        if find_gpu(token) is not None:
            return find_gpu(token).name
    raise SystemExit(f"the GPU {name!r} is not in the catalogue; pass --gpu with the catalogue "
                     "name closest to it (e.g. --gpu H100-80)")


# -- 1. memory ---------------------------------------------------------------------------------

def _stage_inputs(stage_plan: Stage, plan: Plan, size: Size, device: str, gen):
    """(input, kwargs, gradient of the output or None for the loss) of one micro-batch."""
    import torch
    mbs, seq = plan.micro_batch_size, plan.seq_len
    ids = torch.randint(0, size.vocab, (mbs, seq), generator=gen).to(device)
    first, last = stage_plan.index == 0, stage_plan.index == plan.num_stages - 1
    x = ids if first else torch.randn(mbs, seq, size.hidden, generator=gen).to(device) \
        .requires_grad_(True)
    kwargs = {"labels": ids} if last else {}
    out_grad = None if last else torch.randn(mbs, seq, size.hidden, generator=gen).to(device)
    return x, kwargs, out_grad


def measure_stage_memory(size: Size, plan: Plan, stage_plan: Stage, device: str) -> float:
    """Bytes the stage held at its peak over warm-up forwards, backwards and the step (see the
    module docstring for CPU)."""
    import torch

    from hapt_hf.pipeline.precision import compute_context
    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.profiling.memory import saved_tensor_bytes
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
    stage = build_stage(size.config(), stage_plan.layers, seed=0, device=device).train()
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)

    def forward(inputs):
        x, kwargs, _ = inputs
        with compute_context(plan.dtype, device):
            return stage(x, **kwargs)

    def backward(out, inputs):
        out.backward(inputs[2])

    one = _stage_inputs(stage_plan, plan, size, device, gen)
    backward(forward(one), one)
    opt.step()  # Adam's state exists from here on, as in training
    opt.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    saved, outs = 0.0, []
    for _ in range(stage_plan.warmup):
        inputs = _stage_inputs(stage_plan, plan, size, device, gen)
        kept, out = saved_tensor_bytes(stage, lambda inp=inputs: forward(inp))
        saved += kept
        outs.append((out, inputs))
    for out, inputs in outs:
        backward(out, inputs)
    opt.step()
    if cuda:
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    state = sum(t.numel() * t.element_size() for p in stage.parameters()
                for t in [p, p.grad, *opt.state[p].values()] if torch.is_tensor(t) and t.ndim)
    return float(state + saved)


def memory_table(size_name: str, dtype: str, args, gpu: str) -> list[str]:
    size = SIZES[size_name]
    plan = _plan(size, args.stages, dtype, args.micro_batch, args.microbatches, args.seq)
    cost = _cost_model(size, args.seq, dtype, gpu, args.stages)
    measured_name = "max_memory_allocated" if args.device != "cpu" else \
        "state tensors + saved-tensor bytes (CPU)"
    # without an allocator peak (CPU) the measured bytes leave out the working set
    cpu = args.device == "cpu"
    lines = [f"| {size_name} | {dtype} | stage | layers | in flight | predicted MiB"
             f"{' (without working set)' if cpu else ''} | measured MiB ({measured_name}) | "
             "measured / predicted |", "|---|---|---|---|---:|---:|---:|---:|"]
    for sp in plan.stages:
        a, b = sp.layers
        predicted = cost.memory_bytes(plan.micro_batch_size, a, b, sp.warmup)
        if cpu:
            predicted -= cost.working_bytes(plan.micro_batch_size, a, b)
        measured = measure_stage_memory(size, plan, sp, args.device)
        lines.append(f"| | | {sp.index} | [{a}, {b}) | {sp.warmup} | {predicted / 2**20:,.2f} | "
                     f"{measured / 2**20:,.2f} | {measured / predicted:.2f} |")
    return lines


# -- 2. layer times ---------------------------------------------------------------------------

def times_table(size_name: str, dtype: str, args, gpu: str) -> list[str]:
    from hapt_hf.profiling import ProfilerOptions, profile_model
    size = SIZES[size_name]
    cost = _cost_model(size, args.seq, dtype, gpu, 1)
    group = cost.group("gpu")
    options = ProfilerOptions(micro_batches=(args.micro_batch,), repeats=args.repeats)
    profile = profile_model(size.config(), device_name=gpu, seq_len=args.seq, dtype=dtype,
                            options=options, device=args.device, save=False)
    clock = "CUDA events" if args.device != "cpu" else "wall clock"
    lines = [f"| {size_name} | {dtype} | layer | measured fwd ms ({clock}) | estimate fwd ms | "
             "measured bwd ms | estimate bwd ms |", "|---|---|---|---:|---:|---:|---:|"]
    seen = set()
    for layer in cost.model.layers:
        if layer.signature in seen:
            continue
        seen.add(layer.signature)
        hit = profile.lookup(gpu, layer.signature, args.micro_batch, args.seq, dtype)
        est_f, est_b = cost.compute_s(group, args.micro_batch, layer.index, layer.index + 1)
        lines.append(f"| | | {layer.kind} | {hit.forward_s * 1e3:.3f} | {est_f * 1e3:.3f} | "
                     f"{hit.backward_s * 1e3:.3f} | {est_b * 1e3:.3f} |")
    return lines


# -- 3. loss curves ---------------------------------------------------------------------------

def _batches(size: Size, plan: Plan, steps: int) -> list:
    """Token rows where each token's successor is a fixed map of it, 10% of them random."""
    import torch

    from hapt_hf.pipeline import Batch
    gen = torch.Generator().manual_seed(0)
    succ = torch.randperm(size.vocab, generator=gen)
    out = []
    for _ in range(steps):
        ids = torch.empty(plan.global_batch_size, plan.seq_len, dtype=torch.long)
        ids[:, 0] = torch.randint(0, size.vocab, (plan.global_batch_size,), generator=gen)
        for t in range(1, plan.seq_len):
            noise = torch.rand(plan.global_batch_size, generator=gen) < 0.1
            rand = torch.randint(0, size.vocab, (plan.global_batch_size,), generator=gen)
            ids[:, t] = torch.where(noise, rand, succ[ids[:, t - 1]])
        out.append(Batch(ids))
    return out


def train_curves(rank: int, world_size: int, size_name: str, args_dict: dict) -> dict:
    """One rank of the loss-curve runs: fp32, bf16, fp16 in turn on the same data."""
    import torch

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig, init_distributed
    init_distributed(backend="gloo" if args_dict["device"] == "cpu" else None)
    size, curves = SIZES[size_name], {}
    for dtype in ("fp32", "bf16", "fp16"):
        plan = _plan(size, world_size, dtype, args_dict["micro_batch"], args_dict["microbatches"],
                     args_dict["seq"])
        device = "cpu" if args_dict["device"] == "cpu" else f"cuda:{rank}"
        rt = PipelineRuntime(plan, size.config(), RuntimeConfig(timeout_s=600, device=device))
        opt = rt.make_optimizer(torch.optim.AdamW, lr=args_dict["lr"])
        results = [rt.train_step(b, opt, max_grad_norm=1.0)
                   for b in _batches(size, plan, args_dict["steps"])]
        curves[dtype] = {"losses": [r.loss for r in results],
                         "skipped": sum(r.skipped for r in results)}
        rt.shutdown()
    return curves


def curves_table(size_name: str, args) -> list[str]:
    from benchmarks.ranks import run_ranks
    keys = ("device", "micro_batch", "microbatches", "seq", "steps", "lr")
    curves = run_ranks(train_curves, args.ranks, size_name, {k: getattr(args, k) for k in keys},
                       init_process_group=False, timeout_s=3600)[0].value
    ref = curves["fp32"]["losses"]
    lines = [f"| {size_name} | precision | first loss | final loss | max abs deviation from fp32 "
             f"| steps skipped |", "|---|---|---:|---:|---:|---:|"]
    for dtype, c in curves.items():
        dev = max(abs(a - b) for a, b in zip(c["losses"], ref))
        label = "fp16 + dynamic loss scaling" if dtype == "fp16" else dtype
        lines.append(f"| | {label} | {c['losses'][0]:.4f} | {c['losses'][-1]:.4f} | {dev:.4f} | "
                     f"{c['skipped']} |")
    return lines


# -- 4. tensor-parallel block ------------------------------------------------------------------

TP_GPUS_NEEDED = ("one device times the compute split only: the block's tensor-parallel "
                  "all-reduces run among t devices, and timing them needs t GPUs on one node "
                  "(profile_group_leaders with ProfilerOptions.tp_degrees)")


def tp_table(size_name: str, dtype: str, args, gpu: str) -> list[str]:
    from hapt_hf.core.tp import TP_DEGREES
    from hapt_hf.planner.cost_model import tp_efficiency
    from hapt_hf.profiling import ProfilerOptions, profile_model
    from hapt_hf.profiling.tp_split import tp_degrees
    size, mb = SIZES[size_name], args.micro_batch
    degrees, refused = tp_degrees(size.config(), TP_DEGREES)
    options = ProfilerOptions(micro_batches=(mb,), repeats=args.repeats, tp_degrees=degrees)
    profile = profile_model(size.config(), device_name=gpu, seq_len=args.seq, dtype=dtype,
                            options=options, device=args.device, save=False)
    # the cost model as the planner runs it with a profile of one device: the whole block
    # measured, its tensor-parallel split predicted from it
    whole_only = Profile({k: t for k, t in profile.timings.items() if k.tp == 1})
    fed = _cost_model(size, args.seq, dtype, gpu, max(TP_DEGREES), whole_only)
    estimate = _cost_model(size, args.seq, dtype, gpu, max(TP_DEGREES))
    group = fed.group("gpu")
    block = next(l for l in fed.model.layers if l.kind == "block")
    j = block.index
    clock = "CUDA events" if args.device != "cpu" else "wall clock"
    lines = [f"| {size_name} | {dtype} | tp | measured fwd ms ({clock}) | predicted fwd ms | "
             "measured bwd ms | predicted bwd ms | measured / predicted (fwd+bwd) | "
             "tp_efficiency | catalogue fwd+bwd ms | all-reduces per pass, priced (not timed) ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in (1, *degrees):
        hit = profile.lookup(gpu, block.signature, mb, args.seq, dtype, tp=t)
        ar = fed.tp_allreduce_s(group, mb, t, j)
        pf, pb = (x - ar for x in fed.compute_s(group, mb, j, j + 1, tp=t))
        ef, eb = (x - ar for x in estimate.compute_s(group, mb, j, j + 1, tp=t))
        ratio = (hit.forward_s + hit.backward_s) / (pf + pb)
        eff = tp_efficiency(t, size.hidden) if t > 1 else 1.0
        lines.append(f"| | | {t} | {hit.forward_s * 1e3:.3f} | {pf * 1e3:.3f} | "
                     f"{hit.backward_s * 1e3:.3f} | {pb * 1e3:.3f} | {ratio:.2f} | {eff:.2f} | "
                     f"{(ef + eb) * 1e3:.3f} | {ar * 1e3:.3f} |")
    lines += ["", f"{size_name} {dtype}: {TP_GPUS_NEEDED}; the all-reduces are priced on the "
              f"check's nominal link ({group.intra_node.bandwidth_gbps:g} Gbit/s, "
              f"{group.intra_node.latency_us:g} us)."]
    lines += [f"{size_name}: not split: {why}" for why in refused]
    return lines


# -- 5. the loss on logits split by vocabulary columns -------------------------------------------

LOSS_GPUS_NEEDED = ("one device runs it at t = 1 only (a one-rank group): the saving, each "
                    "rank keeping ceil(V/t) columns, and the all-reduces among t ranks need t GPUs")


def _loss_on_one_rank(rank: int, world_size: int, args_dict: dict) -> dict:
    """transformers' loss and ``vocab_parallel_loss_sum`` (logits a DTensor of one rank) on the
    same 16-bit logits: their losses, gradients, peak bytes and times."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hapt_hf.compat.transformers_api import causal_lm_loss_sum
    from hapt_hf.pipeline.precision import torch_dtype
    from hapt_hf.pipeline.vocab_parallel import vocab_parallel_loss_sum
    from hapt_hf.profiling.memory import saved_tensor_bytes
    a = argparse.Namespace(**args_dict)
    size, device = SIZES[a.size], torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and dist.get_backend() != "nccl":  # run_ranks set up Gloo; the loss runs on NCCL
        dist.destroy_process_group()
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    mesh = init_device_mesh(device.type, (1,))
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(a.micro_batch, a.seq, size.vocab, generator=g)).to(
        torch_dtype(a.dtype)).to(device)
    labels = torch.randint(0, size.vocab, (a.micro_batch, a.seq), generator=g).to(device)
    out, none = {}, torch.nn.Module()  # no weights to leave out of the saved bytes
    for name in ("transformers", "vocab_parallel"):
        times, peak, saved = [], 0.0, 0.0
        for _ in range(a.repeats + 1):  # the first is a warm-up, not counted
            src = logits.clone()
            if name == "vocab_parallel":
                src = distribute_tensor(src, mesh, [Shard(-1)], src_data_rank=None)
            src.requires_grad_(True)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            if name == "vocab_parallel":
                saved, loss = saved_tensor_bytes(none, lambda s=src: vocab_parallel_loss_sum(s, labels))
            else:
                saved, loss = saved_tensor_bytes(
                    none, lambda s=src: causal_lm_loss_sum(s, labels, size.vocab))
            loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
                peak = float(torch.cuda.max_memory_allocated(device) - base)
            times.append(time.perf_counter() - t0)
        grad = src.grad.to_local() if name == "vocab_parallel" else src.grad
        out[name] = {"loss": float(loss.detach()), "grad": grad.float().cpu(), "saved": float(saved),
                     "peak": peak, "ms": sorted(times[1:])[len(times[1:]) // 2] * 1e3}
    diff = float((out["vocab_parallel"]["grad"] - out["transformers"]["grad"]).abs().max())
    scale = float(out["transformers"]["grad"].abs().max())
    return {k: {f: v for f, v in d.items() if f != "grad"} for k, d in out.items()} | {
        "grad_rel": diff / scale, "tokens": a.micro_batch * a.seq}


def loss_table(size_name: str, dtype: str, args, gpu: str) -> list[str]:
    from benchmarks.ranks import run_ranks
    from hapt_hf.planner.cost_model import loss_softmax_bytes
    size = SIZES[size_name]
    r = run_ranks(_loss_on_one_rank, 1, {**vars(args), "size": size_name, "dtype": dtype},
                  timeout_s=600)[0].value
    model = _cost_model(size, args.seq, dtype, gpu, 1).model
    clock = "CUDA events" if args.device != "cpu" else "wall clock"
    lines = [f"| {size_name} | {dtype} | loss | value | saved for backward MB | peak MB "
             f"(forward + backward) | ms, median ({clock}) |", "|---|---|---|---:|---:|---:|---:|"]
    for name in ("transformers", "vocab_parallel"):
        d = r[name]
        peak = f"{d['peak'] / 1e6:.1f}" if args.device != "cpu" else "-"
        lines.append(f"| | | {name} | {d['loss']:.6f} | {d['saved'] / 1e6:.1f} | {peak} | "
                     f"{d['ms']:.2f} |")
    planned = loss_softmax_bytes(model) * r["tokens"] / args.seq / 1e6
    lines += ["", f"{size_name} {dtype}: loss difference "
              f"{abs(r['vocab_parallel']['loss'] - r['transformers']['loss']):.2e}, largest gradient "
              f"difference {r['grad_rel']:.2e} of the largest gradient; the planner prices the "
              f"fp32 softmax the loss keeps at {planned:.1f} MB for these {r['tokens']} tokens at "
              f"t = 1 (ceil(V/t) columns at t); {LOSS_GPUS_NEEDED}."]
    return lines


# -- command line ------------------------------------------------------------------------------

def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES))
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    p.add_argument("--seq", type=int)
    p.add_argument("--micro-batch", dest="micro_batch", type=int)
    p.add_argument("--microbatches", type=int, help="micro-batches per step (loss curves)")
    p.add_argument("--stages", type=int, default=2, help="stages the memory check cuts into")
    p.add_argument("--ranks", type=int, help="processes of the loss-curve pipeline")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=5, help="timed windows per layer")
    p.add_argument("--gpu", help="catalogue name of the device (default: from its name)")
    p.add_argument("--parts", nargs="+", default=["memory", "times", "curves", "tp", "loss"],
                   choices=["memory", "times", "curves", "tp", "loss"])
    args = p.parse_args(argv)
    defaults = CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def _check_device(args) -> None:
    import torch
    if args.device == "cpu":
        return
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA GPU is available here; run with "
                         "--device cpu for the CPU check")
    if args.ranks > torch.cuda.device_count():
        raise SystemExit(f"--ranks {args.ranks} needs {args.ranks} GPUs (one per pipeline "
                         f"rank) but {torch.cuda.device_count()} are visible; use --ranks 1")
    args.device = "cuda:0"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _check_device(args)
    gpu = _gpu_name(args.device, args.gpu)
    print(f"device {args.device} (catalogue: {gpu}), seq {args.seq}, micro-batch "
          f"{args.micro_batch}, {args.microbatches} micro-batches, {args.steps} steps\n")
    for size_name in args.sizes:
        params = ModelSpec.from_config(SIZES[size_name].config(), args.seq).total_params
        print(f"## {size_name} ({params / 1e6:.1f} M parameters)\n")
        for part in args.parts:
            if part == "curves":
                print("\n".join(curves_table(size_name, args)) + "\n", flush=True)
                continue
            table = {"memory": memory_table, "times": times_table, "tp": tp_table,
                     "loss": loss_table}[part]
            for dtype in args.dtypes:
                print("\n".join(table(size_name, dtype, args, gpu)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
