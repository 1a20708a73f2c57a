"""A 2-process pipeline cut inside a transformer block (layer_unit="half") trains as one process."""
from __future__ import annotations

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from benchmarks.chain_check import tiny_config as generic_config
from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import (MBS, SEQ, M, _compare,
                                                     make_batches, tiny_config)

pytestmark = pytest.mark.multiproc

BLOCKS = 3
# [embedding, b0.attn, b0.mlp, b1.attn | b1.mlp, b2.attn, b2.mlp, head]: block 1 is cut in two
CUT = 4
FAMILIES = ("gpt2", "llama", "qwen3")


def half_plan() -> Plan:
    layers = 2 * BLOCKS + 2
    stages = (Stage.even(0, (0, CUT), "cpu", "cpu", (0,), warmup=2, micro_batch_size=MBS),
              Stage.even(1, (CUT, layers), "cpu", "cpu", (1,), warmup=1, micro_batch_size=MBS))
    return Plan("tiny", layers, SEQ, MBS * M, MBS, M, "1f1b", stages,
                layer_unit="half").validate()


def run_family(rank: int, family: str) -> dict:
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    # qwen3: no hand-written family, cut by the generic stage builder
    config = generic_config(family, BLOCKS) if family == "qwen3" else tiny_config(family, BLOCKS)
    rt = PipelineRuntime(half_plan(), config, RuntimeConfig(timeout_s=60, seed=7))
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    errors: list[str] = []
    batches = make_batches(config.vocab_size, seed=11)[:2]
    opt = torch.optim.SGD(rt.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    names = [n for n, _ in rt.stage.named_parameters()]
    for i, b in enumerate(batches):
        ref_opt.zero_grad()
        ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        ref_loss.backward()
        opt.zero_grad()
        loss = rt.forward_backward(b)
        _compare(f"step {i} loss", torch.tensor(loss, dtype=torch.float64),
                 ref_loss.detach().double(), errors)
        for n, p in rt.stage.named_parameters():
            _compare(f"step {i} grad {n}", p.grad, ref.get_parameter(n).grad, errors)
        opt.step()
        ref_opt.step()
    out = {"errors": errors, "names": names}
    rt.shutdown()
    return out


def run_all(rank: int, world_size: int) -> dict:
    del world_size
    return {family: run_family(rank, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(run_all, 2, timeout_s=240)


@pytest.mark.parametrize("family", FAMILIES)
def test_half_cut_matches_single_process(results, family):
    split = {"gpt2": ("transformer.h.1.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"),
             "llama": ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    split["qwen3"] = split["llama"]
    attn_key, mlp_key = split[family]
    by_rank = {o.rank: o.value[family] for o in results}
    for rank, r in by_rank.items():
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"])
    # block 1's attention half is on stage 0 only and its MLP half on stage 1 only
    assert attn_key in by_rank[0]["names"] and attn_key not in by_rank[1]["names"]
    assert mlp_key in by_rank[1]["names"] and mlp_key not in by_rank[0]["names"]
