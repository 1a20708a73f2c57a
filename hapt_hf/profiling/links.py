"""Timing the links the planner prices: one link between two groups' leaders (a send and a
one-element reply), the link inside a group (a real all-reduce among its ranks, of gradient
buckets as data parallelism does it), and the same link as a tensor-parallel replica uses it
(an all-reduce of one block activation among ``t`` of its ranks).

All fit ``t = latency + bytes / bandwidth`` by least squares (:func:`fit_link`); the
all-reduce fit is put in the cost model's own ring formula, so the figures it gives, priced
again by the planner, are the times measured here.
"""
from __future__ import annotations

import time
from dataclasses import replace

from hapt_hf.core.defaults import GRAD_BUCKET_BYTES
from hapt_hf.core.precision import DTYPE_BYTES, TORCH_DTYPE_NAMES
from hapt_hf.planner.profile import LinkMeasurement

from .overheads import TINY_BYTES, time_tiny_transfer, time_transfer_cpu, transfer_overhead_us
from .store import ProfilerError

__all__ = ["fit_link", "measure_link", "measure_group_allreduce", "time_inside_groups",
           "measure_tp_allreduce", "time_tp_inside_groups", "activation_sizes"]


def fit_link(sizes_bytes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = latency + bytes / bandwidth``: (bandwidth_gbps, latency_us)."""
    n = len(sizes_bytes)
    if n < 2 or len(set(sizes_bytes)) < 2:
        raise ProfilerError("a link fit needs at least two distinct message sizes")
    mx, my = sum(sizes_bytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, seconds)) / sxx
    slope = max(slope, 1e-15)  # a link faster than we can resolve: cap, never negative
    latency = max(my - slope * mx, 0.0)
    return 8.0 / slope / 1e9, latency * 1e6


def measure_link(peer: int, sender: bool, a: str, b: str,
                 sizes_bytes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22),
                 repeats: int = 3) -> LinkMeasurement:
    """Time one-way transfers to ``peer`` (both ranks call it, one with ``sender=True``).

    Each transfer is a send of the message and a one-element reply, so the receiver's clock is
    never needed; the reply's own latency is removed by halving the fitted intercept. Then a
    tiny tensor sent as the runtime sends (:func:`~.overheads.time_tiny_transfer`) gives the
    fixed cost per transfer beyond the fit (``overhead_us``, the sender's figure).
    """
    import torch
    import torch.distributed as dist
    xs, ys = [], []
    for size in sizes_bytes:
        buf, ack = torch.zeros(max(size // 4, 1)), torch.zeros(1)
        for i in range(repeats + 1):  # the first also opens the connection: not counted
            t0 = time.perf_counter()
            if sender:
                dist.send(buf, peer)
                dist.recv(ack, peer)
            else:
                dist.recv(buf, peer)
                dist.send(ack, peer)
            if i:
                xs.append(buf.numel() * 4)
                ys.append(time.perf_counter() - t0)
    bw, lat_both = fit_link(xs, ys)
    tiny = time_tiny_transfer(peer, sender)
    over = transfer_overhead_us(TINY_BYTES, tiny, bw, lat_both / 2) if tiny else 0.0
    return LinkMeasurement(a, b, bw, lat_both / 2, overhead_us=over)


_GRADS_PER_BUCKET = 8
"""Gradients in each timed bucket (a transformer block's weight and bias tensors, roughly)."""


def measure_group_allreduce(group_name: str, group, width: int,
                            sizes_bytes: tuple[int, ...] = (1 << 20, 1 << 23, GRAD_BUCKET_BYTES),
                            repeats: int = 3) -> LinkMeasurement:
    """Time all-reduces of fp32 buffers among one group's ``width`` ranks (each of them calls
    it, with ``group`` their process group): the link the planner prices a stage's gradient
    all-reduce on, measured by doing one.

    The fit is the cost model's own ring formula, ``t = 2(d-1)/d * bytes / bandwidth + 2(d-1) *
    latency``, so the measured figures put back in it give the times seen here. The sizes run up
    to one gradient bucket, what the runtime all-reduces at a time, and each is a bucket of
    several gradients all-reduced as the runtime does it
    (:func:`~hapt_hf.pipeline.grad_sync.all_reduce_flat` into a bucket's
    :func:`~hapt_hf.pipeline.grad_sync.flat_buffer`: packed into one buffer and copied back,
    which on a CPU costs as much as a fast link's transfer).
    """
    import torch

    from hapt_hf.pipeline.grad_sync import all_reduce_flat, flat_buffer
    ring, hops = 2 * (width - 1) / width, 2 * (width - 1)
    xs, ys = [], []
    for size in sizes_bytes:
        numel = max(size // 4 // _GRADS_PER_BUCKET, 1)
        grads = [torch.zeros(numel) for _ in range(_GRADS_PER_BUCKET)]
        flat = flat_buffer(grads)
        for i in range(repeats + 1):  # the first also opens the connections: not counted
            t0 = time.perf_counter()
            all_reduce_flat(grads, group, flat)
            if i:
                xs.append(ring * numel * _GRADS_PER_BUCKET * 4)
                ys.append(time.perf_counter() - t0)
    bw, lat = fit_link(xs, ys)
    return LinkMeasurement(group_name, group_name, bw, lat / hops)


def time_inside_groups(groups: dict[str, list[int]], rank: int,
                        sizes_bytes: tuple[int, ...]) -> list[LinkMeasurement]:
    """Collective: every group of two or more ranks times its all-reduce, one group after
    another (every rank takes part in making each group's process group; the others wait at
    the barrier). Returns what this rank's group measured if this rank leads it, else nothing.
    The group's first two ranks then time a tiny point-to-point transfer
    (:func:`~.overheads.time_tiny_transfer`): what it takes beyond the all-reduce's fit of the
    link is the group's ``overhead_us``, the fixed cost of a stage-boundary transfer inside it;
    then what a transfer takes from the compute of its sender and of its receiver
    (:func:`~.overheads.time_transfer_cpu`), the mean of the two being the group's
    ``transfer_cpu_us``."""
    import torch
    import torch.distributed as dist
    out = []
    for name in sorted(groups):
        ranks = list(groups[name])
        if len(ranks) < 2:
            continue
        sub = dist.new_group(ranks)  # every rank takes part in making every group
        if rank in ranks:
            m = measure_group_allreduce(name, sub, len(ranks), sizes_bytes)
            if rank in ranks[:2]:
                peer, sender = ranks[1 - ranks.index(rank)], rank == ranks[0]
                tiny = time_tiny_transfer(peer, sender)
                if tiny:
                    m = replace(m, overhead_us=transfer_overhead_us(
                        TINY_BYTES, tiny, m.bandwidth_gbps, m.latency_us))
                mine = torch.tensor([time_transfer_cpu(peer, sender)])
                theirs = torch.zeros(1)
                if sender:  # the receiver's side, to the leader who keeps the figure
                    dist.recv(theirs, peer)
                else:
                    dist.send(mine, peer)
                m = replace(m, transfer_cpu_us=float(mine + theirs) / 2 * 1e6)
            if rank == ranks[0]:
                out.append(m)
        dist.barrier()
        dist.destroy_process_group(sub)
    return out


def activation_sizes(hidden_size: int, seq_len: int, dtype: str,
                     micro_batches: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes of one block's activation (``samples x seq x hidden`` in the compute dtype) at each
    micro-batch size, and at four times the largest so that a fit has two sizes to go on."""
    per_sample = seq_len * hidden_size * DTYPE_BYTES[dtype]
    return tuple(sorted({mb * per_sample for mb in (*micro_batches, 4 * max(micro_batches))}))


def measure_tp_allreduce(group_name: str, group, t: int, sizes_bytes: tuple[int, ...],
                         dtype: str = "fp32", repeats: int = 3) -> LinkMeasurement:
    """Time all-reduces of one activation tensor in the compute ``dtype`` among the ``t`` ranks
    of ``group`` (each of them calls it): what a ``t``-way tensor-parallel replica does after
    each rowwise projection forward and before each colwise one backward, on the link inside
    its group. Fitted with the same ring formula as :func:`measure_group_allreduce` (ring
    factor ``2(t-1)/t``, ``2(t-1)`` latency hops), so the cost model's price of a TP
    all-reduce on the measured link is the time seen here."""
    import torch
    import torch.distributed as dist

    if t < 2:
        raise ProfilerError(f"a tensor-parallel all-reduce needs at least 2 ranks, got {t}")
    ring, hops = 2 * (t - 1) / t, 2 * (t - 1)
    torch_dtype = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    xs, ys = [], []
    for size in sizes_bytes:
        buf = torch.zeros(max(size // DTYPE_BYTES[dtype], 1), dtype=torch_dtype,
                          device=_device_of(group))
        for i in range(repeats + 1):  # the first also opens the connections: not counted
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            if i:
                xs.append(ring * buf.numel() * DTYPE_BYTES[dtype])
                ys.append(time.perf_counter() - t0)
    bw, lat = fit_link(xs, ys)
    return LinkMeasurement(group_name, group_name, bw, lat / hops, tp=t)


def _device_of(group) -> str:
    """Where the all-reduce's tensors live: the local GPU under NCCL, else the CPU."""
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        import torch
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def time_tp_inside_groups(groups: dict[str, list[int]], rank: int, degrees: tuple[int, ...],
                          sizes_bytes: tuple[int, ...], dtype: str = "fp32"
                          ) -> list[LinkMeasurement]:
    """Collective: for each group and each degree ``t`` of ``degrees`` its ranks can hold, the
    group's first ``t`` ranks time the tensor-parallel all-reduce
    (:func:`measure_tp_allreduce`), one group and degree after another. Returns what this rank
    measured if it is the group's first rank, else nothing."""
    import torch.distributed as dist
    out = []
    for name in sorted(groups):
        for t in sorted(set(degrees)):
            ranks = list(groups[name])[:t]
            if t < 2 or len(ranks) < t:
                continue
            sub = dist.new_group(ranks)  # every rank takes part in making every group
            if rank in ranks:
                m = measure_tp_allreduce(name, sub, t, sizes_bytes, dtype)
                if rank == ranks[0]:
                    out.append(m)
            dist.barrier()
            dist.destroy_process_group(sub)
    return out
