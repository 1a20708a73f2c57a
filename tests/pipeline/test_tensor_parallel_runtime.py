"""Replicas held by several ranks (tensor parallelism) train exactly as one process would.

Each case trains STEPS clipped AdamW steps on Gloo ranks and compares, on every rank, the
loss, the global gradient norm and every gradient of its stage after every step (the shards
gathered whole), every parameter after the steps, ``evaluate``, the gathered logits and state
dict, and gradients accumulated over two iterations,
with one process training the whole model on the same global batches. Cases: TP 2 and 4
inside one stage; stages of different TP degrees (1 -> 2 -> 4 on 7 ranks, 2 -> 1, 1 -> 2);
two and three TP replicas taking uneven shares; tied embeddings across TP stages; block halves and
activation checkpointing on a TP stage; LLaMA, Qwen3 and Mistral. fp16's overflow decision
is one for the whole job. Tolerance: rtol 1e-5, atol 4e-5 in fp32, as the pipeline's other equivalence tests
(the row-wise all-reduce changes the summation order of the projections' outputs; no case
needed more).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import SEQ, STEPS, TransferLog, _compare, make_batches

pytestmark = pytest.mark.multiproc

M = 2  # micro-batches per step


def tiny_config(family: str, blocks: int, tied: bool = False):
    """Four heads, MLP width 64; LLaMA four key/value heads (TP 4 divides them), Qwen3 and
    Mistral two (grouped-query attention under TP 2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config
    common = dict(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, vocab_size=97, max_position_embeddings=32,
                  tie_word_embeddings=tied)
    if family == "llama":
        return LlamaConfig(num_key_value_heads=4, **common)
    if family == "qwen3":
        return Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    if family == "mistral":
        return MistralConfig(num_key_value_heads=2, **common)
    from benchmarks.chain_check import tiny_config as chain_config  # 4 heads, 2 key/value heads
    config = chain_config(family, blocks)
    config.tie_word_embeddings = tied
    return config


@dataclass(frozen=True)
class Case:
    """Blocks per stage, each stage's replica shares and the ranks holding each replica."""

    name: str
    family: str
    blocks: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]
    tp: tuple[int, ...]
    tied: bool = False
    unit: str = "block"
    """``half``: ``blocks`` counts block halves (attention, MLP) per stage."""
    recompute: tuple[int, ...] = ()
    """Stages built with activation checkpointing."""

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks) // (2 if self.unit == "half" else 1)

    def projections(self, stage: int) -> int:
        """The DTensor parameters of a TP stage: q, k, v, o per attention, gate, up, down per
        MLP (Apertus: no gate; StarCoder2: c_fc, c_proj, and a bias to each)."""
        if self.unit == "block":
            return {"apertus": 6, "starcoder2": 12}.get(self.family, 7) * self.blocks[stage]
        first = sum(self.blocks[:stage])  # halves before: even ones are attention halves
        return sum(4 if h % 2 == 0 else 3 for h in range(first, first + self.blocks[stage]))

    @property
    def world(self) -> int:
        return sum(len(s) * t for s, t in zip(self.shares, self.tp))

    def plan(self) -> Plan:
        n, stages, rank, start = len(self.blocks), [], 0, 0
        mbs = sum(self.shares[0])
        for i, (b, shares, t) in enumerate(zip(self.blocks, self.shares, self.tp)):
            end = start + b + (i == 0) + (i == n - 1)  # the embedding and head are layers too
            reps = []
            for s in shares:
                reps.append(Replica("cpu", "cpu", s, tuple(range(rank, rank + t))))
                rank += t
            stages.append(Stage(i, (start, end), tuple(reps), warmup=n - i,
                                recompute=i in self.recompute))
            start = end
        return Plan(f"tiny-{self.family}", start, SEQ, mbs * M, mbs, M, "1f1b", tuple(stages),
                    layer_unit=self.unit).validate(self.world)


CASES = {
    3: [Case("tp2|1-tied", "llama", (1, 1), ((2,), (2,)), (2, 1), tied=True),
        Case("1|tp2-qwen3", "qwen3", (1, 2), ((2,), (2,)), (1, 2)),
        # emb, block 0, block 1's attention | block 1's MLP, head
        Case("tp2-halves-recompute|1", "llama", (3, 1), ((2,), (2,)), (2, 1), unit="half",
             recompute=(0,)),
        # a learnable MLP activation its plan leaves unmarked: its gradient summed all the same
        Case("tp2|1-apertus", "apertus", (1, 1), ((2,), (2,)), (2, 1)),
        # row-wise projections with a bias: a DTensor whole on each rank, counted once
        Case("1|tp2-starcoder2-tied", "starcoder2", (1, 1), ((2,), (2,)), (1, 2), tied=True)],
    4: [Case("tp4", "llama", (2,), ((2,),), (4,)),
        Case("tp2x2-3:1", "mistral", (2,), ((3, 1),), (2,)),
        Case("tp2|tp2-qwen3-tied", "qwen3", (1, 1), ((2,), (2,)), (2, 2), tied=True)],
    7: [Case("1|tp2|tp4", "llama", (1, 1, 1), ((2,), (2,), (2,)), (1, 2, 4)),
        # three TP-2 replicas taking 1:2:1 of what one rank sends, tied to its embedding
        Case("1|tp2x3-1:2:1-tied", "llama", (1, 1), ((4,), (1, 2, 1)), (1, 2), tied=True)],
}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_case(rank: int, case: Case) -> dict:
    """STEPS steps against one process; what this rank found wrong, and the point-to-point
    calls of its set-up and first step."""
    with TransferLog() as log:
        return _train_case(rank, case, log)


def _train_case(rank: int, case: Case, log: TransferLog) -> dict:
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    config = tiny_config(case.family, case.num_blocks, case.tied)
    rt = PipelineRuntime(case.plan(), config, RuntimeConfig(timeout_s=60, seed=7))
    set_up = len(log.calls)
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    # lr 1e-3, as the other equivalence tests: larger magnifies last-bit differences past atol
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    errors: list[str] = []
    norms = []
    batches = make_batches(config.vocab_size, seed=11, rows=rt.plan.global_batch_size)
    for i, b in enumerate(batches):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        res = rt.train_step(b, opt, max_grad_norm=0.5)
        if i == 0:
            transfers = log.labelled(rt._transfer_pgs)
        for n, p in rt.stage.named_parameters():  # clipped alike; the step has not zeroed them
            _compare(f"step {i} grad {n}", _full(p.grad), ref.get_parameter(n).grad, errors)
        ref_opt.step()
        norms.append(res.grad_norm)
        _compare(f"step {i} loss", torch.tensor(res.loss, dtype=torch.float64),
                 ref_loss.detach().double(), errors)
        _compare(f"step {i} grad norm", torch.tensor(res.grad_norm, dtype=torch.float64),
                 ref_norm.double(), errors)
    sharded = 0
    for n, p in rt.stage.named_parameters():
        sharded += hasattr(p, "full_tensor")
        _compare(f"param {n} after {STEPS} steps", _full(p.detach()),
                 ref.get_parameter(n).detach(), errors)
    with torch.no_grad():
        ref_eval = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
    _compare("evaluate", torch.tensor(rt.evaluate(b), dtype=torch.float64), ref_eval.double(),
             errors)
    logits, state = rt.predict_logits(b), rt.gather_state_dict()
    if rank == 0:
        with torch.no_grad():
            ref_logits = ref(b.input_ids, attention_mask=b.attention_mask).logits
        _compare("logits", logits, ref_logits, errors)
        ref_state = ref.state_dict()
        if set(state) != set(ref_state):
            errors.append(f"state dict keys differ: {sorted(set(state) ^ set(ref_state))}")
        for k in set(state) & set(ref_state):
            _compare(f"state {k}", state[k], ref_state[k], errors)
    # two iterations accumulated without zeroing add up, as two backward() calls would
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    for b in batches[:2]:
        rt.forward_backward(b)
        ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss.backward()
    for n, p in rt.stage.named_parameters():
        _compare(f"accumulated grad {n}", _full(p.grad), ref.get_parameter(n).grad, errors)
    out = {"errors": errors, "stage": rt.stage_plan.index, "norms": norms, "sharded": sharded,
           "tp": rt.work.tp, "partial": 0 if rt.tp is None else len(rt.tp.partial),
           "transfers": transfers, "set_up": set_up}
    rt.shutdown()
    return out


def refusal(rank: int) -> str | None:
    """What a rank is told for a TP plan of a model without a tensor-parallel plan (GPT-2)."""
    from transformers import GPT2Config

    from hapt_hf.pipeline import PipelineRuntime
    from hapt_hf.pipeline.runtime import RuntimeSetupError
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    try:
        PipelineRuntime(CASES[3][0].plan(), config).shutdown()
    except RuntimeSetupError as e:
        return str(e)
    return None


def fp16_skips(rank: int) -> list[bool]:
    """fp16 with dynamic loss scaling from a scale the tiny model's gradients overflow at
    within a few steps: which steps this rank skipped."""
    from dataclasses import replace

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    case = CASES[3][0]
    plan = replace(case.plan(), dtype="fp16", loss_scaling="dynamic")
    rt = PipelineRuntime(plan, tiny_config(case.family, case.num_blocks, case.tied),
                         RuntimeConfig(timeout_s=60, seed=7, loss_scale_init=2.0 ** 17,
                                       loss_scale_growth_interval=1))
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3)
    out = [rt.train_step(b, opt, max_grad_norm=0.5).skipped for seed in (3, 4)
           for b in make_batches(97, seed=seed, rows=plan.global_batch_size)]
    rt.shutdown()
    return out


def run_all(rank: int, world_size: int) -> dict:
    out = {c.name: train_case(rank, c) for c in CASES[world_size]}
    if world_size == 3:
        out["refusal"] = refusal(rank)
        out["fp16"] = fp16_skips(rank)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return {w: [o.value for o in run_ranks(run_all, w, timeout_s=240)] for w in CASES}


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{c.name}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    plan = case.plan()
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[case.name]
        assert not r["errors"], f"rank {rank} (stage {r['stage']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"
        st = plan.stages[r["stage"]]
        assert r["tp"] == st.tp
        # and the head of an untied TP last stage, split by vocabulary rows (core/tp.head_sharded)
        head = st.tp > 1 and st.index == len(case.blocks) - 1 and not case.tied
        assert r["sharded"] == (case.projections(st.index) + head if st.tp > 1 else 0), r
        # whole parameters summed over the replica: q_norm, k_norm (marked in the plan), and
        # Apertus' activation's two (beside its sharded projections, unmarked)
        partial = {"qwen3": 2, "apertus": 4}.get(case.family, 0) * case.blocks[st.index]
        assert r["partial"] == (partial if st.tp > 1 else 0), r


@pytest.mark.parametrize("world,case", [(w, c) for w, c in ALL if len(c.blocks) > 1],
                         ids=[f"{w}r-{c.name}" for w, c in ALL if len(c.blocks) > 1])
def test_transfers_pair_the_tp_ranks_and_would_pair_up_on_nccl(results, world, case):
    """Every transfer of the first step goes over its boundary's group for its direction,
    between the ranks the TP pairing names (the placement's pieces), in the same micro-batch
    order on both sides, over a pair that set-up opened; every receiving TP rank gets each
    micro-batch from the pairing's rank."""
    from hapt_hf.pipeline.placement import rank_work
    plan = case.plan()
    works = {r: rank_work(plan, r) for r in range(case.world)}
    sent, received, opened = {}, {}, set()
    for rank in range(case.world):
        r = results[world][rank][case.name]
        for i, (key, op, peer, tag) in enumerate(r["transfers"]):
            assert key != "other", f"rank {rank}: {op} to/from {peer} on no transfer group"
            send = op in ("send", "isend")
            src, dst = (rank, peer) if send else (peer, rank)
            boundary, forward = key
            w = works[dst]  # the receiver's pieces name the sender
            pieces = w.upstream if forward else w.downstream_grads
            assert src in [p.peer for p in pieces], (key, src, dst)
            if i < r["set_up"]:
                opened.add((key, src, dst, send))
                continue
            assert (key, src, dst, send) in opened, f"{key} {src}->{dst} not made at set-up"
            (sent if send else received).setdefault((key, src, dst), []).append(tag)
    assert sent and sent == received
    for rank, w in works.items():  # every receiving rank heard from every piece's peer
        for forward, pieces in ((True, w.upstream), (False, w.downstream_grads)):
            b = w.stage.index - 1 if forward else w.stage.index
            for p in pieces:
                assert received[((b, forward), p.peer, rank)] == list(range(M)), (rank, p)


def test_fp16_overflow_is_one_decision_for_the_job(results):
    """Every rank (both TP ranks of the first stage, the last stage) skips the same steps."""
    skips = [per_rank["fp16"] for per_rank in results[3]]
    assert any(skips[0]) and not all(skips[0]), skips[0]  # both kinds happened
    assert all(s == skips[0] for s in skips), skips


def test_a_model_without_a_tensor_parallel_plan_is_refused_naming_it(results):
    for msg in (per_rank["refusal"] for per_rank in results[3]):
        assert msg is not None
        assert "stage 0" in msg and "'gpt2' has no tensor-parallel plan" in msg, msg
        assert "base_model_tp_plan" in msg and "one rank per replica" in msg, msg


BOUND_S = 6.0  # RuntimeConfig.timeout_s of the failure run


def killed_at_second_forward(rank: int, world_size: int, victim: int) -> dict:
    """One good iteration on TP 2 | 1, then one where ``victim`` (TP rank 1 of stage 0) is
    SIGKILLed at its second forward: its TP partner is blocked in an all-reduce of that
    forward, not in a transfer."""
    import os
    import signal
    import time

    from hapt_hf.pipeline import PipelineFailure, PipelineRuntime, RuntimeConfig
    case = CASES[3][0]
    rt = PipelineRuntime(case.plan(), tiny_config(case.family, case.num_blocks, case.tied),
                         RuntimeConfig(timeout_s=BOUND_S))
    batch = make_batches(97, seed=1, rows=rt.plan.global_batch_size)[0]
    rt.forward_backward(batch)
    calls = []

    def kill(module, args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == victim:
        rt.stage.register_forward_pre_hook(kill)
    start = time.monotonic()
    try:
        rt.forward_backward(batch)
    except PipelineFailure as e:
        return {"message": str(e), "elapsed": time.monotonic() - start}
    return {"message": None, "elapsed": time.monotonic() - start}


def test_a_killed_tp_rank_is_named_by_its_partner_and_the_next_stage():
    import signal
    outs = run_ranks(killed_at_second_forward, 3, 1, timeout_s=120, pg_timeout_s=BOUND_S,
                     check=False)
    assert outs[1].exitcode == -signal.SIGKILL
    assert outs[0].ok, outs[0].error
    msg = outs[0].value["message"]
    assert msg is not None and msg.startswith("rank 1 stopped answering"), msg
    assert "while rank 0 (stage 0) was in F (stage 0, micro-batch 1) with its tensor-parallel " \
        "ranks [0, 1]" in msg, msg
    assert outs[0].value["elapsed"] < BOUND_S, outs[0].value
    # rank 2, blocked in a receive from live rank 0, returns the record or its watchdog ends
    # it (exit 1) printing it
    tail = outs[2].value["message"] if outs[2].ok else outs[2].stderr_tail
    assert outs[2].ok or outs[2].exitcode == 1, outs[2]
    assert "rank 1 stopped answering" in tail and "rank 0 stopped" not in tail, tail
