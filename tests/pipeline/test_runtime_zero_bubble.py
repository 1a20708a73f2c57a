"""The ``zero_bubble`` schedule (each backward split into ``I``, the input gradient sent
upstream at once, and ``W``, the weight gradients, deferred) trains exactly as one process would.

Each case trains STEPS clipped AdamW steps on Gloo ranks and compares, on every rank, every
gradient of its stage after the first iteration (tensor-parallel shards gathered whole), every
loss and global gradient norm, every parameter after the steps, ``evaluate``, the gathered
logits and state dict with one process training the whole model on the same global batches
(rtol 1e-5, atol 4e-5 in fp32). Gradient buckets are tiny, so the replicas' all-reduce
overlaps the last ``W`` in several buckets. Cases: 2 ranks (GPT-2 with the rule's deferrals;
LLaMA with activation checkpointing on every stage and deferrals set per stage); 4 ranks
(mixed widths with uneven replicas and sharded optimizer state; a tensor-parallel stage
beside uneven sharded replicas; one rank feeding three uneven replicas of the last stage,
which holds GPT-2's tied head). fp16 with dynamic loss scaling skips the same steps and ends
at the same parameters as H-1F1B on the same plan, bit for bit. The harness (:func:`build_plan`,
:func:`train_and_compare`) serves the interleaved tests too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import (SEQ, STEPS, _check_forward_only, _compare,
                                                     make_batches)

pytestmark = pytest.mark.multiproc

M = 4  # micro-batches per step
SMALL_BUCKET = 4096  # bytes: several buckets per stage, so the overlap path runs


def tiny_config(family: str, blocks: int):
    from transformers import GPT2Config, LlamaConfig
    if family == "gpt2":
        return GPT2Config(n_layer=blocks, n_embd=32, n_head=2, n_positions=32, vocab_size=97,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          tie_word_embeddings=True)
    return LlamaConfig(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=97,
                       max_position_embeddings=32, tie_word_embeddings=False)


@dataclass(frozen=True)
class Case:
    """A plan: blocks per stage; per pipeline rank its replicas' shares and tensor-parallel
    degree; stage ``s`` sits on pipeline rank ``s mod p`` (one stage per rank unless
    interleaved)."""

    name: str
    family: str
    schedule: str
    blocks: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]
    """Per pipeline rank: each replica's samples of a micro-batch."""
    tp: tuple[int, ...] = ()
    """Per pipeline rank (default 1)."""
    warmups: tuple[int, ...] | None = None
    """Per stage (None: the kind's own)."""
    deferrals: tuple[int | None, ...] | None = None
    recompute: tuple[int, ...] = ()
    sharded: tuple[int, ...] = ()
    """Pipeline ranks whose optimizer state is sharded among their replicas."""
    dtype: str = "fp32"

    @property
    def ranks(self) -> int:
        return len(self.shares)

    @property
    def world(self) -> int:
        return sum(len(s) * self.degree(p) for p, s in enumerate(self.shares))

    def degree(self, position: int) -> int:
        return self.tp[position] if self.tp else 1


def build_plan(case: Case) -> Plan:
    from hapt_hf.core.schedules import default_warmups
    p, n = case.ranks, len(case.blocks)
    reps, rank = [], 0
    for pos, shares in enumerate(case.shares):
        t = case.degree(pos)
        reps.append(tuple(Replica("cpu", "cpu", s, tuple(range(rank + t * r, rank + t * (r + 1))))
                          for r, s in enumerate(shares)))
        rank += t * len(shares)
    mbs = sum(case.shares[0])
    warm = case.warmups or default_warmups(case.schedule, n, M, p)
    stages, start = [], 0
    for i, b in enumerate(case.blocks):
        end = start + b + (i == 0) + (i == n - 1)  # the embedding and head are layers too
        d = None if case.deferrals is None else case.deferrals[i]
        stages.append(Stage(i, (start, end), reps[i % p], warmup=warm[i],
                            recompute=i in case.recompute, deferral=d,
                            optimizer="sharded" if i % p in case.sharded else "replicated"))
        start = end
    plan = Plan(f"tiny-{case.family}", start, SEQ, mbs * M, mbs, M, case.schedule, tuple(stages))
    loss_scaling = "dynamic" if case.dtype == "fp16" else None
    return replace(plan, dtype=case.dtype, loss_scaling=loss_scaling).validate(case.world)


def runtime(case: Case, plan: Plan | None = None, **config):
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    return PipelineRuntime(plan or build_plan(case), tiny_config(case.family, sum(case.blocks)),
                           RuntimeConfig(timeout_s=60, seed=7, grad_bucket_bytes=SMALL_BUCKET,
                                         **config))


def whole(t):
    """A tensor-parallel shard's whole tensor (the tensor itself elsewhere)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_and_compare(rank: int, case: Case) -> dict:
    """STEPS steps against one process; what the rank found wrong and what it ran."""
    from transformers import AutoModelForCausalLM
    rt = runtime(case)
    config = rt.stage.config
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    # lr 1e-3 as the other equivalence tests: larger magnifies last-bit differences past atol
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    errors: list[str] = []
    norms, launches = [], []
    batches = make_batches(config.vocab_size, seed=11, rows=rt.plan.global_batch_size)
    for i, b in enumerate(batches):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        if i == 0:  # every gradient before clipping, through forward_backward
            opt.zero_grad()
            loss = rt.forward_backward(b)
            for n, p in rt.stage.named_parameters():
                _compare(f"grad {n}", whole(p.grad), ref.get_parameter(n).grad, errors)
            norm = rt.clip_grad_norm_(0.5)
            rt.step_optimizer(opt)
        else:
            res = rt.train_step(b, opt, max_grad_norm=0.5)
            loss, norm = res.loss, res.grad_norm
        launches.append(rt.bucket_launch_s)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        norms.append(norm)
        _compare(f"step {i} loss", torch.tensor(loss, dtype=torch.float64),
                 ref_loss.detach().double(), errors)
        _compare(f"step {i} grad norm", torch.tensor(norm, dtype=torch.float64),
                 ref_norm.double(), errors)
    for n, p in rt.stage.named_parameters():
        _compare(f"param {n} after {STEPS} steps", whole(p.detach()),
                 ref.get_parameter(n).detach(), errors)
    _check_forward_only(rank, rt, ref, b, errors)
    out = {"errors": errors, "stages": sorted(rt.works), "norms": norms, "launches": launches,
           "actions": [str(a) for a in rt.work.actions], "max_live": rt.max_live_activations,
           "in_flight": rt.in_flight_limit, "optimizer": type(opt).__name__,
           "params": sum(1 for _ in rt.stage.parameters())}
    rt.shutdown()
    return out


def _params(rt) -> dict:
    # numpy copies: tensors would cross back to the parent through shared memory
    return {n: p.detach().numpy().copy() for n, p in rt.stage.named_parameters()}


def fp16_against_h1f1b(rank: int, case: Case) -> dict:
    """The same fp16 plan under zero_bubble and under H-1F1B (whose backward is whole), from a
    loss scale that overflows: the same skipped steps, losses and parameters."""
    out = {}
    for kind in ("zero_bubble", "h1f1b"):
        plan = build_plan(case)
        plan = plan.with_schedule(kind, plan.warmups())
        rt = runtime(case, plan, loss_scale_init=2.0 ** 17, loss_scale_growth_interval=1)
        opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        g = rt.plan.global_batch_size
        results = [rt.train_step(b, opt, max_grad_norm=0.5)
                   for seed in (3, 4) for b in make_batches(97, seed=seed, rows=g)]
        out[kind] = {"skipped": [r.skipped for r in results], "losses": [r.loss for r in results],
                     "params": _params(rt), "split": any("W" in str(a) for a in rt.work.actions)}
        rt.shutdown()
    return out


CASES = {
    2: [Case("gpt2-3|2", "gpt2", "zero_bubble", (3, 2), ((1,), (1,))),
        Case("llama-recompute-deferrals", "llama", "zero_bubble", (2, 2), ((1,), (1,)),
             warmups=(4, 1), deferrals=(1, 3), recompute=(0, 1))],
    4: [Case("gpt2-3:1-sharded|1|1", "gpt2", "zero_bubble", (1, 2, 1), ((3, 1), (4,), (4,)),
             sharded=(0,), recompute=(1,)),
        Case("llama-tp2|1:3-sharded", "llama", "zero_bubble", (2, 1), ((4,), (1, 3)),
             tp=(2, 1), sharded=(1,)),
        # a replicated last stage holding the tied head: its W's additions reach the buckets
        Case("gpt2-1|2:1:1", "gpt2", "zero_bubble", (1, 1), ((4,), (2, 1, 1)))],
}
FP16 = Case("llama-fp16", "llama", "zero_bubble", (1, 1), ((1,), (1,)), dtype="fp16")


def run_all(rank: int, world_size: int) -> dict:
    out = {c.name: train_and_compare(rank, c) for c in CASES[world_size]}
    if world_size == 2:
        out["fp16"] = fp16_against_h1f1b(rank, FP16)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return {w: [o.value for o in run_ranks(run_all, w, timeout_s=240)] for w in CASES}


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{c.name}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[case.name]
        assert r["params"] > 0, f"rank {rank} holds no parameters"
        assert not r["errors"], f"rank {rank} (stages {r['stages']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"
        # the lists really split the backward, and W is deferred where the plan says
        assert any(a.endswith(f"W{k}") for a in r["actions"] for k in range(M))
        assert not any("B" in a.replace("SEND_B", "").replace("RECV_B", "") for a in r["actions"])
        # a deferred W holds its micro-batch: the measured peak is what the list holds
        assert r["max_live"] == r["in_flight"], r


@pytest.mark.parametrize("world,case", [(w, c) for w, c in ALL if c.sharded],
                         ids=[f"{w}r-{c.name}" for w, c in ALL if c.sharded])
def test_sharded_stages_use_the_sharded_optimizer(results, world, case):
    plan = build_plan(case)
    for rank, per_rank in enumerate(results[world]):
        st = plan.stages_of_rank(rank)[0]
        want = "ShardedOptimizer" if st.optimizer == "sharded" else "AdamW"
        assert per_rank[case.name]["optimizer"] == want, (rank, per_rank[case.name]["optimizer"])


def test_deferrals_shape_the_lists(results):
    """Stage 1 of the LLaMA case defers its weight gradients by 3: its first W follows the
    fourth I."""
    acts = results[2][1]["llama-recompute-deferrals"]["actions"]
    computes = [a for a in acts if a[1] in "FIW" and not a[1:].startswith(("SEND", "RECV"))]
    first_w = next(i for i, a in enumerate(computes) if a[1] == "W")
    assert [a for a in computes[:first_w] if a[1] == "I"] == ["1I0", "1I1", "1I2", "1I3"]


def test_buckets_launch_during_the_last_weight_gradients(results):
    """The 2-wide first stage of the 4-rank GPT-2 case: with tiny buckets, some are on the
    wire before its last W ends (negative launch times)."""
    for rank in (0, 1):
        launches = results[4][rank]["gpt2-3:1-sharded|1|1"]["launches"]
        assert all(len(x) > 2 for x in launches), launches
        assert all(min(x) < 0 for x in launches), launches


def test_fp16_skips_and_ends_as_h1f1b(results):
    for rank, per_rank in enumerate(results[2]):
        zb, h = per_rank["fp16"]["zero_bubble"], per_rank["fp16"]["h1f1b"]
        assert zb["split"] and not h["split"]
        assert any(h["skipped"]) and not all(h["skipped"]), h["skipped"]  # both kinds of step
        assert zb["skipped"] == h["skipped"]
        # the split backward adds the same gradients in the same order: bit for bit
        assert zb["losses"] == h["losses"]
        for n, p in h["params"].items():
            assert (zb["params"][n] == p).all(), (rank, n)
