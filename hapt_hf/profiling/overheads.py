"""What a pipeline step costs beyond its layers' profiled times, measured on the device.

The cost model prices a stage's action as the sum of its layers' times, each layer timed alone
(:func:`~hapt_hf.profiling.profiler.time_layer`), and a transfer as ``latency + bytes /
bandwidth`` of the fitted link. Three things the runtime does are not in those figures:

* **a fixed cost per action** (``StepOverheads.action_s``): one block is run as the runtime
  runs an action (the received input made a leaf that needs its gradient, the forward, the
  output copied out as a send copies it; ``torch.autograd.backward`` from the output and the
  gradient received, the input's gradient copied out) beside the same block timed as the
  profiler times a layer, at each profiled micro-batch size; what the action takes beyond
  the bare block is fitted against the micro-batch size, and the intercept is the cost every
  action pays whatever its size (:func:`fit_action_overhead`);
* **a stage's further layers** (``StepOverheads.layer_s``): a stage of three blocks run the
  same way, less the one-block action, over its two further blocks, less the bare block: what
  each of a stage's further layers costs beyond its profiled time (below 0 where a layer timed
  alone pays per-call costs that a stage of several pays once);
* **the split backward** (``StepOverheads.input_grad_ratio``, ``weight_grad_ratio``): on the
  same stage, ``I`` then ``W`` (``hapt_hf.compat.torch_api.backward_input`` /
  ``backward_weight``, as the runtime runs ``zero_bubble``) alternated with the fused ``B``, each
  over the fused one (:func:`split_ratios`);
* **a fixed cost per transfer** (``LinkMeasurement.overhead_us``): a tiny tensor sent with
  ``isend`` and waited for, as the runtime does, less what the fitted link gives for its bytes
  (:func:`transfer_overhead_us`);
* **what a transfer takes from the compute at its two ends** (``LinkMeasurement.
  transfer_cpu_us``, inside a group): a fixed compute timed with an activation-sized
  transfer in flight, against alone, on the sender and on the receiver
  (:func:`time_transfer_cpu`); the runtime's ranks pay it between and inside their actions,
  once for each send and each receive.

The fits are plain functions of the timings (unit-tested on synthetic ones); the measuring
functions import torch inside.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Sequence

from hapt_hf.planner.profile import StepOverheads

from .store import ProfilerError

__all__ = ["fit_action_overhead", "split_ratios", "transfer_overhead_us", "pool_overheads",
           "measure_step_overheads", "time_tiny_transfer", "time_transfer_cpu", "STAGE_BLOCKS",
           "TINY_BYTES", "TRANSFER_CPU_BYTES"]

STAGE_BLOCKS = 3
"""Blocks of the stage a further layer's cost is measured on: two further blocks beside one
double the signal, against the timings' noise, of a stage of two."""

TINY_BYTES = 4
"""The tensor sent to time a transfer's fixed cost: one fp32 element."""

TRANSFER_CPU_BYTES = 1 << 16
"""The tensor moved to time what a transfer takes from the compute at both ends: a small
activation (one sample of 64 positions of 256 fp32 values)."""


def fit_action_overhead(sizes: Sequence[int], measured_s: Sequence[float],
                        priced_s: Sequence[float], min_z: float = 1.0) -> float:
    """The fixed seconds per action: the least-squares intercept, over micro-batch ``sizes``,
    of the median at each size of what an action measured beyond its layers' priced time (one
    entry per action timed: several share a size; the median, so that a round a busy machine
    or a CPU quota's throttling stretched does not move it). With one distinct size, that
    size's median. 0 where the intercept is within ``min_z`` standard errors of 0 (each size's
    median's error from its interquartile range, ``0.93 x IQR / sqrt(n)``; the largest): on a
    machine others share, a difference of timings of tens of milliseconds is noise until it
    stands out of it."""
    if not sizes or not len(sizes) == len(measured_s) == len(priced_s):
        raise ProfilerError("fit_action_overhead needs one size, measured and priced time per "
                            f"action (got {len(sizes)}, {len(measured_s)}, {len(priced_s)})")
    by_size: dict[int, list[float]] = {}
    for x, m, p in zip(sizes, measured_s, priced_s):
        by_size.setdefault(x, []).append(m - p)
    xs = sorted(by_size)
    ys = [statistics.median(by_size[x]) for x in xs]
    error = max(_median_error(by_size[x]) for x in xs)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    intercept = my
    if sxx > 0:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        intercept = my - slope * mx
    return intercept if abs(intercept) > min_z * error else 0.0


def _median_error(values: Sequence[float]) -> float:
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return 0.93 * (q[2] - q[0]) / len(values) ** 0.5


def split_ratios(fused_s: Sequence[float], input_s: Sequence[float],
                 weight_s: Sequence[float]) -> tuple[float, float]:
    """(``I / B``, ``W / B``): the medians of the split backward's parts over the fused one's."""
    if not fused_s or not input_s or not weight_s:
        raise ProfilerError("split_ratios needs at least one timing of B, I and W")
    b = statistics.median(fused_s)
    if b <= 0:
        raise ProfilerError(f"the fused backward's median time is {b}; it must be > 0")
    return statistics.median(input_s) / b, statistics.median(weight_s) / b


def transfer_overhead_us(nbytes: int, one_way_s: Sequence[float], bandwidth_gbps: float,
                         latency_us: float) -> float:
    """Microseconds a transfer of ``nbytes`` took (the median of ``one_way_s``) beyond what the
    fitted link gives for it, ``latency + bytes / bandwidth``; never below 0."""
    if not one_way_s or bandwidth_gbps <= 0:
        raise ProfilerError("transfer_overhead_us needs timings and a positive bandwidth")
    model = latency_us * 1e-6 + nbytes * 8 / (bandwidth_gbps * 1e9)
    return max(statistics.median(one_way_s) - model, 0.0) * 1e6


def pool_overheads(measured: Sequence[dict[str, StepOverheads]]) -> dict[str, StepOverheads]:
    """Every device any rank measured, each figure the median over the ranks that measured it
    (as :func:`~hapt_hf.profiling.profiler.pool_timings` pools the layer timings)."""
    by_device: dict[str, list[StepOverheads]] = {}
    for per_rank in measured:
        for d, o in per_rank.items():
            by_device.setdefault(d, []).append(o)
    return {d: StepOverheads(statistics.median(o.action_s for o in os_),
                             statistics.median(o.input_grad_ratio for o in os_),
                             statistics.median(o.weight_grad_ratio for o in os_),
                             statistics.median(o.layer_s for o in os_))
            for d, os_ in by_device.items()}


# -- measuring (torch inside) ----------------------------------------------------------------

def _stage_of_blocks(config, blocks: int, device: str, attn_implementation: str | None):
    """A middle stage of ``blocks`` blocks as the runtime builds it (seed 0's weights)."""
    import torch

    from hapt_hf.pipeline.stage import build_stage
    small = copy.deepcopy(config)
    small.num_hidden_layers = blocks
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:blocks]
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        stage = build_stage(small, (1, blocks + 1), seed=None, device=device,
                            attn_implementation=attn_implementation)
    return stage.train()


def measure_step_overheads(config, sizes: Sequence[int], seq_len: int, dtype: str,
                           device: str, attn_implementation: str | None,
                           repeats: int = 12) -> StepOverheads:
    """At each micro-batch size of ``sizes``, one block timed as the profiler times a layer
    (bare), the same block run as the runtime runs an action (its input a fresh leaf that
    needs its gradient, its output and input gradient copied out as a send copies them), and
    a stage of :data:`STAGE_BLOCKS` blocks run the same way, ``I`` and ``W`` of it beside its
    ``B``. Fitted against the micro-batch size: the fixed cost per action (the one block as an
    action less bare), the cost of each of a stage's further layers beyond its profiled time
    (the stage less the one-block action, less the bare block for each further block, over
    their number), and the split's ratios. Each repetition runs all of them in turn, so that a
    busy machine slows them alike."""
    import torch
    one = _stage_of_blocks(config, 1, device, attn_implementation)
    more = STAGE_BLOCKS - 1
    two = _stage_of_blocks(config, STAGE_BLOCKS, device, attn_implementation)
    xs, bare, action, stage = [], [], [], []
    fused, inp, wgt = [], [], []
    for mb in sorted(set(sizes)):
        gen = torch.Generator().manual_seed(0)
        x0 = torch.randn(mb, seq_len, config.hidden_size, generator=gen).to(device)
        grad = torch.randn(x0.shape, generator=gen).to(device)
        runs = ((one, False, True), (one, False, False), (two, True, False))
        for r in range(repeats + 2):  # the first two warm the allocator: not counted
            # each round in another order: what runs first after the last round's split
            # backward (the allocator, the caches) is not always the bare block
            got = {}
            for k in (r % 3, (r + 1) % 3, (r + 2) % 3):
                module, split, bare_run = runs[k]
                got[k] = _one_round(module, x0, grad, dtype, split=split, bare=bare_run)
            (lf, lb, _, _), (af, ab, _, _), (tf, tb, ti, tw) = got[0], got[1], got[2]
            if r < 2:
                continue
            xs += [mb, mb]
            bare += [lf, lb]
            action += [af, ab]
            stage += [(tf - af) / more, (tb - ab) / more]
            fused.append(tb)
            inp.append(ti)
            wgt.append(tw)
    ri, rw = split_ratios(fused, inp, wgt)
    # the action does all the bare block does and more: below 0 is the timings' error
    return StepOverheads(max(fit_action_overhead(xs, action, bare), 0.0), ri, rw,
                         fit_action_overhead(xs, stage, bare))


def _one_round(stage, x0, grad, dtype: str, split: bool = True, bare: bool = False
               ) -> tuple[float, float, float, float]:
    """Seconds of F and B (fused) on ``stage``, then (``split``) of I and W of a second
    forward; 0 for those not run. ``bare``: F and B as the profiler times a layer (its input
    made once, nothing copied out)."""
    import torch

    from hapt_hf.compat.torch_api import backward_input, backward_weight

    from .memory import compute_context
    cuda = x0.is_cuda
    params = list(stage.parameters())

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(x0.device)
        return time.perf_counter()

    leaf = x0.detach().requires_grad_(True)

    def forward():
        x = leaf if bare else x0.detach().clone().requires_grad_(True)  # a received activation
        with compute_context(dtype, x.device):
            out = stage(x)
        if not bare:
            out.detach().contiguous().clone()  # the send's copy
        return x, out

    t0 = now()
    x, out = forward()
    t1 = now()
    if bare:
        out.backward(grad)
    else:
        torch.autograd.backward(out, grad)
        x.grad.detach().clone()  # the gradient's send copy
    t2 = now()
    ti = tw = 0.0
    if split:
        x, out = forward()
        t3 = now()
        _, state = backward_input([out], [grad], [x], stage.parameters())
        x.grad.detach().clone()  # the gradient's send copy, after I as the runtime sends it
        t4 = now()
        backward_weight(params, state)
        t5 = now()
        ti, tw = t4 - t3, t5 - t4
    for p in params:
        p.grad = None
    leaf.grad = None
    return t1 - t0, t2 - t1, ti, tw


def time_tiny_transfer(peer: int, sender: bool, repeats: int = 20) -> list[float]:
    """One-way seconds of a :data:`TINY_BYTES` tensor sent with ``isend`` and waited for, as
    the runtime posts its transfers, to ``peer`` (both ranks call it, one with ``sender``):
    each is half of a round trip of the tensor and as small a reply. Returns the sender's
    timings ([] on the receiver)."""
    import torch
    import torch.distributed as dist
    buf = torch.zeros(TINY_BYTES // 4)
    out = []
    for i in range(repeats + 2):  # the first two also warm the connection: not counted
        t0 = time.perf_counter()
        if sender:
            dist.isend(buf, peer).wait()
            dist.irecv(buf, peer).wait()
        else:
            dist.irecv(buf, peer).wait()
            dist.isend(buf, peer).wait()
        if sender and i >= 2:
            out.append((time.perf_counter() - t0) / 2)
    return out


def time_transfer_cpu(peer: int, sender: bool, repeats: int = 24,
                      nbytes: int = TRANSFER_CPU_BYTES) -> float:
    """Seconds one transfer of ``nbytes`` to or from ``peer`` takes from this rank's compute:
    a fixed compute (:func:`_fixed_work`) timed with the transfer posted just before it
    (``isend`` on the sender, ``irecv`` on the receiver) and waited for after it, less the
    same compute timed alone, alternated; the median of the differences (both ranks call it,
    one with ``sender``; each returns its own side's figure). What a rank pays for a transfer
    beyond the post's call: the backend's threads move the bytes on the rank's cores (and,
    between two processes of one machine, the kernel's copy and the receiving side's network
    processing), the cores its compute runs on. Never below 0."""
    import torch
    import torch.distributed as dist
    buf = torch.zeros(max(nbytes // 4, 1))
    sync = torch.zeros(1)
    work = _fixed_work()
    diffs, alone = [], 0.0
    for i in range(2 * (repeats + 2)):  # the first two pairs warm the connection: not counted
        # both ranks start together: a one-element round trip, the receiver replying
        if sender:
            dist.send(sync, peer)
            dist.recv(sync, peer)
        else:
            dist.recv(sync, peer)
            dist.send(sync, peer)
        with_transfer = i % 2 == 1
        t0 = time.perf_counter()
        pending = ((dist.isend if sender else dist.irecv)(buf, peer)
                   if with_transfer else None)
        work()
        t = time.perf_counter() - t0
        if pending is not None:
            pending.wait()
            if i >= 4:
                diffs.append(t - alone)
        else:
            alone = t
    return max(statistics.median(diffs), 0.0) if diffs else 0.0


def _fixed_work():
    """A compute of about a millisecond on one core: a chain of small matmuls, as a layer's."""
    import torch
    a, b = torch.randn(64, 256), torch.randn(256, 256) * 0.01

    def run() -> None:
        x = a
        for _ in range(8):
            x = x @ b
    return run
