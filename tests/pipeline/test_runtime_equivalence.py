"""The pipeline trains exactly as one process would: loss, every gradient, three optimizer steps.

One spawn per world size runs every (model, partition, schedule) case; each rank compares its own
stage against a full single-process model built from the same seed on the same batches, and the
parametrised tests below report each case on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

MBS, M, SEQ, STEPS = 2, 4, 8, 3
RTOL, ATOL = 1e-5, 4e-5


def tiny_config(family: str, blocks: int):
    from transformers import GPT2Config, LlamaConfig
    if family == "gpt2":
        return GPT2Config(n_layer=blocks, n_embd=32, n_head=2, n_positions=32, vocab_size=97,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return LlamaConfig(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                       max_position_embeddings=32, tie_word_embeddings=False)


@dataclass(frozen=True)
class Layout:
    """A partition: blocks per stage and each stage's width (ranks)."""

    name: str
    blocks: tuple[int, ...]
    widths: tuple[int, ...]
    recompute: tuple[bool, ...] = ()
    """Stages built with activation checkpointing (default: none)."""


def make_plan(layout: Layout, schedule: str) -> Plan:
    n, stages, rank, start = len(layout.blocks), [], 0, 0
    for i, (b, w) in enumerate(zip(layout.blocks, layout.widths)):
        end = start + b + (i == 0) + (i == n - 1)  # the embedding and head are layers too
        stages.append(Stage.even(i, (start, end), "cpu", "cpu", tuple(range(rank, rank + w)),
                                 warmup=n - i, recompute=i in layout.recompute,
                                 micro_batch_size=MBS))
        start, rank = end, rank + w
    plan = Plan("tiny", start, SEQ, MBS * M, MBS, M, "1f1b", tuple(stages))
    if schedule == "h1f1b-w1":  # every stage one micro-batch deep: receives posted ahead of F
        return plan.with_schedule("h1f1b", [1] * n).validate()
    if schedule == "h1f1b":  # deeper than 1F1B, strictly falling, 1 on the last stage
        return plan.with_schedule("h1f1b", [min(M, 2 * (n - 1 - i) + 1)
                                            for i in range(n)]).validate()
    return plan.with_schedule(schedule).validate()


def make_batches(vocab: int, seed: int, rows: int = MBS * M) -> list:
    from hapt_hf.pipeline import Batch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1::3, -2:] = 0  # right padding on some samples
        labels = ids.masked_fill(mask == 0, -100)
        out.append(Batch(ids, labels, mask))
    return out


def _compare(tag: str, actual, expected, errors: list[str]) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        errors.append(f"{tag}: {str(e).splitlines()[:4]}")


class TransferLog:
    """Every point-to-point call this rank makes (set-up's and the lists'), with its group."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, str, int, int]] = []  # (group, op, peer, tag)
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "TransferLog":
        import torch.distributed as dist
        for op in ("send", "recv", "isend", "irecv"):
            real = self._saved[op] = getattr(dist, op)

            def call(tensor, peer=None, group=None, tag=0, _real=real, _op=op, **kw):
                self.calls.append((group, _op, peer, tag))
                return _real(tensor, peer, group, tag, **kw)
            setattr(dist, op, call)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist
        for op, real in self._saved.items():
            setattr(dist, op, real)

    def labelled(self, groups: dict) -> list[tuple[object, str, int, int]]:
        """The calls with each group named by its runtime key (boundary, forward?)."""
        names = {id(g): key for key, g in groups.items()}
        return [(names.get(id(g), "other"), op, peer, tag) for g, op, peer, tag in self.calls]


def run_case(rank: int, family: str, layout: Layout, schedule: str) -> dict:
    """One case on this rank: gradients after one iteration, parameters after STEPS steps."""
    with TransferLog() as log:
        out = _run_case(rank, family, layout, schedule, log)
    return out


def _run_case(rank: int, family: str, layout: Layout, schedule: str, log: TransferLog) -> dict:
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    config = tiny_config(family, sum(layout.blocks))
    plan = make_plan(layout, schedule)
    rt = PipelineRuntime(plan, config, RuntimeConfig(timeout_s=60, seed=7))
    set_up = len(log.calls)
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    batches = make_batches(config.vocab_size, seed=11)
    errors: list[str] = []
    norms: list[float] = []
    names = [n for n, _ in rt.stage.named_parameters()]

    # lr 1e-3: Adam divides by sqrt(v), so on near-zero gradients it magnifies the last-bit
    # differences that any change of summation order makes; a larger lr magnifies them past atol
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for i, b in enumerate(batches):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        if i == 0:  # gradients before clipping, through forward_backward
            opt.zero_grad()
            loss, norm = rt.forward_backward(b), None
            for n, p in rt.stage.named_parameters():
                _compare(f"grad {n}", p.grad, ref.get_parameter(n).grad, errors)
            norm = rt.clip_grad_norm_(0.5)
            opt.step()
        else:
            res = rt.train_step(b, opt, max_grad_norm=0.5)
            loss, norm = res.loss, res.grad_norm
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        norms.append(norm)
        _compare(f"step {i} loss", torch.tensor(loss, dtype=torch.float64),
                 ref_loss.detach().double(), errors)
        _compare(f"step {i} grad norm", torch.tensor(norm, dtype=torch.float64),
                 ref_norm.double(), errors)
    for n, p in rt.stage.named_parameters():
        _compare(f"param {n} after {STEPS} steps", p.detach(), ref.get_parameter(n).detach(),
                 errors)
    trained = len(log.calls)  # what follows gathers to rank 0 on the default group
    if schedule == "1f1b":  # forward-only paths, once per partition
        _check_forward_only(rank, rt, ref, batches[0], errors)
    for p in rt.stage.tied_parameters():  # both copies moved alike
        _compare("tied copy", p.detach(), ref.get_parameter("lm_head.weight").detach(), errors)
    from hapt_hf.planner.schedule import build_schedule
    early = build_schedule(rt.plan.schedule, rt.plan.num_stages, rt.plan.num_microbatches,
                           rt.plan.warmups(), early_receives=True)
    out = {"errors": errors, "params": len(names), "max_live": rt.max_live_activations,
           "in_flight": rt.in_flight_limit, "warmup": rt.stage_plan.warmup,
           "early_receives": rt.work.actions == early.actions[rt.stage_plan.index],
           "stage": rt.stage_plan.index, "norms": norms,
           "transfers": log.labelled(rt._transfer_pgs)[:trained], "set_up": set_up,
           "stages": [st.ranks for st in rt.plan.stages]}
    rt.shutdown()
    return out


def _check_forward_only(rank: int, rt, ref, b, errors: list[str]) -> None:
    """evaluate, predict_logits and gather_state_dict against the reference model."""
    with torch.no_grad():
        ref_out = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    _compare("evaluate", torch.tensor(rt.evaluate(b), dtype=torch.float64),
             ref_out.loss.double(), errors)
    logits, state = rt.predict_logits(b), rt.gather_state_dict()
    if rank == 0:
        _compare("logits", logits, ref_out.logits, errors)
        ref_state = ref.state_dict()
        if set(state) != set(ref_state):
            errors.append(f"state dict keys differ: {sorted(set(state) ^ set(ref_state))}")
        for k in set(state) & set(ref_state):
            _compare(f"state {k}", state[k], ref_state[k], errors)
    elif logits is not None or state is not None:
        errors.append("logits / state dict returned on a rank other than 0")


def bad_input_messages(world_size: int) -> dict:
    """The messages a user gets for a plan of the wrong size and a batch of the wrong shape."""
    from hapt_hf.pipeline import Batch, PipelineRuntime, RuntimeConfig
    from hapt_hf.pipeline.runtime import BatchError
    from hapt_hf.planner.plan import PlanError
    config = tiny_config("gpt2", 3)
    out = {}
    try:
        PipelineRuntime(make_plan(Layout("x", (1, 1, 1), (1, 1, 1)), "1f1b"), config)
    except PlanError as e:
        out["world"] = str(e)
    rt = PipelineRuntime(make_plan(Layout("x", (2, 1), (1, 1)), "1f1b"), config,
                         RuntimeConfig(timeout_s=60))
    try:
        rt.forward_backward(Batch(torch.zeros(3, SEQ, dtype=torch.long)))
    except BatchError as e:
        out["batch"] = str(e)
    rt.shutdown()
    return out


def accumulation_errors(rank: int, family: str, layout: Layout) -> list[str]:
    """Two forward_backward calls without zeroing add up, as two backward() calls would."""
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    config = tiny_config(family, sum(layout.blocks))
    rt = PipelineRuntime(make_plan(layout, "1f1b"), config, RuntimeConfig(timeout_s=60, seed=3))
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    errors: list[str] = []
    for b in make_batches(config.vocab_size, seed=5)[:2]:
        rt.forward_backward(b)
        ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss.backward()
    for n, p in rt.stage.named_parameters():
        _compare(f"accumulated grad {n}", p.grad, ref.get_parameter(n).grad, errors)
    rt.shutdown()
    return errors


def run_all(rank: int, world_size: int, cases: list) -> dict:
    out = {case_id(*c): run_case(rank, *c) for c in cases}
    if world_size == 2:
        out["bad_input"] = bad_input_messages(world_size)
    else:  # replicas and the tied group both take part
        out["accumulation"] = accumulation_errors(rank, "gpt2", FOUR[1])
    return out


def case_id(family: str, layout: Layout, schedule: str) -> str:
    return f"{family}-{layout.name}-{schedule}"


SCHEDULES = ("gpipe", "1f1b", "h1f1b")
TWO = [Layout("4+2", (4, 2), (1, 1))]
FOUR = [Layout("1+3+1+2", (1, 3, 1, 2), (1, 1, 1, 1), recompute=(1, 3)),
        Layout("w2-w1-w1", (2, 1, 2), (2, 1, 1)),
        Layout("w1-w2-w1", (1, 2, 1), (1, 2, 1))]
FAMILIES = ("gpt2", "llama")
CASES = {2: [(f, lay, s) for f in FAMILIES for lay in TWO for s in SCHEDULES]
         + [("gpt2", TWO[0], "h1f1b-w1")],
         4: [(f, lay, s) for f in FAMILIES for lay in FOUR[:2] for s in SCHEDULES]
         + [(f, FOUR[2], "1f1b") for f in FAMILIES] + [("llama", FOUR[0], "h1f1b-w1")]}


EXTRAS = ("bad_input", "accumulation")


@pytest.fixture(scope="module")
def results() -> dict:
    out = {}
    for world, cases in CASES.items():
        per_rank = run_ranks(run_all, world, cases, timeout_s=240)
        for o in per_rank:
            for cid, r in o.value.items():
                out[(cid, o.rank, world) if cid in EXTRAS else (cid, o.rank)] = r
    return out


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{case_id(*c)}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    cid = case_id(*case)
    for rank in range(world):
        r = results[(cid, rank)]
        assert r["params"] > 0, f"rank {rank} holds no parameters"
        assert not r["errors"], f"rank {rank} (stage {r['stage']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"



def test_gradient_accumulation_adds_up(results):
    for rank in range(4):
        errors = results[("accumulation", rank, 4)]
        assert not errors, f"rank {rank}: " + "\n".join(errors)


def test_bad_input_is_refused_with_the_fix(results):
    for rank in range(2):
        msgs = results[("bad_input", rank, 2)]
        assert "needs 3 processes but 2 were started" in msgs["world"], msgs
        assert "Batch.input_ids" in msgs["batch"] and "global_batch_size=8" in msgs["batch"], msgs


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{case_id(*c)}" for w, c in ALL])
def test_live_activations_within_schedule(results, world, case):
    cid = case_id(*case)
    for rank in range(world):
        r = results[(cid, rank)]
        # never above what the schedule lets the stage hold, and the counter really counts:
        # a 1F1B-style list reaches its warm-up depth exactly
        assert r["max_live"] <= r["in_flight"] == min(r["warmup"], M), r
        assert r["max_live"] == r["in_flight"], r
        assert r["early_receives"], r  # receives go up as soon as the sender may send


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{case_id(*c)}" for w, c in ALL])
def test_transfers_would_pair_up_on_nccl(results, world, case):
    """NCCL pairs a communicator's transfers in posting order, not by tag: on each group and
    pair of ranks the receiver posts the micro-batches in the order the sender sends them; each
    group carries one boundary one way; set-up made every pair's communicator before the lists
    (benchmarks/stream_order.py replays the lists themselves under NCCL's rules)."""
    cid = case_id(*case)
    stages = results[(cid, 0)]["stages"]
    stage_of = {r: i for i, ranks in enumerate(stages) for r in ranks}
    sent, received, opened = {}, {}, set()
    for rank in range(world):
        r = results[(cid, rank)]
        for i, (key, op, peer, tag) in enumerate(r["transfers"]):
            assert key != "other", f"rank {rank}: {op} to/from {peer} on no transfer group"
            send = op in ("send", "isend")
            src, dst = (rank, peer) if send else (peer, rank)
            boundary, forward = key
            assert (stage_of[src], stage_of[dst]) == ((boundary, boundary + 1) if forward
                                                      else (boundary + 1, boundary)), (key, src, dst)
            if i < r["set_up"]:
                opened.add((key, src, dst, send))
                continue
            assert (key, src, dst, send) in opened, f"{key} {src}->{dst} not made at set-up"
            (sent if send else received).setdefault((key, src, dst), []).append(tag)
    assert sent and sent == received

