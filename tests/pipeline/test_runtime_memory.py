"""The runtime's two memory levers on Gloo ranks: partial recompute (plan.json
``recompute_layers``: a stage's first k blocks recompute) trains exactly as one process would,
and the 16-bit weight casts shared by a step's micro-batches leave training bit for bit as it
was.

Partial recompute: ``train_case`` of the tensor-parallel equivalence test (STEPS clipped AdamW
steps; every loss, gradient norm and gradient, every parameter after the steps, evaluate, the
gathered logits and state dict, gradients accumulated over two iterations, against one process;
rtol 1e-5, atol 4e-5 in fp32) on a two-stage 1F1B pipeline, the same under zero_bubble, a
TP-2 stage with sequence parallelism, and two ranks interleaved, two chunks each (the stages'
k handed to their chunks). Shared casts: the same bf16 / fp16 plans trained with
them and with each micro-batch's own casts (as before they were shared) give the same losses
and parameters bit for bit, and the runtime did share (its count of casts it kept as an
earlier micro-batch's).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan
from tests.pipeline.test_runtime_equivalence import make_batches
from tests.pipeline.test_sequence_parallel_runtime import SpCase
from tests.pipeline.test_tensor_parallel_runtime import M, tiny_config, train_case

pytestmark = pytest.mark.multiproc

WEIGHTS_PER_BLOCK = 7  # LLaMA: q, k, v, o, gate, up, down


@dataclass(frozen=True)
class PartialCase(SpCase):
    partial: tuple[int, ...] = ()
    """Per stage: its first k blocks recompute (``recompute_layers``)."""
    dtype: str = "fp32"

    def plan(self) -> Plan:
        if self.virtual > 1:  # the stages' k handed to their chunks by Plan.interleave
            return replace(self, virtual=1).plan().interleave(self.virtual).validate(self.world)
        p = super().plan()
        stages = tuple(replace(s, recompute_layers=k) for s, k in zip(p.stages, self.partial))
        loss_scaling = "dynamic" if self.dtype == "fp16" else None
        return replace(p, stages=stages, dtype=self.dtype,
                       loss_scaling=loss_scaling).validate(self.world)


PARTIAL = [PartialCase("1|1-partial", "llama", (3, 2), ((2,), (2,)), (1, 1), partial=(2, 1)),
           PartialCase("1|1-partial-zero-bubble", "llama", (2, 2), ((2,), (2,)), (1, 1),
                       partial=(1, 1), schedule="zero_bubble"),
           PartialCase("tp2-sp-partial", "llama", (3,), ((2,),), (2,), sp=(0,), partial=(1,)),
           # rank 0: emb, b0 (all recomputed) and b3, b4 (b3 recomputed); rank 1: b1, b2 (b1
           # recomputed) and b5, head
           PartialCase("interleaved-partial", "llama", (3, 3), ((2,), (2,)), (1, 1),
                       partial=(2, 1), virtual=2)]
SHARED = [replace(PARTIAL[0], name="1|1-partial-bf16", dtype="bf16"),
          replace(PARTIAL[1], name="1|1-partial-zero-bubble-fp16", dtype="fp16"),
          # every forward before the first backward: both micro-batches in flight at once
          replace(PARTIAL[2], name="tp2-sp-partial-gpipe-bf16", dtype="bf16", schedule="gpipe")]


def _own_casts(lend_frozen: bool = True) -> None:
    return None  # each micro-batch keeps its own casts, as before they were shared


def train_shared_and_own(rank: int, case: PartialCase, prepare=None,
                         opt_kw: dict | None = None) -> dict:
    """Two steps of ``case`` with the step's shared casts, then the same with each micro-batch's
    own: losses, parameters, and how many casts each kept as an earlier micro-batch's.
    ``prepare(runtime, case)`` changes each run's stage before its optimizer is made (LoRA);
    ``opt_kw``: AdamW's settings besides ``lr`` (default a weight decay of 0.1)."""
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    from hapt_hf.pipeline import runtime as runtime_module
    config = tiny_config(case.family, case.num_blocks, case.tied)
    out = {}
    shared = runtime_module.SharedWeightCasts
    for how in ("step_casts", "own_casts"):
        runtime_module.SharedWeightCasts = shared if how == "step_casts" else _own_casts
        try:
            rt = PipelineRuntime(case.plan(), config, RuntimeConfig(timeout_s=60, seed=7))
            if prepare is not None:
                prepare(rt, case)
            opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3,
                                    **({"weight_decay": 0.1} if opt_kw is None else opt_kw))
            batches = make_batches(config.vocab_size, seed=11, rows=rt.plan.global_batch_size)
            losses = [rt.train_step(b, opt, max_grad_norm=0.5).loss for b in batches[:2]]
            out[how] = {"losses": losses, "step_casts": rt.weight_casts_shared,
                        "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p)
                                   .detach().numpy().copy() for n, p in rt.stage.named_parameters()},
                        "blocks": len(rt.stage.parts)}
            rt.shutdown()
        finally:
            runtime_module.SharedWeightCasts = shared
    return out


def run_all(rank: int, world_size: int) -> dict:
    out = {c.name: train_case(rank, c) for c in PARTIAL}
    out.update({c.name: train_shared_and_own(rank, c) for c in SHARED})
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [o.value for o in run_ranks(run_all, 2, timeout_s=240)]


@pytest.mark.parametrize("case", PARTIAL, ids=[c.name for c in PARTIAL])
def test_partial_recompute_matches_one_process(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case.name]
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"])


def assert_step_casts_train_as_own(results: list[dict], case: PartialCase, per_micro_batch) -> None:
    """Every rank of ``results`` (each case's ``step_casts`` and ``own_casts`` runs) trained bit
    for bit alike both ways; on each rank whose stage holds several micro-batches, the last step
    shared ``(M - 1) * per_micro_batch(stage, kept_blocks)`` casts (every micro-batch after the
    first took the first one's casts of the ``kept_blocks`` that keep their activations)."""
    counted = 0
    for rank, per_rank in enumerate(results):
        shared, own = per_rank[case.name]["step_casts"], per_rank[case.name]["own_casts"]
        assert shared["losses"] == own["losses"], rank
        assert shared["params"].keys() == own["params"].keys()
        for n, p in shared["params"].items():
            assert np.array_equal(p, own["params"][n]), f"rank {rank}: {n} differs"
        assert own["step_casts"] == 0
        stage = case.plan().stages_of_rank(rank)[0]
        if stage.warmup < M:  # a stage one micro-batch deep has nothing to share
            continue
        kept_blocks = shared["blocks"] - stage.recompute_layers
        assert shared["step_casts"] == (M - 1) * per_micro_batch(stage, kept_blocks), rank
        counted += 1
    assert counted, "no rank held several micro-batches at once"


@pytest.mark.parametrize("case", SHARED, ids=[c.name for c in SHARED])
def test_shared_casts_train_bit_for_bit_as_own_casts(results, case):
    def per_micro_batch(stage, kept_blocks):  # the head's weight too on the last stage
        head = 1 if stage.layers[1] == case.plan().num_layers else 0
        return kept_blocks * WEIGHTS_PER_BLOCK + head

    assert_step_casts_train_as_own(results, case, per_micro_batch)
