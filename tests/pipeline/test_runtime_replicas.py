"""Replicas that take uneven shares of each micro-batch, and optimizer state sharded among a
stage's replicas (ZeRO-1), train exactly as one process would.

Each case trains STEPS AdamW steps (clipped to the global norm, an LR schedule) on 3 or 4 Gloo
ranks and compares every loss, every gradient norm and, on every rank, every parameter of its
stage with one process training the whole model on the same global batches; rank 0 also
compares the gathered logits and ``from_pretrained`` state dict. A sharded run must hold only its share
of the Adam state, must step exactly as the replicated optimizer does under fp16's skipped
steps, and must resume from per-rank shard files in fresh processes bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import (SEQ, STEPS, _check_forward_only, _compare,
                                                     make_batches, tiny_config)

pytestmark = pytest.mark.multiproc

M = 2  # micro-batches per step


@dataclass(frozen=True)
class Case:
    """A plan: blocks per stage, each stage's replica shares (None: one rank), sharded stages."""

    name: str
    family: str
    blocks: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]
    sharded: tuple[int, ...] = ()
    groups: bool = False
    """Give each replica a group of its own (replicas of one stage in different groups)."""

    @property
    def world(self) -> int:
        return sum(len(s) for s in self.shares)

    def plan(self, dtype: str = "fp32") -> Plan:
        n, stages, rank, start = len(self.blocks), [], 0, 0
        mbs = sum(self.shares[0])
        for i, (b, shares) in enumerate(zip(self.blocks, self.shares)):
            end = start + b + (i == 0) + (i == n - 1)  # the embedding and head are layers too
            reps = tuple(Replica(f"g{rank + r}" if self.groups else "cpu", "cpu", s, (rank + r,))
                         for r, s in enumerate(shares))
            opt = "sharded" if i in self.sharded else "replicated"
            stages.append(Stage(i, (start, end), reps, warmup=n - i, optimizer=opt))
            start, rank = end, rank + len(shares)
        plan = Plan(f"tiny-{self.family}", start, SEQ, mbs * M, mbs, M, "1f1b", tuple(stages))
        loss_scaling = "dynamic" if dtype == "fp16" else None
        return replace(plan, dtype=dtype, loss_scaling=loss_scaling).validate(self.world)


CASES = {
    3: [Case("3:1|1", "gpt2", (2, 1), ((3, 1), (4,))),
        Case("3:1-sharded|1", "llama", (2, 1), ((3, 1), (4,)), sharded=(0,)),
        # one stage: plain uneven data parallelism over GPUs of different groups
        Case("5:2:1-one-stage", "gpt2", (2,), ((5, 2, 1),), groups=True)],
    4: [Case("1|5:2:1", "llama", (1, 2), ((8,), (5, 2, 1))),
        Case("3:1|1:3-groups", "gpt2", (1, 2), ((3, 1), (1, 3)), groups=True),
        Case("2-sharded|2-sharded", "gpt2", (2, 1), ((2, 2), (2, 2)), sharded=(0, 1)),
        Case("4-sharded", "llama", (3,), ((1, 1, 1, 1),), sharded=(0,))],
}
RESUMED = CASES[4][2]  # tied embeddings across two sharded stages
FP16 = Case("2|2", "llama", (1, 1), ((1, 1), (1, 1)))


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))


def _runtime(case: Case, plan: Plan | None = None, **config):
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    plan = plan or case.plan()
    return PipelineRuntime(plan, tiny_config(case.family, sum(case.blocks)),
                           RuntimeConfig(timeout_s=60, seed=7, **config))


def _optimizer(rt):
    # lr 1e-3, as the equivalence tests: larger magnifies last-bit differences past atol
    return rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)


def _state_count(opt) -> int:
    """Parameters whose Adam state this rank holds."""
    return len(getattr(opt, "optim", opt).state)


def train_case(rank: int, case: Case) -> dict:
    """STEPS steps against one process; what the rank found wrong and what it holds."""
    from transformers import AutoModelForCausalLM
    rt = _runtime(case)
    config = rt.stage.config
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    opt = _optimizer(rt)
    sched = _schedule(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    ref_sched = _schedule(ref_opt)
    errors: list[str] = []
    norms = []
    rows: set[int] = set()  # the samples of each micro-batch this replica computed
    hook = rt.stage.register_forward_pre_hook(lambda m, args, seen=rows: seen.add(args[0].shape[0]))
    for i, b in enumerate(make_batches(config.vocab_size, seed=11, rows=rt.plan.global_batch_size)):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_sched.step()
        res = rt.train_step(b, opt, sched, max_grad_norm=0.5)
        norms.append(res.grad_norm)
        _compare(f"step {i} loss", torch.tensor(res.loss, dtype=torch.float64),
                 ref_loss.detach().double(), errors)
        _compare(f"step {i} grad norm", torch.tensor(res.grad_norm, dtype=torch.float64),
                 ref_norm.double(), errors)
    for n, p in rt.stage.named_parameters():
        _compare(f"param {n} after {STEPS} steps", p.detach(), ref.get_parameter(n).detach(),
                 errors)
    hook.remove()
    # evaluate, the gathered logits and the from_pretrained state dict, after the steps
    _check_forward_only(rank, rt, ref, b, errors)
    out = {"errors": errors, "stage": rt.stage_plan.index, "norms": norms, "rows": sorted(rows),
           "optimizer": type(opt).__name__, "state": _state_count(opt),
           "params": sum(1 for p in rt.stage.parameters() if p.requires_grad)}
    rt.shutdown()
    return out


def _params(rt) -> dict:
    # numpy copies: tensors would cross back to the parent through shared memory
    return {n: p.detach().numpy().copy() for n, p in rt.stage.named_parameters()}


def fp16_sharded_vs_replicated(rank: int) -> dict:
    """fp16 with dynamic loss scaling from a scale that overflows: the sharded optimizer skips
    the same steps and ends at the same parameters, bit for bit, as the replicated one."""
    out = {}
    for mode, sharded in (("replicated", ()), ("sharded", (0, 1))):
        case = replace(FP16, sharded=sharded)
        # growth every clean step from a scale the tiny model's fp16 gradients overflow at
        # within a few steps (as the HaptTrainer fp16 resume test)
        rt = _runtime(case, case.plan("fp16"), loss_scale_init=2.0 ** 17,
                      loss_scale_growth_interval=1)
        opt = _optimizer(rt)
        sched = _schedule(opt)
        g = rt.plan.global_batch_size
        results = [rt.train_step(b, opt, sched, max_grad_norm=0.5)
                   for seed in (3, 4) for b in make_batches(97, seed=seed, rows=g)]
        out[mode] = {"skipped": [r.skipped for r in results], "losses": [r.loss for r in results],
                     "lr": sched.get_last_lr(), "optimizer": type(opt).__name__,
                     "params": _params(rt)}
        rt.shutdown()
    return out


def _save(rt, opt, sched, out: str) -> None:
    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    from hapt_hf.pipeline.export import write_stage_shards
    from pathlib import Path
    write_stage_shards(rt, Path(out))
    ckpt_io.save_rank_state(Path(out), rt.rank, opt, sched)
    ckpt_io.barrier()


def resume_part_one(rank: int, root: str) -> dict:
    """An uninterrupted STEPS-step run, and one that saves after STEPS - 1 steps."""
    out = {}
    for saves in (False, True):
        rt = _runtime(RESUMED)
        opt = _optimizer(rt)
        sched = _schedule(opt)
        batches = make_batches(97, seed=5, rows=rt.plan.global_batch_size)
        for b in batches[:STEPS - 1] if saves else batches:
            rt.train_step(b, opt, sched, max_grad_norm=0.5)
        if saves:
            _save(rt, opt, sched, root)
        else:
            out["full"] = _params(rt)
        rt.shutdown()
    return out


def resume_part_two(rank: int, world_size: int, root: str) -> dict:
    """Fresh processes: the stage's weights and this rank's optimizer shard from the files,
    then the last step."""
    from pathlib import Path

    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    rt = _runtime(RESUMED, checkpoint_dir=root)
    opt = _optimizer(rt)
    sched = _schedule(opt)
    ckpt_io.load_rank_state(Path(root), rank, opt, sched)
    loaded = _state_count(opt)
    rt.train_step(make_batches(97, seed=5, rows=rt.plan.global_batch_size)[-1], opt, sched,
                  max_grad_norm=0.5)
    out = {"resumed": _params(rt), "loaded_state": loaded, "lr": sched.get_last_lr()}
    rt.shutdown()
    return out


class _Scaled(torch.optim.SGD):
    """An optimizer whose constructor derives the settings it records: it cannot be rebuilt
    for one shard from them."""

    def __init__(self, params, base_lr: float, factor: float) -> None:
        super().__init__(params, lr=base_lr * factor)


def refusals(rank: int) -> dict:
    """What a rank of a sharded stage is told for optimizers that keep the whole state."""
    from hapt_hf.pipeline.zero import OptimizerPlanError
    rt = _runtime(CASES[3][1])  # stage 0 (ranks 0, 1) sharded, stage 1 (rank 2) replicated
    batch = make_batches(97, seed=1, rows=rt.plan.global_batch_size)[0]
    out = {}
    plain = torch.optim.AdamW(rt.parameters(), lr=1e-3)
    attempts = {"train_step": lambda: rt.train_step(batch, plain),
                "derived": lambda: rt.prepare_optimizer(_Scaled(rt.parameters(), 1e-3, 2.0))}
    if rt.stage_plan.optimizer == "sharded":
        stepped = torch.optim.AdamW(rt.parameters(), lr=1e-3)
        for p in rt.parameters():
            p.grad = torch.zeros_like(p)
        stepped.step()
        attempts["stepped"] = lambda: rt.prepare_optimizer(stepped)
        for what, attempt in attempts.items():
            try:
                attempt()
                out[what] = None
            except OptimizerPlanError as e:
                out[what] = str(e)
    else:  # a replicated stage takes them as they are; its train_step needs the others
        out["prepared_is_itself"] = rt.prepare_optimizer(plain) is plain
    rt.shutdown()
    return out


def run_all(rank: int, world_size: int, root: str) -> dict:
    out = {c.name: train_case(rank, c) for c in CASES[world_size]}
    if world_size == 3:
        out["refusals"] = refusals(rank)
    if world_size == 4:
        out["fp16"] = fp16_sharded_vs_replicated(rank)
        out["resume"] = resume_part_one(rank, root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("sharded-resume"))
    out = {w: [o.value for o in run_ranks(run_all, w, root, timeout_s=240)] for w in CASES}
    out["resumed"] = [o.value for o in run_ranks(resume_part_two, 4, root, timeout_s=240)]
    return out


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{c.name}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[case.name]
        assert not r["errors"], f"rank {rank} (stage {r['stage']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"
        # each replica computed the share the plan gives it, not an even one
        plan = case.plan()
        shares = plan.stages[r["stage"]].shares(plan.micro_batch_size)
        mine = shares[plan.stages[r["stage"]].ranks.index(rank)]
        assert r["rows"] == [mine], (rank, r["rows"], shares)


@pytest.mark.parametrize("world,case", [(w, c) for w, c in ALL if c.sharded],
                         ids=[f"{w}r-{c.name}" for w, c in ALL if c.sharded])
def test_sharded_stage_holds_only_its_share_of_the_state(results, world, case):
    plan = case.plan()
    for s in case.sharded:
        ranks = plan.stages[s].ranks
        held = [results[world][r][case.name]["state"] for r in ranks]
        params = results[world][ranks[0]][case.name]["params"]
        assert all(results[world][r][case.name]["optimizer"] == "ShardedOptimizer"
                   for r in ranks)
        # every parameter's state is held by exactly one replica, and none holds it all
        assert sum(held) == params and max(held) < params, (s, held, params)
    for rank, per_rank in enumerate(results[world]):
        if plan.stage_of_rank(rank).index not in case.sharded:
            assert per_rank[case.name]["optimizer"] == "AdamW"
            assert per_rank[case.name]["state"] == per_rank[case.name]["params"]


def test_fp16_skipped_steps_and_schedule_match_the_replicated_optimizer(results):
    for rank, per_rank in enumerate(results[4]):
        rep, sh = per_rank["fp16"]["replicated"], per_rank["fp16"]["sharded"]
        assert sh["optimizer"] == "ShardedOptimizer" and rep["optimizer"] == "AdamW"
        assert any(rep["skipped"]) and not all(rep["skipped"]), rep["skipped"]  # both kinds
        assert sh["skipped"] == rep["skipped"] and sh["losses"] == rep["losses"]
        assert sh["lr"] == rep["lr"]
        for n, p in rep["params"].items():
            assert (sh["params"][n] == p).all(), (rank, n)


def test_sharded_run_resumes_exactly_in_fresh_processes(results):
    for rank in range(4):
        full = results[4][rank]["resume"]["full"]
        resumed = results["resumed"][rank]
        assert resumed["loaded_state"] > 0  # this rank's shard came from its file
        for n, p in full.items():
            assert (resumed["resumed"][n] == p).all(), (rank, n)


def test_an_optimizer_that_keeps_the_whole_state_is_refused_naming_the_fix(results):
    for rank in (0, 1):
        msgs = results[3][rank]["refusals"]
        for what in ("train_step", "derived", "stepped"):
            msg = msgs[what]
            assert msg is not None, f"rank {rank}: {what} was not refused"
            assert "stage 0's plan says optimizer: sharded" in msg, msg
            assert "runtime.make_optimizer(" in msg and '"replicated"' in msg, msg
        assert "(AdamW) holds the whole state" in msgs["train_step"]
        assert "(_Scaled) cannot be rebuilt" in msgs["derived"]
        assert "(AdamW) has taken steps already" in msgs["stepped"]
    assert results[3][2]["refusals"] == {"prepared_is_itself": True}
