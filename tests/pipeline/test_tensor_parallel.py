"""Tensor parallelism without processes: which ranks trade which samples between stages of any
widths, shares and TP degrees; the transfers' order under NCCL's rules; the model's plan read
onto a stage; the refusals."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from hapt_hf.core.shares import slices
from hapt_hf.pipeline.placement import rank_work
from hapt_hf.pipeline.tensor_parallel import stage_tp_plan, tp_plan_refusal
from hapt_hf.planner.plan import Plan, Replica, Stage
from benchmarks.stream_order import plan_in_order_hazard


def _plan(stages: list[tuple[tuple[int, ...], int]], mbs: int, kind: str = "1f1b",
          m: int = 2, blocks: int = 1) -> Plan:
    """Stages of ``blocks`` blocks each, given as (replica shares, TP degree); ranks in order."""
    out, rank, start, n = [], 0, 0, len(stages)
    for i, (shares, t) in enumerate(stages):
        end = start + blocks + (i == 0) + (i == n - 1)
        reps = []
        for s in shares:
            reps.append(Replica("g", "cpu", s, tuple(range(rank, rank + t))))
            rank += t
        out.append(Stage(i, (start, end), tuple(reps), warmup=n - i))
        start = end
    return Plan("tiny", start, 8, mbs * m, mbs, m, kind, tuple(out)).validate()


@st.composite
def stage_specs(draw, mbs: int, count: int):
    out = []
    for _ in range(count):
        width = draw(st.integers(1, min(3, mbs)))
        cuts = sorted(draw(st.lists(st.integers(1, mbs - 1), min_size=width - 1,
                                    max_size=width - 1, unique=True))) if width > 1 else []
        bounds = [0, *cuts, mbs]
        out.append((tuple(b - a for a, b in zip(bounds, bounds[1:])), draw(st.integers(1, 4))))
    return out


def _owner(plan: Plan, s: int, sample: int) -> int:
    """The replica of stage ``s`` owning ``sample`` of a micro-batch."""
    bounds = slices(plan.stages[s].shares(plan.micro_batch_size))
    return next(i for i, (lo, hi) in enumerate(bounds) if lo <= sample < hi)


def _trades(plan: Plan, field: str) -> set[tuple[int, int, int]]:
    """(rank, peer, sample) of every piece in ``field`` of every rank's work."""
    out = set()
    for s in plan.stages:
        for r in s.ranks:
            w = rank_work(plan, r)
            for p in getattr(w, field):
                out |= {(r, p.peer, w.samples[0] + i) for i in range(p.start, p.stop)}
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data(), mbs=st.integers(1, 6))
def test_every_sample_reaches_every_tp_rank_exactly_once_each_way(data, mbs):
    """For any two neighbouring stages' widths, shares and TP degrees: every rank of a replica
    receives each of its samples exactly once, from the rank of the owning replica the pairing
    names (activations: receiver TP rank j from sender TP rank j mod t_s; gradients: sender TP
    rank i from receiver TP rank i mod t_r), and what is sent is exactly what is received."""
    plan = _plan(data.draw(stage_specs(mbs, 2)), mbs)
    up, down = plan.stages
    for direction, (src, dst, recv_field, send_field) in {
            "activations": (up, down, "upstream", "downstream"),
            "gradients": (down, up, "downstream_grads", "upstream_grads")}.items():
        received = _trades(plan, recv_field)
        sent = {(peer, r, x) for r, peer, x in _trades(plan, send_field)}
        assert sent == received, direction
        for rep_i, rep in enumerate(dst.replicas):
            lo, hi = slices(dst.shares(mbs))[rep_i]
            for j, r in enumerate(rep.ranks):
                got = sorted((x, peer) for me, peer, x in received if me == r)
                assert [x for x, _ in got] == list(range(lo, hi)), (direction, r, got)
                for x, peer in got:
                    owner = src.replicas[_owner(plan, src.index, x)].ranks
                    assert peer == owner[j % len(owner)], (direction, r, x, peer)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), mbs=st.integers(1, 4), m=st.integers(1, 5),
       kind=st.sampled_from(["gpipe", "1f1b", "h1f1b"]), streams=st.sampled_from(["pair", "group"]))
def test_the_transfers_of_tp_plans_finish_on_nccl(data, n, mbs, m, kind, streams):
    """Every rank of every replica runs its stage's list, one transfer per piece to the rank
    the pairing names, on the groups of each boundary and direction, and a TP replica's ranks
    run each compute together (its all-reduces): no hang, every receive gets its own
    micro-batch (benchmarks/stream_order.py)."""
    plan = _plan(data.draw(stage_specs(mbs, n)), mbs, kind, m)
    assert plan_in_order_hazard(plan, streams=streams) is None


def test_the_replay_over_global_ranks_still_finds_a_hang():
    """The same replay with every transfer on one group hangs a 1F1B TP plan, as it hangs the
    plain lists (so the property above can fail)."""
    plan = _plan([((2,), 2), ((1, 1), 2)], 2, "1f1b", 4)
    assert plan_in_order_hazard(plan) is None
    assert plan_in_order_hazard(plan, groups="one") is not None


def _llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97, **kw)


def test_the_models_plan_lands_on_the_stages_own_modules():
    from hapt_hf.pipeline.stage import build_stage
    config = _llama()
    stage = build_stage(config, (2, 4))  # block 1 and the head
    plan = stage_tp_plan(stage, config)
    assert plan == {f"model.layers.1.{k.split('.', 2)[2]}": v
                    for k, v in config.base_model_tp_plan.items()}
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **config.base_model_tp_plan}
    assert stage_tp_plan(build_stage(config, (0, 2)), config) == {  # the embedding stays whole
        f"model.layers.0.{k.split('.', 2)[2]}": v for k, v in _llama().base_model_tp_plan.items()}
    half = build_stage(config, (4, 6), layer_unit="half")  # block 1's MLP half, the head
    assert stage_tp_plan(half, config) == {"model.layers.1.mlp.gate_proj": "colwise",
                                           "model.layers.1.mlp.up_proj": "colwise",
                                           "model.layers.1.mlp.down_proj": "rowwise"}


def test_refusals_name_the_reason():
    from transformers import GPT2Config
    assert tp_plan_refusal(GPT2Config(), 1) is None
    msg = tp_plan_refusal(GPT2Config(), 2)
    assert "'gpt2' has no tensor-parallel plan" in msg and "one rank per replica" in msg
    assert "does not divide the model's key/value heads 2" in tp_plan_refusal(_llama(), 4)
    assert tp_plan_refusal(_llama(), 2) is None
    odd = _llama()
    odd.base_model_tp_plan = {**odd.base_model_tp_plan, "layers.*.mlp.up_proj": "colwise_rep"}
    msg = tp_plan_refusal(odd, 2)
    assert "uses the style(s) 'colwise_rep' (layers.*.mlp.up_proj), which hapt_hf does not run" in msg
    odd.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}  # nothing inside the blocks
    assert "shards nothing inside the blocks" in tp_plan_refusal(odd, 2)
    # entries outside the blocks are left out: the embedding stays whole
    odd.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **_llama().base_model_tp_plan}
    assert tp_plan_refusal(odd, 2) is None


@pytest.mark.parametrize("t", [2, 4])
def test_pairing_between_a_replica_and_wider_tp(t):
    """1 -> t: the one sender feeds every TP rank; t -> 1: TP rank 0 alone sends, and the one
    receiver's gradients go back to every TP rank."""
    one_to_t = _plan([((1,), 1), ((1,), t)], 1)
    assert [p.peer for p in rank_work(one_to_t, 0).downstream] == list(range(1, t + 1))
    assert [p.peer for p in rank_work(one_to_t, 0).downstream_grads] == [1]
    t_to_one = _plan([((1,), t), ((1,), 1)], 1)
    assert [len(rank_work(t_to_one, r).downstream) for r in range(t)] == [1] + [0] * (t - 1)
    assert [p.peer for p in rank_work(t_to_one, t).upstream_grads] == list(range(t))
