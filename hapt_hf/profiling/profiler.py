"""Zero-redundant profiler: measure one layer of each distinct shape, once per device type.

Every block of a model has the same shape, so only ONE block is timed, with the embedding and
the head, for each micro-batch size the search will try: forward and backward time (median of
repeated windows, CUDA events on GPUs, wall clock on CPUs), the optimizer step of the layer's
parameters, and the memory one micro-batch keeps: the bytes autograd saves for its backward
(saved-tensor hooks, ``kept_bytes``, what the planner's memory model predicts) and, on a GPU,
the allocator's peak. Layers run as the job will: fp32 weights, the job's compute dtype under
autocast, and the job's attention implementation. Between groups, point-to-point
transfers of a few sizes are timed and fitted as ``latency + bytes / bandwidth``.

Tensor parallelism is measured in its two parts: a block's compute split ``t`` ways (one
rank's shard of the projections the model's plan shards, :mod:`~hapt_hf.profiling.tp_split`),
timed like any layer on the device at hand, and the all-reduce of a block's activation among
``t`` ranks of a group (:func:`~hapt_hf.profiling.links.measure_tp_allreduce`), which needs the
group's ``t`` devices (:func:`profile_group_leaders`).

Results live in a readable JSON profile store (:mod:`hapt_hf.profiling.store`) keyed by (device
name, layer signature, micro-batch, sequence length, dtype, tensor-parallel degree); a second
profile of the same thing reads the store.

The layers are built with :func:`hapt_hf.pipeline.stage.build_stage`, so the profiler times
exactly the modules the runtime runs. torch is imported inside the functions that measure, so
that ``hapt-hf profile --help`` answers at once.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from hapt_hf.core.defaults import GRAD_BUCKET_BYTES
from hapt_hf.core.layers import BLOCK, body_part, num_layers
from hapt_hf.core.precision import STATE_BYTES_PER_PARAM, canonical_dtype
from hapt_hf.planner.model_spec import LayerSpec, ModelReader, ModelSpec
from hapt_hf.planner.profile import LayerTiming, LinkMeasurement, Profile, ProfileKey

from .links import activation_sizes, measure_link, time_inside_groups, time_tp_inside_groups
from .model_figures import choose_attention
from .overheads import measure_step_overheads, pool_overheads
from .store import ProfilerOptions, ProfileStore
from .tp_split import split_block, tp_degrees

__all__ = ["profile_model", "time_layer", "profile_group_leaders", "LayerMemory", "layer_memory",
           "build_layer", "layer_run", "pool_timings"]


# -- timing one layer ------------------------------------------------------------------------

@dataclass(frozen=True)
class _LayerRun:
    """What to run for one layer: a built stage and a micro-batch's inputs."""

    stage: object
    inputs: tuple
    out_grad: object | None
    """Gradient fed to a non-scalar output's backward (None: the output is the loss)."""
    dtype: str = "fp32"
    """Compute dtype: 16 bits run under autocast over the fp32 weights."""

    def forward(self):
        from .memory import compute_context
        with compute_context(self.dtype, self.inputs[0].device):
            return self.stage(self.inputs[0], **self.inputs[1])


class _Clock:
    """Elapsed seconds of a region: CUDA events on a GPU (kernels are asynchronous), else wall."""

    def __init__(self, device) -> None:
        import torch
        self.cuda = torch.device(device).type == "cuda"
        self.torch = torch

    def measure(self, fn: Callable[[], object]) -> tuple[float, object]:
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out


def time_layer(run: _LayerRun, options: ProfilerOptions, device: str) -> LayerTiming:
    """Median forward/backward seconds of one micro-batch through ``run.stage``, and the
    activation bytes it keeps (``update_s`` is left 0: it does not depend on the micro-batch)."""
    clock = _Clock(device)

    def one_pass() -> tuple[float, float]:
        tf, out = clock.measure(run.forward)
        tb, _ = clock.measure(lambda: out.backward(run.out_grad))
        return tf, tb

    t0 = time.perf_counter()
    memory, kept = _activation_bytes(run, device)  # the first warm-up pass
    first = time.perf_counter() - t0
    for _ in range(options.warmup - 1):
        first = sum(one_pass())
    per_window = max(1, math.ceil(options.min_window_s / max(first, 1e-6)))
    # a layer of seconds per pass (an LM head on CPU) gets fewer windows, never under 3
    repeats = max(min(3, options.repeats),
                  min(options.repeats, int(options.budget_s / (first * per_window))))
    fwd, bwd = [], []
    for _ in range(repeats):
        passes = [one_pass() for _ in range(per_window)]
        fwd.append(sum(p[0] for p in passes) / per_window)
        bwd.append(sum(p[1] for p in passes) / per_window)
    totals = sorted(f + b for f, b in zip(fwd, bwd))
    return LayerTiming(forward_s=statistics.median(fwd), backward_s=statistics.median(bwd),
                       peak_memory_bytes=memory, spread=_spread(totals), kept_bytes=kept)


def _spread(sorted_values: list[float]) -> float:
    if len(sorted_values) < 2:
        return 0.0
    q = statistics.quantiles(sorted_values, n=4, method="inclusive")
    return (q[2] - q[0]) / statistics.median(sorted_values)


UPDATE_WORKING_SET_BYTES = 256 * 2**20
"""The optimizer step is timed over at least this many bytes of weights, gradients and Adam
state (copies of the layer's parameters), and divided back to one layer. The step is
memory-bound: one layer's state alone sits in the cache (a 32 MiB L3 of the CPU in
docs/benchmarks.md, an H100's 50 MiB L2) and stepped up to 1.8x faster there than a stage's many layers
streaming from memory did. 256 MiB is what ``triton.testing.do_bench`` writes to flush a GPU's
cache."""


def _update_s(stage, clock: _Clock) -> float:
    """Adam step over the layer's parameters (their gradients exist after the passes), timed
    on :data:`UPDATE_WORKING_SET_BYTES` of copies so that it streams from memory as a stage's
    step does."""
    import torch
    params = [p for p in stage.parameters() if p.grad is not None]
    if not params:
        return 0.0
    per_copy = sum(p.numel() for p in params) * STATE_BYTES_PER_PARAM
    copies = max(1, math.ceil(UPDATE_WORKING_SET_BYTES / per_copy))
    work = params  # a layer this large streams from memory as it is
    if copies > 1:
        work = [torch.nn.Parameter(p.detach().clone()) for _ in range(copies) for p in params]
        for w, p in zip(work, params * copies):
            w.grad = p.grad.detach().clone()
    opt = torch.optim.AdamW(work, lr=1e-6)
    opt.step()  # creates the state: the first step is not what training repeats
    times = [clock.measure(opt.step)[0] for _ in range(3)]
    for p in params:
        p.grad = None
    return statistics.median(times) / copies


def _activation_bytes(run: _LayerRun, device: str) -> tuple[float, float]:
    """(peak, kept): memory one micro-batch's forward holds until its backward, weights
    excluded. kept: the tensors autograd saves (:func:`~.memory.saved_tensor_bytes`). peak:
    on a GPU the allocator's peak over forward + backward above what was allocated before; on
    a CPU the saved tensors plus the output."""
    import torch

    from .memory import saved_tensor_bytes
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    kept, out = saved_tensor_bytes(run.stage, run.forward)
    out.backward(run.out_grad)
    if cuda:
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base), kept
    return kept + out.untyped_storage().nbytes(), kept


# -- which layers, built how -----------------------------------------------------------------

def _representatives(spec: ModelSpec) -> list[LayerSpec]:
    """The first layer of each distinct signature: all others copy its figures."""
    seen: dict[str, LayerSpec] = {}
    for layer in spec.layers:
        seen.setdefault(layer.signature, layer)
    return list(seen.values())


def build_layer(config, layer: LayerSpec, device: str, options: ProfilerOptions,
                layer_unit: str = BLOCK):
    """The one-layer stage the runtime would run for ``layer`` (an entry of the sequence in
    ``layer_unit``: a block half for 'half'), from a model cut short, with fp32 weights (16-bit
    compute is autocast's, as in the runtime): seed 0's weights, the caller's RNG left as it was."""
    import torch  # inside: see the module docstring
    from hapt_hf.pipeline.stage import build_stage

    # Build a model of as few blocks as reach this layer, not the whole model.
    nblocks = body_part(layer.index, layer_unit).index + 1 if layer.kind == "block" else 1
    small = copy.deepcopy(config)
    small.num_hidden_layers = nblocks
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:nblocks]
    last = num_layers(nblocks, layer_unit) - 1
    index = {"embedding": 0, "block": layer.index, "head": last}[layer.kind]
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)  # not torch.manual_seed: it seeds CUDA's too
        stage = build_stage(small, (index, index + 1), seed=None, device=device,
                            attn_implementation=options.attn_implementation, layer_unit=layer_unit)
    return stage.train()


def layer_run(stage, config, kind: str, micro_batch: int, seq_len: int, dtype: str,
               device: str) -> _LayerRun:
    """One micro-batch's inputs for a layer of ``kind`` (fixed seed: same data every time);
    the residual stream between layers is fp32 whatever the compute dtype."""
    import torch
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=gen)
    hidden = torch.randn(micro_batch, seq_len, config.hidden_size, generator=gen)
    if kind == "embedding":
        return _LayerRun(stage, (ids.to(device), {}), hidden.to(device), dtype)
    x = hidden.to(device).requires_grad_(True)  # a pipeline stage also sends dX back
    if kind == "head":
        return _LayerRun(stage, (x, {"labels": ids.to(device)}), None, dtype)
    return _LayerRun(stage, (x, {}), torch.randn(x.shape, generator=gen).to(device), dtype)


def with_attention(options: ProfilerOptions, config) -> ProfilerOptions:
    """``options`` with the attention it leaves open (None) set to the model's best."""
    if options.attn_implementation is not None:
        return options
    return replace(options, attn_implementation=choose_attention(config)[0])


def profile_model(config, *, device_name: str, seq_len: int, dtype: str = "fp32",
                  options: ProfilerOptions = ProfilerOptions(), store: ProfileStore | None = None,
                  device: str = "cpu", log: Callable[[str], None] | None = None,
                  save: bool = True, reader: ModelReader | None = None) -> Profile:
    """Time each distinct layer of ``config`` for every micro-batch size; reuse stored entries.

    Returns a Profile of exactly the entries this model needs on ``device_name``; the store (if
    given) gains what was measured and is saved (unless ``save`` is False). The layers are
    those of ``ModelSpec.from_config(config, ..., reader=reader)``: the hand formula's for
    None, every accepted type's with the measuring reader (``hapt-hf profile`` passes it).
    A block is also timed split at each degree of ``options.tp_degrees`` the model allows
    (:func:`~.tp_split.split_block`: one tensor-parallel rank's shard, its all-reduces not
    included), keyed by the whole block's key with ``tp`` set; the log says why a degree the
    model refuses is left out.
    """
    options = with_attention(options, config)
    spec = ModelSpec.from_config(config, seq_len, dtype,
                                 attn_implementation=options.attn_implementation, reader=reader)
    degrees, dropped = tp_degrees(config, options.tp_degrees) if options.tp_degrees else ((), [])
    for why in dropped:
        if log:
            log(f"{device_name} tensor-parallel split not timed: {why}")
    timings: dict[ProfileKey, LayerTiming] = {}
    for layer in _representatives(spec):
        for t in (1, *degrees) if layer.kind == "block" else (1,):
            stage, update_s = None, 0.0
            for mb in options.micro_batches:
                key = ProfileKey(device_name, layer.signature, mb, seq_len, spec.dtype, t)
                hit = store.get(key) if store is not None else None
                if hit is None:
                    if stage is None:
                        stage = split_block(build_layer(config, layer, device, options), config,
                                            t)
                    run = layer_run(stage, config, layer.kind, mb, seq_len, spec.dtype, device)
                    hit = time_layer(run, options, device)
                    if not update_s:  # the optimizer step does not depend on the micro-batch
                        update_s = _update_s(stage, _Clock(device))
                    hit = replace(hit, update_s=update_s)
                    if store is not None:
                        store.put(key, hit)
                    if log:
                        log(_entry_line(layer.kind, key, hit, timings.get(replace(key, tp=1))))
                timings[key] = hit
    overheads = {}
    if options.step_overheads:
        overheads[device_name] = _step_overheads(config, spec, device_name, device, options,
                                                 store, log)
    if store is not None and save:
        store.save()
    return Profile(timings=timings, links=store.all_links() if store else [],
                   source=str(store.path) if store else "", overheads=overheads)


def _step_overheads(config, spec: ModelSpec, device_name: str, device: str,
                    options: ProfilerOptions, store: ProfileStore | None,
                    log: Callable[[str], None] | None):
    """The device's step overheads, from the store or measured on a stage of blocks."""
    hit = store.overheads.get(device_name) if store is not None else None
    if hit is not None:
        return hit
    got = measure_step_overheads(config, options.micro_batches, spec.seq_len, spec.dtype,
                                 device, options.attn_implementation)
    if store is not None:
        store.overheads[device_name] = got
    if log:
        log(f"{device_name} step overheads: {got.action_s * 1e3:.2f} ms per action; split "
            f"backward I {got.input_grad_ratio:.2f} + W {got.weight_grad_ratio:.2f} of B")
    return got


def _entry_line(kind: str, key: ProfileKey, hit: LayerTiming, whole: LayerTiming | None) -> str:
    """The log line of one measured entry; a split block's gives the whole block's time over
    its own (``t`` for an even split)."""
    name = f"{kind}/tp{key.tp}" if key.tp > 1 else kind
    line = (f"{key.device} {name:9s} mb={key.micro_batch}: fwd {hit.forward_s * 1e3:.2f} ms"
            f" bwd {hit.backward_s * 1e3:.2f} ms spread {hit.spread:.2f}")
    if key.tp > 1 and whole is not None and hit.forward_s + hit.backward_s > 0:
        ratio = (whole.forward_s + whole.backward_s) / (hit.forward_s + hit.backward_s)
        line += f" (whole / split {ratio:.2f}, {key.tp} for an even split)"
    return line


# -- the memory model against autograd ------------------------------------------------------

@dataclass(frozen=True)
class LayerMemory:
    """One layer of a model: what the planner budgets per micro-batch and what autograd keeps."""

    kind: str
    """'embedding' | 'block' | 'head'."""
    planned_bytes: float
    """``act_keep_bytes * micro_batch + act_keep_fixed_bytes`` of the planner's LayerSpec."""
    measured_bytes: float
    """Bytes autograd saved for the backward of the same layer as the runtime builds it."""

    @property
    def ratio(self) -> float:
        return self.planned_bytes / self.measured_bytes


def layer_memory(config, seq_len: int, dtype: str = "fp32",
                 attn_implementation: str | None = None,
                 micro_batch: int = 1, device: str = "cpu") -> list[LayerMemory]:
    """The planner's kept bytes (the hand formula's) beside autograd's, for each distinct layer
    of ``config``; ``attn_implementation`` None: the model's best."""
    from .memory import saved_tensor_bytes
    from .model_figures import choose_attention
    attn, _ = choose_attention(config, attn_implementation)
    spec = ModelSpec.from_config(config, seq_len, dtype, attn_implementation=attn)
    options = ProfilerOptions(attn_implementation=attn)
    out = []
    for layer in _representatives(spec):
        stage = build_layer(config, layer, device, options)
        run = layer_run(stage, config, layer.kind, micro_batch, seq_len, spec.dtype, device)
        measured, _ = saved_tensor_bytes(stage, run.forward)
        planned = layer.act_keep_bytes * micro_batch + layer.act_keep_fixed_bytes
        out.append(LayerMemory(layer.kind, planned, measured))
    return out


# -- the group leaders, together ---------------------------------------------------------

def pool_timings(measured: list[dict[ProfileKey, LayerTiming]]) -> dict[ProfileKey, LayerTiming]:
    """Every key any rank measured, with the median over the ranks that measured it of the
    forward, backward and optimizer-step times; the memory figures and the spread are the
    first such rank's (a group's leader, where ranks are in order)."""
    by_key: dict[ProfileKey, list[LayerTiming]] = {}
    for timings in measured:
        for k, t in timings.items():
            by_key.setdefault(k, []).append(t)
    return {k: replace(ts[0], forward_s=statistics.median(t.forward_s for t in ts),
                       backward_s=statistics.median(t.backward_s for t in ts),
                       update_s=statistics.median(t.update_s for t in ts))
            for k, ts in by_key.items()}


def _keep_busy_until_all_done(config, seq_len: int, dtype: str, micro_batch: int,
                              options: ProfilerOptions) -> list[tuple[float, float]]:
    """Run forward and backward of one block until every rank has finished its profile, and
    time it as :func:`time_layer` times a layer: windows of at least ``options.min_window_s``,
    each its passes' mean (forward, backward) seconds. Returns the windows.

    A slower group's leader takes longer to profile; if the ranks done first went idle, it
    would finish on a machine less loaded than in training and look faster than it is.
    """
    import torch
    import torch.distributed as dist
    everyone_done = dist.all_reduce(torch.ones(1), async_op=True)
    spec = ModelSpec.from_config(config, seq_len, dtype,
                                 attn_implementation=options.attn_implementation)
    block = next(l for l in _representatives(spec) if l.kind == "block")
    run = layer_run(build_layer(config, block, "cpu", options), config,
                    block.kind, micro_batch, seq_len, spec.dtype, "cpu")
    windows: list[tuple[float, float]] = []
    f = b = 0.0
    passes, started = 0, time.perf_counter()
    while not everyone_done.is_completed():
        t0 = time.perf_counter()
        out = run.forward()
        t1 = time.perf_counter()
        out.backward(run.out_grad)
        f, b, passes = f + t1 - t0, b + time.perf_counter() - t1, passes + 1
        if time.perf_counter() - started >= options.min_window_s:
            windows.append((f / passes, b / passes))
            f = b = 0.0
            passes, started = 0, time.perf_counter()
    everyone_done.wait()
    return windows[1:]  # the first pass warms the block up: its window is not counted


def over_the_profile(timings: dict[ProfileKey, LayerTiming], device: str, block_key: ProfileKey,
                     windows: list[tuple[float, float]], profiled_s: float, ranks: int = 1
                     ) -> dict[ProfileKey, LayerTiming]:
    """``device``'s timings scaled to its speed over the whole profile, not only its own part.

    A group done first with its profile keeps timing its block while the slowest group
    finishes (:func:`_keep_busy_until_all_done`), which on a machine whose speed moves
    (cores and caches shared with other jobs) samples the device over tens of seconds where
    its own profile saw a few per layer. Over the ``profiled_s`` seconds of its own profile
    the block took ``block_key``'s forward + backward; over the windows' seconds (those of
    ``ranks`` ranks together: each rank's share), their median. Every entry of ``device``
    (forward, backward, the optimizer step) is multiplied by the time-weighted mean of the
    two speeds over the block's profiled one: the same load slows every layer of a device
    alike. Unchanged without windows or a block entry."""
    block = timings.get(block_key)
    if not windows or block is None or profiled_s <= 0:
        return timings
    profiled = block.forward_s + block.backward_s
    busy = statistics.median(f + b for f, b in windows)
    busy_s = sum(f + b for f, b in windows) / ranks  # one rank's span: its passes
    if profiled <= 0 or busy <= 0:
        return timings
    factor = (profiled_s + busy_s * busy / profiled) / (profiled_s + busy_s)
    return {k: (replace(t, forward_s=t.forward_s * factor, backward_s=t.backward_s * factor,
                        update_s=t.update_s * factor) if k.device == device else t)
            for k, t in timings.items()}


def _fold_busy_windows(timings: dict[ProfileKey, LayerTiming], busy: list, config,
                       seq_len: int, dtype: str, micro_batch: int, options: ProfilerOptions,
                       log: Callable[[str], None] | None = None
                       ) -> dict[ProfileKey, LayerTiming]:
    """Each device's timings over the whole profile (:func:`over_the_profile`), from the
    windows every rank of that device timed after its own profile (``busy``: per rank, its
    device name, its windows and the seconds its own profile took)."""
    spec = ModelSpec.from_config(config, seq_len, dtype,
                                 attn_implementation=options.attn_implementation)
    block = next(l for l in _representatives(spec) if l.kind == "block")
    for device in sorted({d for d, _, _ in busy if d is not None}):
        mine = [(w, s) for d, w, s in busy if d == device]
        windows = [x for w, _ in mine for x in w]
        key = ProfileKey(device, block.signature, micro_batch, seq_len, spec.dtype)
        before = timings.get(key)
        timings = over_the_profile(timings, device, key, windows,
                                   statistics.median(s for _, s in mine), len(mine))
        if log and before is not None and windows:
            after = timings[key]
            log(f"{device}: block f+b {(before.forward_s + before.backward_s) * 1e3:.2f} ms in "
                f"its profile, {statistics.median(f + b for f, b in windows) * 1e3:.2f} ms "
                f"over {len(windows)} windows after it; priced "
                f"{(after.forward_s + after.backward_s) * 1e3:.2f} ms")
    return timings


def profile_group_leaders(config, *, groups: dict[str, list[int]], device_names: dict[str, str],
                          seq_len: int, dtype: str = "fp32",
                          options: ProfilerOptions = ProfilerOptions(),
                          store_path: str | Path | None = None,
                          link_sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22),
                          busy_peers: bool = False,
                          allreduce_sizes: tuple[int, ...] = (1 << 20, 1 << 23, GRAD_BUCKET_BYTES),
                          log: Callable[[str], None] | None = None) -> Profile:
    """Collective over an initialised process group: the first rank of each group profiles its
    device type (all groups at once, each under its own conditions), then the leaders time
    every pair of groups' link. Every rank returns the merged Profile; rank 0 saves the store.

    ``groups``: group name -> global ranks; ``device_names``: group name -> device type name.
    ``busy_peers``: the other ranks run the same profile too, and every rank keeps computing
    until the last one is done. Only for ranks that share cores (CPU processes on one machine):
    the leaders are then timed under the load training puts on the machine, not on a machine
    left idle by their peers. Every rank of a group having measured the same layers, each
    entry's times are the median over them (:func:`pool_timings`): two fast ranks of the race
    measured the same block's backward 23 and 29 ms in one profile.
    With ``busy_peers``, the ranks done first keep timing a block until the last is done, and
    each device's figures are scaled to its speed over the whole profile
    (:func:`over_the_profile`; ``log`` gets one line a device on rank 0).
    ``allreduce_sizes``: each group of two or more ranks times an all-reduce of these sizes
    among its ranks (:func:`~hapt_hf.profiling.links.measure_group_allreduce`), recorded as
    the link from the group to itself (the link its stages' gradients are all-reduced on);
    empty: not timed.
    ``options.tp_degrees``: each leader also times the block's compute split at the degrees its
    group's ranks can hold and the model allows (as :func:`profile_model` does), and each group's
    first ``t`` ranks time the tensor-parallel all-reduce of a block's activation among them
    (:func:`~hapt_hf.profiling.links.measure_tp_allreduce`), recorded per (group, ``t``).
    """
    import torch.distributed as dist

    from hapt_hf.pipeline import exit_guard
    options = with_attention(options, config)
    exit_guard.install()  # its collectives end cleanly whenever the caller's process ends
    rank = dist.get_rank()
    leaders = {g: ranks[0] for g, ranks in groups.items()}
    store = ProfileStore.open(store_path) if store_path else None
    mine = Profile()
    started = time.perf_counter()
    for g, leader in leaders.items():
        # one leader per device type: a second group of the same type would only repeat it
        first_of_type = list(device_names.values()).index(device_names[g]) == \
            list(device_names).index(g)
        held = replace(options, tp_degrees=tuple(t for t in options.tp_degrees
                                                 if t <= len(groups[g])))
        if rank == leader and first_of_type:
            cache = ProfileStore(Path(store_path), dict(store.timings)) if store else None
            mine = profile_model(config, device_name=device_names[g], seq_len=seq_len,
                                 dtype=dtype, options=held, store=cache, save=False)
        elif busy_peers and rank in groups[g]:
            mine = profile_model(config, device_name=device_names[g], seq_len=seq_len,
                                 dtype=dtype, options=held)
    profiled_s = time.perf_counter() - started
    windows: list[tuple[float, float]] = []
    if busy_peers:
        windows = _keep_busy_until_all_done(config, seq_len, dtype, min(options.micro_batches),
                                            options)
    dist.barrier()
    links = []
    names = list(leaders)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if rank in (leaders[a], leaders[b]):
                sender = rank == leaders[a]
                links.append(measure_link(leaders[b] if sender else leaders[a], sender, a, b,
                                          link_sizes))
            dist.barrier()
    if allreduce_sizes:
        links += time_inside_groups(groups, rank, allreduce_sizes)
    tp_links = _time_tp_allreduces(config, groups, rank, seq_len, dtype, options)
    gathered: list = [None] * dist.get_world_size()
    my_device = next((device_names[g] for g, ranks in groups.items() if rank in ranks), None)
    dist.all_gather_object(gathered, (mine.timings, [m for m in links if rank == leaders[m.a]],
                                      tp_links, mine.overheads,
                                      (my_device, windows, profiled_s)))
    merged = ProfileStore(Path(store_path or ""))
    merged.timings.update(_fold_busy_windows(pool_timings([g[0] for g in gathered]),
                                             [g[4] for g in gathered], config, seq_len, dtype,
                                             min(options.micro_batches), options,
                                             log if rank == 0 else None))
    merged.overheads.update(pool_overheads([g[3] for g in gathered]))
    for _, measured, tp_measured, _, _ in gathered:
        for m in (*measured, *tp_measured):
            merged.put_link(m)
    if rank == 0 and store is not None:
        store.merge(merged)
        store.save()
    profile = merged.to_profile()
    profile.source = str(store_path or "")
    return profile


def _time_tp_allreduces(config, groups: dict[str, list[int]], rank: int, seq_len: int,
                        dtype: str, options: ProfilerOptions) -> list[LinkMeasurement]:
    """Collective: the tensor-parallel all-reduce of each group at the degrees of
    ``options.tp_degrees`` the model allows, on a block activation's sizes."""
    if not options.tp_degrees:
        return []
    degrees, _ = tp_degrees(config, options.tp_degrees)
    if not degrees:
        return []
    dtype = canonical_dtype(dtype)
    sizes = activation_sizes(config.hidden_size, seq_len, dtype, options.micro_batches)
    return time_tp_inside_groups(groups, rank, degrees, sizes, dtype)
