"""Gradient sums of one rank: its replicas' all-reduce in buckets, the tied embedding's sum,
and the gradient statistics the whole job agrees on (norm, overflow) with clipping and unscaling.

Under tensor parallelism (a replica held by ``t`` ranks) a rank's sharded parameters and their
gradients are DTensors: every sum here runs on the local shards. The replicas' all-reduce runs
per shard, among the ranks at the same tensor-parallel position of every replica; whole
(replicated) parameters get the same gradient on every rank of a replica and need no sum
inside it, except those the model's plan marks for one (:attr:`TensorParallelShards.partial
<hapt_hf.pipeline.tensor_parallel.TensorParallelShards.partial>`), summed over the replica's
ranks after the replicas' all-reduce. The global norm counts each shard once and each whole
parameter once (the replica's TP rank 0); the tied embedding is summed once per replica (its
other ranks add zeros).

The replicas of a stage all-reduce their gradients in buckets of about ``GRAD_BUCKET_BYTES``
(the cost model's figure), in reverse parameter order, as DDP does: during the iteration's last
backward, a hook on every trainable parameter counts the gradients made final, and each bucket
is launched (asynchronously) once all of its gradients are, in bucket order, so the transfer
overlaps the rest of that backward. :meth:`GradSync.sync` launches what is left, sums the tied
embedding over the first and the last stage's ranks and waits for every bucket.

A bucket's gradients are packed into one flat buffer, all-reduced, and copied back. On a CPU
the buffer is kept from one iteration to the next: a fresh one of tens of MiB is new memory
from the system every time (its pages faulted in and zeroed), which costs more than the copy
itself; a GPU's caching allocator gives the block back at no cost, and the buffer is not held
through the forward, when activations peak. The profiler times the same routine
(:func:`all_reduce_flat` with a :func:`flat_buffer`), so the planner prices the all-reduce as
the runtime runs it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from hapt_hf.pipeline.tensor_parallel import TensorParallelShards, is_sharded, local_tensor

__all__ = ["GradSync", "GradBuckets", "all_reduce_flat", "flat_buffer"]


class GradSync:
    """The gradients of one stage replica and the groups they are summed in.

    Args:
        stage: this rank's stage module (its ``tied_parameters()`` are summed over ``tied_pg``).
        dp_pg: the process group of the stage's replicas (None: a stage of width 1).
        tied_pg: the process group of the first and the last stage's ranks (None: no tied
            embedding to sum).
        bucket_bytes: gradient bytes per replica all-reduce bucket.
        overlap: launch buckets during the iteration's last backward.
        tp: the replica's tensor-parallel sharding (None: a replica of one rank).
    """

    def __init__(self, stage: torch.nn.Module, dp_pg: Any, tied_pg: Any,
                 bucket_bytes: int, overlap: bool, tp: TensorParallelShards | None = None) -> None:
        self.stage = stage
        self.dp_pg, self.tied_pg = dp_pg, tied_pg
        self.tp_pg = None if tp is None else tp.group
        self.tp_rank = 0 if tp is None else tp.rank
        self.partial = [] if tp is None else list(tp.partial)
        self.tied = list(stage.tied_parameters())
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.buckets: GradBuckets | None = None

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.stage.parameters())

    def release_pgs(self) -> None:
        """Forget the process groups (the runtime is shut down; the groups themselves stay)."""
        self.dp_pg = self.tied_pg = self.tp_pg = None

    def update_buckets(self) -> None:
        """Bucket the parameters that train now: adapters added or parameters frozen after the
        runtime was built (LoRA through the recipe) change them."""
        if self.dp_pg is None:
            return
        # frozen parameters (e.g. a LoRA base) take no part; every replica freezes the same
        # ones. Tied ones are summed over the tied group, which holds the replicas too.
        tied = {id(p) for p in self.tied}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in tied]
        # the buckets hold these parameters, so an id here cannot belong to a new one
        if self.buckets is not None and self.buckets.ids == [id(p) for p in params]:
            return
        if self.buckets is not None:
            self.buckets.close()
        self.buckets = GradBuckets(params, self.dp_pg, self.bucket_bytes, self.overlap)

    @contextlib.contextmanager
    def last_backward(self, params: list[torch.nn.Parameter] | None = None) -> Iterator[None]:
        """Around the iteration's last backward of ``params`` (None: every parameter), which
        makes their gradients final: the bucket hooks launch buckets during it. A rank holding
        several stages (interleaved) makes each stage's final in its own last backward; a split
        backward makes them final in its last ``W``."""
        if self.buckets is None:
            yield
            return
        self.buckets.arm(None if params is None else {id(p) for p in params})
        yield
        self.buckets.backward_done()

    def accumulated(self, params: list[torch.nn.Parameter]) -> None:
        """Tell the bucket hooks that ``params``' gradients were added to outside the
        autograd engine's accumulation (a split backward's weight gradients), which fires no
        hook of its own."""
        if self.buckets is not None:
            for p in reversed(params):
                if p.grad is not None:
                    self.buckets.on_grad(p)

    def launch_s(self) -> list[float]:
        return [] if self.buckets is None else self.buckets.launch_s()

    def stash(self) -> list[Tensor | None]:
        """Set aside the gradients already there (accumulation): they must not be all-reduced
        a second time."""
        stash = [p.grad for p in self.parameters()]
        for p in self.parameters():
            p.grad = None
        return stash

    def restore(self, stash: list[Tensor | None]) -> None:
        for p, old in zip(self.parameters(), stash):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)

    def sync(self) -> None:
        """Finish the gradient all-reduce: launch the buckets the last backward did not (all of
        them without overlap), sum the tied embedding, wait for every bucket."""
        # frozen parameters (e.g. a LoRA base) take no part; every replica freezes the same ones
        trainable = [p for p in self.parameters() if p.requires_grad]
        for p in trainable:
            if p.grad is None:  # unused in this iteration: still part of the all-reduce
                p.grad = torch.zeros_like(p)
        if self.buckets is not None:
            self.buckets.launch_rest()
        tied = [p.grad for p in self.tied if p.requires_grad]
        if self.tied_pg is not None and tied:
            if self.tp_rank != 0:  # every rank of a replica holds the same gradient: count one
                for g in tied:
                    g.zero_()
            all_reduce_flat(tied, self.tied_pg)
        if self.buckets is not None:
            self.buckets.wait()
        partial = [local_tensor(p.grad) for p in self.partial if p.requires_grad]
        if self.tp_pg is not None and partial:
            all_reduce_flat(partial, self.tp_pg)

    def unscale(self, scale: float) -> None:
        """Divide every gradient by the loss scale (a power of two: exact); an overflow stays
        inf or NaN for the check that follows."""
        inv = 1.0 / scale
        for p in self.parameters():
            if p.grad is not None:
                local_tensor(p.grad).mul_(inv)

    def local_stats(self, norm: bool, check: bool, skip_tied: bool,
                    device: torch.device) -> Tensor:
        """[this rank's share of the squared global norm (0 unless ``norm``), 1.0 if it holds
        an inf or NaN gradient (0 unless ``check``)], float64 on ``device``, to be summed over
        every rank. ``skip_tied``: the tied copy is counted on the first stage. A shard counts
        on its own rank, a whole parameter of a tensor-parallel replica on its TP rank 0."""
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        grads = [local_tensor(p.grad.detach()) for p in self.parameters() if p.grad is not None]
        if norm:
            tied = {id(p) for p in self.tied} if skip_tied else set()
            for p in self.parameters():
                if p.grad is None or id(p) in tied or (self.tp_rank and not is_sharded(p)):
                    continue
                stats[0] += local_tensor(p.grad.detach()).double().pow(2).sum()
        if check and grads:  # one device-side flag, no host sync per gradient
            stats[1] = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).double()
        return stats

    def clip(self, norm: float, max_norm: float) -> None:
        coef = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)


class GradBuckets:
    """One stage's replica all-reduce in buckets, launched in bucket order as the iteration's
    last backward makes their gradients final (DDP's reducer, without its gradient views)."""

    def __init__(self, params: list[torch.nn.Parameter], pg: Any, bucket_bytes: int,
                 overlap: bool) -> None:
        self.ids = [id(p) for p in params]
        # reverse parameter order is roughly the order the backward finishes them
        self.buckets: list[list[torch.nn.Parameter]] = []
        cur, size = [], 0
        for p in reversed(params):
            cur.append(p)
            size += local_tensor(p).numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._flats = [flat_buffer([local_tensor(p) for p in b]) for b in self.buckets]
        self.pg = pg
        self.armed = False
        self._reset()
        self._times: tuple[list[float], float] = ([], 0.0)
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad)
                       for p in params] if overlap else []
        self.overlap = overlap

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _reset(self) -> None:
        self._started = False
        self._armed: set[int] = set()
        self._missing = [len(b) for b in self.buckets]
        self._seen: set[int] = set()
        self._next = 0
        self._works: list[tuple[int, Tensor, Any]] = []
        self._launched: list[float] = []
        self._backward_end = None

    def arm(self, ids: set[int] | None = None) -> None:
        """Count the gradients of the backward that starts now (the last of the parameters of
        ``ids``; None: of every parameter); the first arm of an iteration starts its count."""
        if not self._started:
            self._reset()
            self._started = True
        self._armed = set(self.ids) if ids is None else ids
        self.armed = True

    def backward_done(self) -> None:
        self.armed = False
        self._armed = set()
        self._backward_end = time.perf_counter()

    def on_grad(self, p: torch.nn.Parameter) -> None:
        """A gradient of ``p`` was accumulated (its hook; or :meth:`GradSync.accumulated`)."""
        # fires once per backward for each parameter whose gradient it accumulated
        if not self.armed or not self.overlap or id(p) not in self._armed \
                or id(p) not in self._bucket_of:  # a tied or frozen one: in no bucket
            return
        i = self._bucket_of[id(p)]
        if id(p) in self._seen:
            if i < self._next:  # its bucket is already on the wire without this gradient
                raise RuntimeError("a parameter received a second gradient in one backward "
                                   "after its bucket was all-reduced; set "
                                   "RuntimeConfig(overlap_grad_sync=False)")
            return
        self._seen.add(id(p))
        self._missing[i] -= 1
        # buckets go in order on every replica: collectives must match across the group
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, i: int) -> None:
        flat = pack([local_tensor(p.grad) for p in self.buckets[i]], self._flats[i])
        self._works.append((i, flat, dist.all_reduce(flat, group=self.pg, async_op=True)))
        self._launched.append(time.perf_counter())
        self._next = i + 1

    def launch_rest(self) -> None:
        """Launch what the backward left (every bucket when nothing was armed); every
        gradient must exist by now."""
        self.armed = False
        if self._backward_end is None:  # no armed backward ran: nothing was launched yet
            self._reset()
            self._backward_end = time.perf_counter()
        while self._next < len(self.buckets):
            self._launch(self._next)

    def wait(self) -> None:
        """Wait for every bucket and write the sums back into the gradients."""
        works, self._works = self._works, []
        for i, flat, work in works:
            work.wait()
            unpack(flat, [local_tensor(p.grad) for p in self.buckets[i]])
        self._times = (self._launched, self._backward_end or 0.0)
        self._reset()

    def launch_s(self) -> list[float]:
        launched, end = self._times
        return [t - end for t in launched]


def flat_buffer(tensors: list[Tensor]) -> Tensor | None:
    """The buffer a bucket of ``tensors`` (parameters or their gradients) keeps for its
    gradients: on a CPU, one flat tensor kept across iterations; elsewhere None (a fresh one
    each time, from the caching allocator). See the module docstring."""
    if not tensors or tensors[0].device.type != "cpu":
        return None
    return torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)


def pack(grads: list[Tensor], flat: Tensor | None) -> Tensor:
    """``grads`` in one flat tensor (``flat`` when given)."""
    parts = [g.reshape(-1) for g in grads]
    return torch.cat(parts) if flat is None else torch.cat(parts, out=flat)


def unpack(flat: Tensor, grads: list[Tensor]) -> None:
    """Copy the flat sums back into ``grads``."""
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def all_reduce_flat(grads: list[Tensor], pg: Any, flat: Tensor | None = None) -> None:
    """One all-reduce (SUM) over the concatenation of ``grads`` instead of one per tensor,
    packed into ``flat`` when given (a :func:`flat_buffer`): a bucket of :class:`GradBuckets`,
    synchronously, as the profiler times it."""
    if not grads:
        return
    buf = pack(grads, flat)
    dist.all_reduce(buf, group=pg)
    unpack(buf, grads)
