"""The end-to-end race on the emulated heterogeneous testbed, every contender in one run.

Four CPU ranks: two "fast" and two "slow" ones (a compute slow-down, 2.5x by default, every rank
capped at the same CPU share) with a slow link between the two groups (benchmarks/testbed).
Inside the same processes, iterations of the contenders alternate, so that a busy phase of the
machine hits them alike:

  (a) hapt_hf: profile (one block per group, the link), plan with ``plan_job`` as a user would
      (the planner may leave a group idle and chooses the schedule kind), run the plan it
      returns;
  (b) torch.distributed.pipelining Schedule1F1B over the uniform split;
  (c) hapt_hf's plan (same split, same groups) with plain 1F1B warm-ups;
  (d) the uniform split on hapt_hf's runtime (1F1B);
  (e) DDP of the whole model on the same four ranks, every rank the same share of the batch
      (what ``accelerate launch`` runs);
  (f) torch's ScheduleInterleaved1F1B over the uniform split into 2 chunks per rank;
  (g) torch's ScheduleInterleavedZeroBubble over the same chunks;
  (h) the planner's best plan on every group, raced where its choice (a) leaves a group idle;
  (i), (j), (k), only where named in ``--contenders``: (a) again with the idle group's ranks
      asleep, spinning or burning (``RaceConfig.idle_load`` is what (a) itself runs beside).

(f) and (g) run where the model has at least 2 blocks per rank. Where the planner leaves a
group idle, (a) and (c) run on the kept groups' ranks alone: each kept rank starts one child
process, in its own cgroup, namespace and slow-down, and the children form a process group of
their own (the plan's world, as a user would launch it); the idle ranks sleep until the barrier
that ends the step, as every contender's step ends (``--idle-load`` sets what they run instead).

The planner is not told the testbed's settings: it sees groups of equal nominal speed and a
nominal link, and learns both through the profiler. Every contender runs a full training step
(forward, backward, AdamW); the embeddings are untied because torch's schedules do not sum tied
gradients across stages.

    python3 benchmarks/e2e.py --quick            # 4-7 minutes; JSON on the last line
    python3 benchmarks/e2e.py --quick --slowdown 4 --link-mbps 8 --link-latency-ms 40
    python3 benchmarks/e2e.py --plot docs/e2e_throughput.png
    python3 benchmarks/e2e.py --quick --unshaped # the link left at the machine's speed
    python3 benchmarks/e2e.py --quick --contenders bc --slowdown 3 --link-mbps 32 \
        --link-latency-ms 10                     # (a), (b), (c) only: 1-3 minutes

The last line is JSON with speedup_vs_torch_1f1b_uniform ((a)/(b)), speedup_vs_torch_best
((a) over the fastest of (b), (f), (g)), speedup_vs_plain_1f1b ((a)/(c)),
speedup_vs_all_groups ((a)/(h), where (h) ran), speedup_vs_ddp_equal_share ((e)/(a), where (e)
ran) and prediction_error (|predicted - measured| / measured for (a)); every contender's median
under ``contenders``; under ``predictions`` each raced plan of hapt_hf's ((a), (c), (h)) with
the cost model's iteration time beside its median; the profile's ``step_overheads``; under
``cores``, the share of each core busy during the profile and each contender's timed steps.

``--unshaped`` leaves the link between the groups at the machine's own speed (the compute gap
stays): a model that fits every rank and a fast link, where data parallelism with shares by
speed is the plan to find. The planner may then choose the micro-batch size, and (e) runs in
every repetition.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hapt_hf.core.schedules import ScheduleKind, default_warmups  # noqa: E402

CONTENDERS = {"a": "hapt_hf's chosen plan", "b": "torch Schedule1F1B, uniform",
              "c": "hapt_hf plan + 1F1B", "d": "uniform on hapt_hf runtime", "e": "DDP",
              "f": "torch Interleaved1F1B, uniform x2", "g": "torch InterleavedZB, uniform x2",
              "h": "hapt_hf plan on every group", "i": "(a), idle ranks asleep",
              "j": "(a), idle ranks spinning", "k": "(a), idle ranks burning"}
IDLE_VARIANTS = {"i": "rest", "j": "spin", "k": "burn"}
"""(a) again with the idle group's ranks on each idle load, raced beside it (only where asked
for and (a) leaves a group idle): the same plan and profile, so that what the idle ranks run
is the only difference."""
TORCH = ("b", "f", "g")
"""torch's schedules among the contenders."""
TORCH_INTERLEAVED = {"f": "ScheduleInterleaved1F1B", "g": "ScheduleInterleavedZeroBubble"}
VIRTUAL = 2
"""Chunks per rank of torch's interleaved contenders."""


@dataclass(frozen=True)
class RaceConfig:
    blocks: int = 8
    hidden: int = 256
    heads: int = 4
    seq: int = 64
    vocab: int = 2048
    global_batch: int = 8
    micro_batch: int = 1
    reps: int = 7
    warmup_reps: int = 3
    """Repetitions of every contender not counted. Traced rank by rank, the first three run
    slower than the rest (1.5, 0.8, 0.6 s, then 0.49-0.58 s for the same plan): every
    contender's optimizer state and buffers are made and their memory faulted in, and five
    contenders' models share each rank's caches."""
    ddp_reps: int = 3
    ddp_max_s: float = 30.0
    """(e) is skipped when its gradient all-reduce alone, over the measured link, would take
    longer than this per step (the result says so and gives the estimate)."""
    fast_ranks: int = 2
    slow_ranks: int = 2
    slowdown: float = 2.5
    link_mbps: float = 16.0
    link_latency_ms: float = 60.0
    """With these, one micro-batch's activation (64 KiB) needs 33 ms + 60 ms to cross: about a
    balanced stage's forward+backward, the situation H-1F1B is for. A link much slower than
    every stage's compute (4 Mbit/s: 131 ms + latency) makes every schedule wait on the link
    alike; docs/benchmarks.md reports that case too."""
    slowdown_mechanism: str = "hook"
    """'hook' (default: a delay relative to the rank's own speed, so the 2.5x gap holds on a
    machine others share) or 'cgroup' (CPU quota: faithful only on an otherwise idle machine)."""
    cpu_per_rank: float = 0.45
    """Cores of CPU quota for a fast rank under 'cgroup' (slow ranks get this / slowdown)."""
    cpu_cap: float | None = 0.45
    """Under 'hook': every rank's equal CPU quota (cores), so that a rank's speed does not
    depend on how many of its peers are busy (see TestbedSpec.cpu_cap); 4 x 0.45 cores leaves
    this 2-core machine some room. ``--cpu-cap 0`` turns it off."""
    profile_budget_s: float = 2.0
    """Timed seconds the profiler aims at per layer and size. 2.0 (was 1.0): in five interleaved
    pairs of unshaped races the prediction error's median was 0.022 against 0.060; ten runs at
    2.0 all came within 0.15 (median 0.050); the profile took 29-40 s against 30-33 s
    (docs/benchmarks.md)."""
    busy_profile: bool = True
    """Every rank profiles while the group leaders are timed: CPU ranks share two cores, so a
    leader timed next to idle peers would look faster than it is during training."""
    trace_dir: str = ""
    """Where set, (a) is traced action by action on every rank that runs it, and the profile
    and the plan are saved beside the traces (``benchmarks/race_trace.py`` reads them)."""
    unshaped: bool = False
    """Leave the link between the groups unshaped (loopback speed); the compute gap stays."""
    pin_cpus: bool = True
    """Pin every capped rank to one core (see TestbedSpec.pin_cpus)."""
    contenders: str = "abcdefgh"
    """Which contenders race (letters of :data:`CONTENDERS`; (a) always): ``--contenders ab``
    races hapt_hf's plan against torch's Schedule1F1B alone, in a third of the time."""
    idle_load: str = "rest"
    """What the ranks of a group the chosen plan leaves idle run during its steps: ``rest``
    (sleep, as an idle GPU does nothing), ``spin`` (a spin on the clock, as the testbed's
    slow-down pays its debt) or ``burn`` (small matrix products; the default before). Raced side
    by side ((i), (j), (k)) in three races, the same plan beside busy idle ranks ran 8-15%
    slower than beside ranks asleep in one and 0-9% faster in two, within the 9-10% by which
    two identical contenders of one race differed (docs/benchmarks.md, "What the idle ranks
    run"). ``--idle-ranks-rest`` is ``rest``."""

    @classmethod
    def from_dict(cls, d: dict) -> "RaceConfig":
        """A saved config (``race.json``), one written before ``idle_load`` too."""
        d = dict(d)
        if "idle_ranks_busy" in d:
            d.setdefault("idle_load", "burn" if d.pop("idle_ranks_busy") else "rest")
        if d.get("idle_load", cls.idle_load) not in IDLE_LOADS:
            raise ValueError(f"idle_load {d['idle_load']!r} is not one of {IDLE_LOADS}")
        return cls(**d)

    def testbed(self) -> dict:
        links = [] if self.unshaped else [
            {"between": ["fast", "slow"], "bandwidth_mbps": self.link_mbps,
             "latency_ms": self.link_latency_ms}]
        return {"name": "race", "cpu_per_rank": self.cpu_per_rank, "cpu_cap": self.cpu_cap,
                "pin_cpus": self.pin_cpus,
                "slowdown": self.slowdown_mechanism,
                "groups": [{"name": "fast", "ranks": self.fast_ranks},
                           {"name": "slow", "ranks": self.slow_ranks, "slowdown": self.slowdown}],
                "links": links}

    def micro_batch_sizes(self) -> tuple[int, ...] | None:
        """What the planner may choose from: the race's size, or any size when unshaped."""
        return None if self.unshaped else (self.micro_batch,)

    def profiled_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the profiler times (unshaped: every share a replica may take)."""
        if self.unshaped:
            return tuple(sorted({1, 2, 4, self.global_batch // 2, self.global_batch}))
        return tuple(sorted({self.micro_batch, max(1, self.micro_batch // 2)}))


# -- on every rank ---------------------------------------------------------------------------

def _model_config(cfg: RaceConfig):
    from transformers import GPT2Config
    return GPT2Config(n_layer=cfg.blocks, n_embd=cfg.hidden, n_head=cfg.heads,
                      n_positions=cfg.seq, vocab_size=cfg.vocab, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0)


def _groups(cfg: RaceConfig) -> dict[str, list[int]]:
    return {"fast": list(range(cfg.fast_ranks)),
            "slow": list(range(cfg.fast_ranks, cfg.fast_ranks + cfg.slow_ranks))}


def _nominal_cluster(cfg: RaceConfig):
    """What the planner is told: the topology only. Speeds and the link come from profiling."""
    from hapt_hf.planner.cluster import Cluster
    local = {"bandwidth_gbps": 10, "latency_us": 50}
    return Cluster.from_dict({
        "name": "testbed", "links": [{"between": ["fast", "slow"], **local}],
        "groups": [{"name": g, "gpu": f"cpu-{g}", "tflops": 0.01, "memory_gb": 4, "nodes": 1,
                    "gpus_per_node": len(r), "intra_node": local}
                   for g, r in _groups(cfg).items()]})


def uniform_plan(cfg: RaceConfig, virtual: int = 1):
    """Blocks split evenly over ``virtual`` stages per rank (stage ``s`` on rank ``s mod n``),
    embedding first, head last: one stage per rank under 1F1B (the default), ``virtual`` under
    torch's interleaved order and warm-ups."""
    from hapt_hf.planner.plan import Plan, Stage
    n = cfg.fast_ranks + cfg.slow_ranks
    k = n * virtual
    per = [cfg.blocks // k + (i < cfg.blocks % k) for i in range(k)]
    m = cfg.global_batch // cfg.micro_batch
    kind = ScheduleKind.ONE_F_ONE_B if virtual == 1 else ScheduleKind.INTERLEAVED
    warm = default_warmups(kind, k, m, n)
    stages, start = [], 0
    for i, b in enumerate(per):
        end = start + b + (i == 0) + (i == k - 1)
        group = "fast" if i % n < cfg.fast_ranks else "slow"
        stages.append(Stage.even(i, (start, end), group, f"cpu-{group}", (i % n,),
                                 warmup=warm[i], micro_batch_size=cfg.micro_batch))
        start = end
    return Plan("gpt2-race", start, cfg.seq, cfg.global_batch, cfg.micro_batch, m,
                kind, tuple(stages)).validate()


def interleaves(cfg: RaceConfig) -> bool:
    """Whether the model splits into VIRTUAL chunks of at least one block per rank."""
    return cfg.blocks >= (cfg.fast_ranks + cfg.slow_ranks) * VIRTUAL


def kept_ranks(cfg: RaceConfig, idle: list[str]) -> list[int]:
    """The global ranks of the groups a plan keeps, in file order: plan rank j runs on the
    j-th of them."""
    return [r for g, ranks in _groups(cfg).items() if g not in idle for r in ranks]


def _plan(cfg: RaceConfig, config) -> tuple[dict, float, float]:
    """Profile (collective), then plan on rank 0; every rank gets (plan dict, profile s, plan s)."""
    import torch.distributed as dist
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.profile import cluster_with_links
    from hapt_hf.profiling import ProfilerOptions, profile_group_leaders
    from hapt_hf.planner.search import PlannerOptions, plan_job

    load = CoreLoad()
    load.start()
    t0 = time.perf_counter()
    profile = profile_group_leaders(
        config, groups=_groups(cfg), device_names={g: f"cpu-{g}" for g in _groups(cfg)},
        seq_len=cfg.seq, options=ProfilerOptions(micro_batches=cfg.profiled_sizes(),
                                                 budget_s=cfg.profile_budget_s),
        link_sizes=(1 << 14, 1 << 17, 1 << 19), busy_peers=cfg.busy_profile,
        log=functools.partial(print, "profile:", flush=True))
    t1 = time.perf_counter()
    load.stop()
    box = [None]
    if dist.get_rank() == 0 and cfg.trace_dir:
        Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
        profile.save(Path(cfg.trace_dir) / "profile.json")
    if dist.get_rank() == 0:
        spec = ModelSpec.from_config(config, cfg.seq, "fp32", name="gpt2-race")
        cluster = cluster_with_links(_nominal_cluster(cfg), profile)
        options = PlannerOptions(micro_batch_sizes=cfg.micro_batch_sizes())
        chosen = plan_job(spec, cluster, cfg.global_batch, profile=profile, options=options)
        idle = list(chosen.plan.idle_groups)
        # where the choice leaves a group idle, the best plan on every group races beside it
        every = (plan_job(spec, cluster, cfg.global_batch, profile=profile,
                          options=replace(options, all_groups=True)) if idle else None)
        box[0] = {"plan": chosen.plan.to_dict(), "links": [asdict(m) for m in profile.links],
                  "overheads": {d: asdict(o) for d, o in profile.overheads.items()},
                  "predicted": _predictions(cfg, spec, cluster, profile, chosen.plan, every),
                  "all_groups_plan": every.plan.to_dict() if every else None,
                  "group_choice": {"idle": idle,
                                   "predicted_s": chosen.plan.predicted.iteration_s,
                                   "all_groups_predicted_s": (every or chosen).plan.predicted
                                   .iteration_s,
                                   "weighed": [asdict(c) for c in chosen.group_choices]},
                  "cores_during_profile": load.summary(),
                  "profile": {f"{k.device} {k.layer_signature.split(':')[0]} mb{k.micro_batch}":
                              [t.forward_s, t.backward_s] for k, t in profile.timings.items()}}
    dist.broadcast_object_list(box, src=0)
    return box[0], t1 - t0, time.perf_counter() - t1


def _predictions(cfg: RaceConfig, spec, cluster, profile, plan, every) -> dict[str, float]:
    """The cost model's iteration time of each plan the race runs: (a), (c) (its pipeline
    under 1F1B), (h) (the best on every group, where (a) leaves one idle), (d)."""
    from hapt_hf.planner.simulate import simulate_plan
    out = {"a": plan.predicted.iteration_s}
    if plan.virtual_stages == 1:
        model = spec.with_layer_unit(plan.layer_unit)
        out["c"] = simulate_plan(plan.with_schedule(ScheduleKind.ONE_F_ONE_B), model, cluster,
                                 profile, record_events=False).iteration_s
    if every is not None:
        out["h"] = every.plan.predicted.iteration_s
        out.update({k: out["a"] for k in IDLE_VARIANTS if k in cfg.contenders})
    # (d), the uniform split on hapt_hf's runtime over every rank: where (a) leaves a group
    # idle, it tells an error of the profile (both off alike) from one of (a)'s plan alone
    out["d"] = simulate_plan(uniform_plan(cfg), spec, cluster, profile,
                             record_events=False).iteration_s
    return out


def _cpu_ticks() -> list[tuple[int, int, int]] | None:
    """Per core, (busy, idle, steal) clock ticks since boot from ``/proc/stat``; None where it
    cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        f = line.split()
        if f and f[0].startswith("cpu") and f[0] != "cpu":
            v = [int(x) for x in f[1:9]]
            idle = v[3] + v[4]
            out.append((sum(v) - idle - v[7], idle, v[7]))
    return out


class CoreLoad:
    """How busy the machine's cores were over the spans added to it: per core, the share of
    ticks busy (user, system, interrupts), and the share stolen by the host."""

    def __init__(self) -> None:
        self.busy: list[int] = []
        self.idle: list[int] = []
        self.steal: list[int] = []
        self._start = None

    def start(self) -> None:
        self._start = _cpu_ticks()

    def stop(self) -> None:
        end = _cpu_ticks()
        if self._start is None or end is None or len(end) != len(self._start):
            return
        if not self.busy:
            self.busy, self.idle, self.steal = ([0] * len(end) for _ in range(3))
        for i, (a, b) in enumerate(zip(self._start, end)):
            self.busy[i] += b[0] - a[0]
            self.idle[i] += b[1] - a[1]
            self.steal[i] += b[2] - a[2]

    def summary(self) -> dict:
        tot = [b + i + s for b, i, s in zip(self.busy, self.idle, self.steal)]
        return {"busy": [round(b / t, 3) if t else None for b, t in zip(self.busy, tot)],
                "steal": [round(s / t, 3) if t else None for s, t in zip(self.steal, tot)]}


def _train_step(rt, opt, batch):
    return rt.train_step(batch, opt)


def _runtime_steps(config, plans: dict, recorder=None) -> dict:
    """name -> step(batch) of hapt_hf's runtime on each plan (this rank in every plan);
    (a)'s traced into ``recorder`` where one is given (benchmarks/race_trace.py)."""
    import torch
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    rc = RuntimeConfig(timeout_s=600, seed=0)
    steps = {}
    for name, plan in plans.items():
        rt = PipelineRuntime(plan, config, rc)
        opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-4)
        steps[name] = functools.partial(_train_step, rt, opt)
        if name == "a" and recorder is not None:
            from benchmarks.race_trace import instrument
            instrument(rt, opt, recorder)
            steps[name] = recorder.call(steps[name])
    return steps


def _recorder(cfg: RaceConfig):
    """A recorder of (a)'s actions where the race is traced, else None."""
    if not cfg.trace_dir:
        return None
    from benchmarks.race_trace import Recorder
    return Recorder()


def _save_trace(cfg: RaceConfig, recorder, rank: int) -> None:
    if recorder is not None and recorder.calls:
        recorder.save(Path(cfg.trace_dir) / f"trace_rank{rank}.json")


IDLE_LOADS = ("burn", "spin", "rest")
"""What an idle rank may run during a step of a plan that leaves its group idle."""


def _burn() -> None:
    """About a millisecond of one core's arithmetic."""
    import torch
    a = torch.ones(96, 96)
    for _ in range(4):
        a = a @ a * 1e-2


def _spin() -> None:
    """About a millisecond of one core spun on the clock."""
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass


def _rest() -> None:
    time.sleep(0.001)


IDLE_RUNS = {"burn": _burn, "spin": _spin, "rest": _rest}
"""Each idle load's run of about a millisecond, repeated until the step ends."""


def _chosen_plans(plan_a, cfg: RaceConfig) -> dict:
    """(a) and, on a plan of one stage per rank, (c): the same plan with 1F1B's warm-ups
    (where the race runs (c))."""
    plans = {"a": plan_a}
    if plan_a.virtual_stages == 1 and "c" in cfg.contenders:
        plans["c"] = plan_a.with_schedule(ScheduleKind.ONE_F_ONE_B)
    return plans


def _torch_step(cfg: RaceConfig, config, plan, rank: int, schedule: str):
    """One step of torch's ``schedule`` over ``plan`` (uniform) on this rank, AdamW after."""
    import torch
    from hapt_hf.pipeline.stage import build_stage
    from hapt_hf.pipeline.torch_pipelining import build_torch_pipeline
    modules = {s.index: build_stage(config, s.layers, seed=0) for s in plan.stages_of_rank(rank)}
    torch_pp = build_torch_pipeline(plan, rank, modules, cfg.vocab, schedule=schedule)
    opt = torch.optim.AdamW([q for m in modules.values() for q in m.parameters()], lr=1e-4)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        torch_pp.forward_backward(batch.input_ids, batch.labels)
        opt.step()
    return step


def _contenders(cfg: RaceConfig, config, planned: dict, rank: int) -> tuple[dict, list]:
    """name -> step(batch) callable running one full training step of that contender, and
    what to close after the race."""
    from hapt_hf.planner.plan import Plan
    plan_a = Plan.from_dict(planned["plan"])
    idle = planned["group_choice"]["idle"]
    uniform = uniform_plan(cfg)
    plans = {"d": uniform} if "d" in cfg.contenders else {}
    if idle:
        if "h" in cfg.contenders:
            plans["h"] = Plan.from_dict(planned["all_groups_plan"])
    else:
        plans.update(_chosen_plans(plan_a, cfg))
    recorder = _recorder(cfg)
    steps, closing = _runtime_steps(config, plans, recorder), [_TraceSaver(cfg, recorder, rank)]
    if idle:
        sub = _SubWorld(cfg, planned, rank)
        steps.update(sub.steps())
        closing.append(sub)
    if "b" in cfg.contenders:
        steps["b"] = _torch_step(cfg, config, uniform, rank, "Schedule1F1B")
    if interleaves(cfg):
        chunks = uniform_plan(cfg, VIRTUAL)
        for name, schedule in TORCH_INTERLEAVED.items():
            if name in cfg.contenders:
                steps[name] = _torch_step(cfg, config, chunks, rank, schedule)
    if "e" in cfg.contenders and \
            _ddp_estimate_s(cfg, config, planned["links"]) <= cfg.ddp_max_s:
        steps["e"] = _ddp_step(cfg, config, rank)
    return steps, closing


class _TraceSaver:
    def __init__(self, cfg: RaceConfig, recorder, rank: int) -> None:
        self.cfg, self.recorder, self.rank = cfg, recorder, rank

    def close(self) -> None:
        _save_trace(self.cfg, self.recorder, self.rank)


class _SubWorld:
    """The chosen plan on the kept groups' ranks alone: each kept rank starts one child
    process (same cgroup, CPU, namespace and slow-down: it inherits them), and the children
    form the plan's world over a prefix of the race's own store. A step is a line to the
    child and its answer; an idle rank has no child and its step does nothing."""

    def __init__(self, cfg: RaceConfig, planned: dict, rank: int) -> None:
        import torch.distributed as dist
        kept = kept_ranks(cfg, planned["group_choice"]["idle"])
        self.proc = None
        self.idle = IDLE_RUNS[cfg.idle_load]
        self.variants = {k: v for k, v in IDLE_VARIANTS.items() if k in cfg.contenders}
        if rank in kept:
            env = dict(os.environ, RANK=str(kept.index(rank)), LOCAL_RANK=str(kept.index(rank)),
                       WORLD_SIZE=str(len(kept)))
            if "HAPT_TESTBED_SHIM" in env:  # the shim's groups by the child world's ranks
                shim = json.loads(env["HAPT_TESTBED_SHIM"])
                shim["group_of_rank"] = [shim["group_of_rank"][r] for r in kept]
                env["HAPT_TESTBED_SHIM"] = json.dumps(shim)
            arg = json.dumps({"cfg": asdict(cfg), "plan": planned["plan"]})
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                          "--sub-worker", arg], env=env, cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._expect("ready")
        from hapt_hf.planner.plan import Plan
        self.names = list(_chosen_plans(Plan.from_dict(planned["plan"]), cfg))
        dist.barrier()  # every child world is up before the race starts

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.proc.kill()
            raise RuntimeError(f"the sub-world child answered {line!r}, not {word!r} (its "
                               "output is above)")

    def _step(self, name: str, batch, idle: str | None = None, tag: str = "") -> None:
        import torch.distributed as dist
        if self.proc is None:  # idle: run the idle load until the step ends
            run = IDLE_RUNS[idle] if idle else self.idle
            done = dist.barrier(async_op=True)
            while not done.is_completed():
                run()
            return
        self.proc.stdin.write(f"{name} {tag}".strip() + "\n")
        self.proc.stdin.flush()
        self._expect("done")
        dist.barrier()

    def steps(self) -> dict:
        out = {n: functools.partial(self._step, n) for n in self.names}
        for letter, load in self.variants.items():
            out[letter] = functools.partial(self._step, "a", idle=load, tag=letter)
        return out

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def sub_worker(arg: dict) -> None:
    """A child of a kept rank: join the plan's world, build (a) and (c), run steps on demand."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from hapt_hf.pipeline import Batch
    from hapt_hf.planner.plan import Plan
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, the answers alone to the parent
    cfg = RaceConfig(**arg["cfg"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=dist.PrefixStore("race-sub-world/", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    config = _model_config(cfg)
    recorder = _recorder(cfg)
    steps = _runtime_steps(config, _chosen_plans(Plan.from_dict(arg["plan"]), cfg), recorder)
    gc.collect()
    gc.freeze()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
    batch = Batch(ids, ids.clone())
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        name, _, tag = line.strip().partition(" ")
        if name == "quit":
            break
        if recorder is not None:
            recorder.tag = tag or name
        steps[name](batch)
        print("done", file=out, flush=True)
    _save_trace(cfg, recorder, rank)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _ddp_estimate_s(cfg: RaceConfig, config, links: list[dict]) -> float:
    """Seconds of DDP's ring all-reduce of fp32 gradients over the slowest measured link."""
    from hapt_hf.planner.model_spec import ModelSpec
    params = ModelSpec.from_config(config, cfg.seq).total_params
    n = cfg.fast_ranks + cfg.slow_ranks
    gbps = min((l["bandwidth_gbps"] for l in links), default=10.0)
    return 2 * (n - 1) / n * params * 4 * 8 / (gbps * 1e9)


def _ddp_step(cfg: RaceConfig, config, rank: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = DistributedDataParallel(AutoModelForCausalLM.from_config(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = dist.get_world_size()
    share = cfg.global_batch // world

    def step(batch):
        opt.zero_grad(set_to_none=True)
        ids = batch.input_ids[rank * share:(rank + 1) * share]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return step


def worker(cfg: RaceConfig) -> None:
    import torch
    import torch.distributed as dist
    from hapt_hf.pipeline import Batch, init_distributed

    rank, _ = init_distributed(timeout_s=600)
    config = _model_config(cfg)
    planned, profile_s, plan_s = _plan(cfg, config)
    steps, closing = _contenders(cfg, config, planned, rank)
    # Several contenders' models live in every rank, where a training job holds one: the
    # collector's full passes over them (about 1 s a rank over a run) would land in random
    # steps. Everything made so far is frozen out of the collector's passes, as it would be
    # in a process holding only one of them.
    gc.collect()
    gc.freeze()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq), generator=g)
    batch = Batch(ids, ids.clone())
    order = sorted(steps)
    times: dict[str, list[float]] = {k: [] for k in order}
    loads = {k: CoreLoad() for k in order}
    for r in range(cfg.warmup_reps + cfg.reps):
        rotated = order[r % len(order):] + order[:r % len(order)]
        for name in rotated:
            if name == "e" and r >= cfg.warmup_reps + cfg.ddp_reps:
                continue  # DDP sends the whole model's gradients over the slow link: slow
            dist.barrier()
            loads[name].start()
            t0 = time.perf_counter()
            steps[name](batch)
            dist.barrier()
            if r >= cfg.warmup_reps:
                times[name].append(time.perf_counter() - t0)
                loads[name].stop()
    for c in closing:
        c.close()
    if rank == 0 and cfg.trace_dir:
        (Path(cfg.trace_dir) / "plan.json").write_text(json.dumps(planned["plan"]))
        (Path(cfg.trace_dir) / "race.json").write_text(json.dumps({"cfg": asdict(cfg)}))
    if rank == 0:
        print("RACE " + json.dumps({"times": times, "profile_s": profile_s, "plan_s": plan_s,
                                    "cores": {k: v.summary() for k, v in loads.items()},
                                    "ddp_estimate_s": _ddp_estimate_s(cfg, config,
                                                                      planned["links"]),
                                    **planned}), flush=True)
    dist.barrier()  # every send is delivered: nothing is left on the shim's link threads


# -- the driver ------------------------------------------------------------------------------

def _stats(xs: list[float]) -> tuple[float, float]:
    med = statistics.median(xs)
    if len(xs) < 2:
        return med, 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return med, (q[2] - q[0]) / med


def _uneven(stage: dict) -> bool:
    """Whether a plan.json stage's replicas differ in group, device type or share."""
    return len({(r["group"], r["device_type"], r["samples"]) for r in stage["replicas"]}) > 1


def summarize(cfg: RaceConfig, race: dict, mechanisms, wall_s: float) -> dict:
    tokens = cfg.global_batch * cfg.seq
    rows = {}
    for k, xs in race["times"].items():
        med, spread = _stats(xs)
        rows[k] = {"name": CONTENDERS[k], "median_s": round(med, 4), "spread": round(spread, 3),
                   "tokens_per_s": round(tokens / med, 1), "n": len(xs)}
    for k in rows:
        if "b" in rows:
            rows[k]["vs_b"] = round(rows["b"]["median_s"] / rows[k]["median_s"], 3)
    ddp = ({"speedup_vs_ddp_equal_share": round(rows["e"]["median_s"] / rows["a"]["median_s"], 3)}
           if "e" in rows else
           {"ddp_skipped": f"all-reduce over the measured link estimated at "
                           f"{race['ddp_estimate_s']:.0f} s per step > ddp_max_s"})
    predicted = race["plan"]["predicted"]["iteration_s"]
    measured = rows["a"]["median_s"]
    plan = race["plan"]
    best = min((k for k in TORCH if k in rows), key=lambda k: rows[k]["median_s"], default=None)
    predictions = {k: {"predicted_s": round(p, 4), "measured_s": rows[k]["median_s"],
                       "error": round(abs(p - rows[k]["median_s"]) / rows[k]["median_s"], 3)}
                   for k, p in race.get("predicted", {}).items() if k in rows}
    return {
        **({"speedup_vs_torch_1f1b_uniform": rows["a"]["vs_b"]} if "b" in rows else {}),
        **({"speedup_vs_torch_best": round(rows[best]["median_s"] / measured, 3),
            "torch_best": CONTENDERS[best]} if best else {}),
        **({"speedup_vs_plain_1f1b": round(rows["c"]["median_s"] / measured, 3)}
           if "c" in rows else {}),
        **({"speedup_vs_uniform_hapt_runtime": round(rows["d"]["median_s"] / measured, 3)}
           if "d" in rows else {}),
        **({"speedup_vs_all_groups": round(rows["h"]["median_s"] / measured, 3)}
           if "h" in rows else {}),
        **ddp,
        "prediction_error": round(abs(predicted - measured) / measured, 3),
        "predicted_iteration_s": round(predicted, 4), "measured_iteration_s": measured,
        "predictions": predictions, "contenders": rows,
        "plan": {"stages": [{"layers": s["layers"], "group": s["replicas"][0]["group"],
                             "ranks": [r for rep in s["replicas"] for r in rep["ranks"]],
                             "warmup": s["warmup"], "optimizer": s.get("optimizer", "replicated"),
                             **({"samples": [r["samples"] for r in s["replicas"]]}
                                if _uneven(s) else {})} for s in plan["stages"]],
                 "schedule": plan["schedule"], "idle_groups": plan.get("idle_groups", []),
                 "micro_batch_size": plan["micro_batch_size"],
                 "num_microbatches": plan["num_microbatches"]},
        "group_choice": race["group_choice"],
        "measured_links": race["links"], "profile": race["profile"],
        "step_overheads": race.get("overheads", {}),
        "cores": {"profile": race.get("cores_during_profile"), **race.get("cores", {})},
        "profile_s": round(race["profile_s"], 1), "plan_s": round(race["plan_s"], 2),
        "testbed": {"slowdown": mechanisms.slowdown, "network": mechanisms.network,
                    "notes": list(mechanisms.notes)},
        "config": asdict(cfg), "wall_s": round(wall_s, 1)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["contenders"]
    keys = [k for k in CONTENDERS if k in rows]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    vals = [rows[k]["tokens_per_s"] for k in keys]
    errs = [rows[k]["tokens_per_s"] * rows[k]["spread"] / 2 for k in keys]
    ax.barh([f"({k}) {rows[k]['name']}" for k in keys], vals, xerr=errs,
            color=["#2a7" if k == "a" else "#888" for k in keys])
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (median; bar: interquartile range)")
    c = result["config"]
    ax.set_title(f"GPT-2 {c['blocks']} blocks h{c['hidden']}, {c['fast_ranks']}+{c['slow_ranks']} "
                 f"CPU ranks, {c['slowdown']:g}x slower group, {c['link_mbps']:g} Mbit/s + "
                 f"{c['link_latency_ms']:g} ms link", fontsize=8.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="(e) DDP timed once over the shaped link (4 to 7 minutes)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--slowdown", type=float, default=None)
    ap.add_argument("--link-mbps", type=float, default=None)
    ap.add_argument("--link-latency-ms", type=float, default=None)
    ap.add_argument("--slowdown-mechanism", choices=["hook", "cgroup"], default=None)
    ap.add_argument("--cpu-cap", type=float, default=None,
                    help="under the hook slow-down, cap every rank at this many cores")
    ap.add_argument("--ddp-max-s", type=float, default=None,
                    help="run (e) DDP when its estimated all-reduce takes at most this long")
    ap.add_argument("--ddp-reps", type=int, default=None)
    ap.add_argument("--profile-budget-s", type=float, default=None,
                    help="timed seconds the profiler aims at per layer and size (default 2.0)")
    ap.add_argument("--idle-profile", action="store_true",
                    help="profile the group leaders with their peers idle")
    ap.add_argument("--unshaped", action="store_true",
                    help="leave the link between the groups at the machine's speed")
    ap.add_argument("--no-pin-cpus", action="store_true",
                    help="leave the capped ranks free to run on any core")
    ap.add_argument("--contenders", default=None,
                    help="letters of the contenders to race, (a) always (default: abcdefgh)")
    ap.add_argument("--idle-ranks-rest", action="store_true",
                    help="let the ranks of a group the plan leaves idle sleep during its steps "
                         "(--idle-load rest)")
    ap.add_argument("--idle-load", choices=IDLE_LOADS, default=None,
                    help="what the ranks of a group the plan leaves idle run during its steps "
                         f"(default: {RaceConfig.idle_load})")
    ap.add_argument("--trace-dir", default=None,
                    help="trace (a) action by action into this folder (benchmarks/race_trace.py)")
    ap.add_argument("--plot", type=Path, default=None, help="write the throughput plot here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sub-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sub_worker:
        sub_worker(json.loads(args.sub_worker))
        return {}
    if args.worker:
        worker(RaceConfig(**json.loads(args.worker)))
        return {}
    # Seven timed repetitions in --quick too (was five): in ten races with five, one plan's
    # repetitions spread 14% and 24% of their median, and a median of five moved its ratio to
    # DDP below 1.4 (docs/benchmarks.md, run 21)
    cfg = RaceConfig(ddp_reps=1) if args.quick else RaceConfig()
    over = {"reps": args.reps, "slowdown": args.slowdown, "link_mbps": args.link_mbps,
            "link_latency_ms": args.link_latency_ms,
            "slowdown_mechanism": args.slowdown_mechanism,
            "busy_profile": False if args.idle_profile else None,
            "profile_budget_s": args.profile_budget_s,
            "ddp_max_s": args.ddp_max_s, "ddp_reps": args.ddp_reps, "cpu_cap": args.cpu_cap,
            "unshaped": True if args.unshaped else None,
            "pin_cpus": False if args.no_pin_cpus else None,
            "idle_load": "rest" if args.idle_ranks_rest else args.idle_load,
            "contenders": "a" + args.contenders if args.contenders else None,
            "trace_dir": str(Path(args.trace_dir).resolve()) if args.trace_dir else None}
    cfg = RaceConfig(**{**asdict(cfg), **{k: v for k, v in over.items() if v is not None}})
    if cfg.cpu_cap is not None and cfg.cpu_cap <= 0:
        cfg = RaceConfig(**{**asdict(cfg), "cpu_cap": None})
    if cfg.unshaped and args.ddp_reps is None:
        cfg = RaceConfig(**{**asdict(cfg), "ddp_reps": cfg.reps})  # (e) is the yardstick here

    from benchmarks.testbed import Testbed, TestbedSpec
    start = time.monotonic()
    with Testbed(TestbedSpec.from_dict(cfg.testbed())) as tb:
        print(f"testbed: slowdown by {tb.mechanisms.slowdown}, links by "
              f"{tb.mechanisms.network}; {'; '.join(tb.mechanisms.notes)}", flush=True)
        results = tb.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                          json.dumps(asdict(cfg))], timeout_s=1500, cwd=ROOT)
        mechanisms = tb.mechanisms
    line = next((l for l in results[0].output.splitlines() if l.startswith("RACE ")), None)
    if line is None or any(r.returncode for r in results):
        for r in results:
            print(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}", file=sys.stderr)
        raise SystemExit("the race failed; the ranks' output is above")
    result = summarize(cfg, json.loads(line[5:]), mechanisms, time.monotonic() - start)
    result["profile_log"] = [l[len("profile: "):] for l in results[0].output.splitlines()
                             if l.startswith("profile: ")]
    for k, row in result["contenders"].items():
        print(f"({k}) {row['name']:30s} {row['median_s'] * 1e3:9.1f} ms  "
              f"spread {row['spread']:.2f}  {row['tokens_per_s']:8.1f} tok/s  "
              + (f"x{row['vs_b']:.2f} vs (b)" if "vs_b" in row else ""))
    for k, c in result["cores"].items():
        if c and c.get("busy"):
            print(f"cores busy during {k}: {c['busy']} (stolen {c['steal']})")
    print(f"plan: {result['plan']}; predicted {result['predicted_iteration_s']} s, "
          f"measured {result['measured_iteration_s']} s")
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
