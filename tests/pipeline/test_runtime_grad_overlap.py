"""The replica gradient all-reduce overlapped with the last backward: same gradients, and it
really overlaps.

Three Gloo processes: a 2-wide first stage (the embedding, tied to the head for GPT-2) and a
1-wide last stage. Buckets are made tiny so that even this small model fills several of them.
"""
from __future__ import annotations

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import (Layout, _compare, make_batches, make_plan,
                                                     tiny_config)

pytestmark = pytest.mark.multiproc

SMALL_BUCKET = 4096  # bytes: a block of this tiny model spans several buckets
LAYOUTS = {"plain": Layout("w2-w1", (2, 1), (2, 1)),
           "recompute": Layout("w2-w1-rc", (2, 1), (2, 1), recompute=(0,))}
# (family, layout, overlap, freeze): "freeze" freezes the attention weights between the two
# iterations, as LoRA through the recipe changes what trains after the runtime is built
CASES = [("gpt2", "plain", True, False), ("gpt2", "plain", False, False),
         ("llama", "recompute", True, False), ("llama", "recompute", False, False),
         ("gpt2", "plain", True, True)]


def case_id(family: str, layout: str, overlap: bool, freeze: bool) -> str:
    return f"{family}-{layout}-overlap_{'on' if overlap else 'off'}{'-freeze' if freeze else ''}"


def run_case(family: str, layout: str, overlap: bool, freeze: bool) -> dict:
    """Gradients of one iteration, then of a second one added to them (accumulation), against
    a single-process model; and when each bucket was launched."""
    from transformers import AutoModelForCausalLM

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    lay = LAYOUTS[layout]
    config = tiny_config(family, sum(lay.blocks))
    rt = PipelineRuntime(make_plan(lay, "1f1b"), config,
                         RuntimeConfig(timeout_s=60, seed=5, overlap_grad_sync=overlap,
                                       grad_bucket_bytes=SMALL_BUCKET))
    torch.manual_seed(5)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    errors: list[str] = []
    launches = []
    for i, b in enumerate(make_batches(config.vocab_size, seed=13)[:2]):
        if i == 1 and freeze:
            for n, p in rt.stage.named_parameters():
                p.grad = ref.get_parameter(n).grad = None
                if "attn" in n:
                    p.requires_grad_(False)
                    ref.get_parameter(n).requires_grad_(False)
        rt.forward_backward(b)  # the second call adds to the first one's gradients
        launches.append(rt.bucket_launch_s)
        ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss.backward()
        for n, p in rt.stage.named_parameters():
            want = ref.get_parameter(n).grad
            if p.grad is None or want is None:
                if (p.grad is None) != (want is None):
                    errors.append(f"iteration {i} grad {n}: {p.grad is None=} {want is None=}")
                continue
            _compare(f"iteration {i} grad {n}", p.grad, want, errors)
    frozen = [n for n, p in rt.stage.named_parameters() if not p.requires_grad]
    if freeze and not (frozen and all(rt.stage.get_parameter(n).grad is None for n in frozen)):
        errors.append(f"frozen parameters {frozen} should exist and hold no gradient")
    out = {"errors": errors, "launches": launches, "stage": rt.stage_plan.index,
           "width": rt.stage_plan.width}
    rt.shutdown()
    return out


def run_all(rank: int, world_size: int) -> dict:
    del rank, world_size
    return {case_id(*c): run_case(*c) for c in CASES}


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(run_all, 3, timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=[case_id(*c) for c in CASES])
def test_gradients_match_single_process_with_and_without_overlap(results, case):
    for o in results:
        r = o.value[case_id(*case)]
        assert not r["errors"], f"rank {o.rank} (stage {r['stage']}): " + "\n".join(r["errors"])


@pytest.mark.parametrize("case", CASES, ids=[case_id(*c) for c in CASES])
def test_buckets_launch_during_the_last_backward_only_with_overlap(results, case):
    overlap = case[2]
    for o in results:
        r = o.value[case_id(*case)]
        for launches in r["launches"]:
            if r["width"] == 1:  # nothing to all-reduce among replicas
                assert launches == [], r
                continue
            assert len(launches) > 2, f"rank {o.rank}: the tiny buckets should be several"
            if overlap:  # the first bucket went out while the last backward still ran
                assert launches[0] < 0, f"rank {o.rank}: first bucket after the backward"
            else:
                assert min(launches) >= 0, f"rank {o.rank}: a bucket launched in the backward"


def test_bucket_size_must_be_positive():
    from hapt_hf.pipeline import RuntimeConfig
    from hapt_hf.pipeline.runtime import RuntimeSetupError
    with pytest.raises(RuntimeSetupError, match="RuntimeConfig.grad_bucket_bytes"):
        RuntimeConfig(grad_bucket_bytes=0)


def test_runtime_and_cost_model_share_the_bucket_size():
    from hapt_hf.pipeline import RuntimeConfig
    from hapt_hf.planner.cost_model import GRAD_BUCKET_BYTES
    assert RuntimeConfig().grad_bucket_bytes == GRAD_BUCKET_BYTES == 25 * 2**20
