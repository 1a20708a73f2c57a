"""The ``interleaved`` schedule (``v`` stages per rank, stage ``s`` on pipeline rank
``s mod p``) trains exactly as one process would.

A rank holds its chunks as one module under the full model's paths (``RankStages``), runs its
one list (each action names its chunk), trades activations and gradients per stage boundary
and direction (the boundary from the last pipeline rank back to the first included), and sums,
clips and steps the gradients of all its chunks together. Each case trains STEPS clipped AdamW
steps and compares every gradient after the first iteration, every loss and norm, every
parameter after the steps, ``evaluate``, the logits and the gathered state dict with one
process (the harness of ``test_runtime_zero_bubble``; rtol 1e-5, atol 4e-5 in fp32). Chunks
of unequal sizes throughout: v = 2 and 3 on 2 ranks; on 4 ranks v = 3 over two pipeline ranks
of two uneven replicas each (one sharding its optimizer state), v = 2 over four pipeline
ranks with activation checkpointing on some chunks, v = 2 with a tensor-parallel pipeline
rank, and v = 2 over one rank then three uneven replicas (mixed widths, on both sides of the
wrap). The replicas' bucket all-reduce overlaps each chunk's last backward, and a run saved
(gathered model, per-rank optimizer state) resumes in fresh processes bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.ranks import run_ranks
from tests.pipeline.test_runtime_equivalence import STEPS, make_batches
from tests.pipeline.test_runtime_zero_bubble import M, Case, build_plan, runtime, train_and_compare

pytestmark = pytest.mark.multiproc

IL = "interleaved"
CASES = {
    2: [Case("gpt2-v2", "gpt2", IL, (2, 1, 1, 3), ((1,), (1,))),
        Case("llama-v3", "llama", IL, (1, 2, 1, 1, 2, 1), ((1,), (1,)), recompute=(1, 4))],
    4: [Case("gpt2-v3-replicas", "gpt2", IL, (1, 2, 1, 1, 1, 2), ((3, 1), (2, 2)), sharded=(0,)),
        Case("llama-v2-p4", "llama", IL, (1, 1, 2, 1, 1, 2, 1, 1), ((1,),) * 4,
             recompute=(2, 5)),
        Case("llama-v2-tp2", "llama", IL, (1, 2, 2, 1), ((2,), (1, 1)), tp=(2, 1)),
        # mixed widths: one rank, then three uneven replicas, and back across the wrap
        Case("gpt2-v2-1|1:2:1", "gpt2", IL, (2, 1, 1, 1), ((4,), (1, 2, 1)))],
}


RESUMED = CASES[4][0]  # two replicas per pipeline rank, one rank's optimizer state sharded


def _params(rt) -> dict:
    # numpy copies: tensors would cross back to the parent through shared memory
    return {n: p.detach().numpy().copy() for n, p in rt.stage.named_parameters()}


def resume_part_one(rank: int, root: str) -> dict:
    """An uninterrupted run of STEPS steps, and one that saves the gathered model and this
    rank's optimizer state (its shard where sharded) after STEPS - 1."""
    from pathlib import Path

    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    from hapt_hf.pipeline.export import write_stage_shards
    out = {}
    for saves in (False, True):
        rt = runtime(RESUMED)
        opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        batches = make_batches(97, seed=5, rows=rt.plan.global_batch_size)
        for b in batches[:STEPS - 1] if saves else batches:
            rt.train_step(b, opt, max_grad_norm=0.5)
        if saves:
            write_stage_shards(rt, Path(root))
            ckpt_io.save_rank_state(Path(root), rt.rank, opt, None)
            ckpt_io.barrier()
        else:
            out["full"] = _params(rt)
        rt.shutdown()
    return out


def resume_part_two(rank: int, world_size: int, root: str) -> dict:
    """Fresh processes: every chunk's weights and the rank's optimizer state from the files,
    then the last step."""
    from pathlib import Path

    from hapt_hf.integration import trainer_checkpoint as ckpt_io
    rt = runtime(RESUMED, checkpoint_dir=root)
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    ckpt_io.load_rank_state(Path(root), rank, opt, None)
    loaded = len(getattr(opt, "optim", opt).state)
    rt.train_step(make_batches(97, seed=5, rows=rt.plan.global_batch_size)[-1], opt,
                  max_grad_norm=0.5)
    out = {"resumed": _params(rt), "loaded_state": loaded}
    rt.shutdown()
    return out


def mixed_optimizer_refusal(rank: int) -> str | None:
    """Stages 0 and 2 share pipeline rank 0; the plan shards only stage 0's optimizer."""
    from dataclasses import replace

    from hapt_hf.pipeline.runtime import RuntimeSetupError
    plan = build_plan(RESUMED)
    stages = tuple(replace(s, optimizer="replicated") if s.index == 2 else s for s in plan.stages)
    try:
        runtime(RESUMED, replace(plan, stages=stages).validate(RESUMED.world)).shutdown()
    except RuntimeSetupError as e:
        return str(e)
    return None


def run_all(rank: int, world_size: int, root: str) -> dict:
    out = {c.name: train_and_compare(rank, c) for c in CASES[world_size]}
    if world_size == 4:
        out["resume"] = resume_part_one(rank, root)
        out["refusal"] = mixed_optimizer_refusal(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("interleaved-resume"))
    out = {w: [o.value for o in run_ranks(run_all, w, root, timeout_s=240)] for w in CASES}
    out["resumed"] = [o.value for o in run_ranks(resume_part_two, 4, root, timeout_s=240)]
    return out


ALL = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("world,case", ALL, ids=[f"{w}r-{c.name}" for w, c in ALL])
def test_matches_single_process(results, world, case):
    plan = build_plan(case)
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[case.name]
        assert r["params"] > 0, f"rank {rank} holds no parameters"
        assert not r["errors"], f"rank {rank} (stages {r['stages']}): " + "\n".join(r["errors"])
        assert max(r["norms"]) > 0.5, "clipping never engaged; the step check would be weaker"
        # the rank ran every chunk the plan gives it, each in its own actions
        held = [s.index for s in plan.stages_of_rank(rank)]
        assert r["stages"] == held and len(held) == plan.virtual_stages > 1, (r["stages"], held)
        assert {int(a.split("F")[0]) for a in r["actions"] if a.rstrip("0123456789")[-1] == "F"
                and "_" not in a} == set(held)
        assert r["max_live"] == r["in_flight"], r


@pytest.mark.parametrize("world,case", [(w, c) for w, c in ALL if c.sharded],
                         ids=[f"{w}r-{c.name}" for w, c in ALL if c.sharded])
def test_sharded_rank_uses_the_sharded_optimizer(results, world, case):
    plan = build_plan(case)
    for rank, per_rank in enumerate(results[world]):
        want = "ShardedOptimizer" if plan.stages_of_rank(rank)[0].optimizer == "sharded" \
            else "AdamW"
        assert per_rank[case.name]["optimizer"] == want


def test_the_lists_wrap_from_the_last_rank_to_the_first(results):
    """On two pipeline ranks, rank 0 receives stage 2's activations from rank 1 (stage 1)."""
    acts = results[2][0]["gpt2-v2"]["actions"]
    assert all(f"2RECV_F{k}" in acts for k in range(M))
    assert all(f"1SEND_F{k}" in results[2][1]["gpt2-v2"]["actions"] for k in range(M))


def test_each_chunks_buckets_launch_in_its_last_backward(results):
    """Pipeline rank 0 of the replicated case (ranks 0 and 1) holds three chunks: with tiny
    buckets, some go on the wire before the rank's last backward ends."""
    for rank in (0, 1):
        launches = results[4][rank]["gpt2-v3-replicas"]["launches"]
        assert all(len(x) > 2 for x in launches), launches
        assert all(min(x) < 0 for x in launches), launches


def test_resumes_exactly_in_fresh_processes(results):
    """The rank's chunks rebuilt from the gathered checkpoint and its optimizer state (a
    shard on pipeline rank 0) from its file: the last step lands where the uninterrupted run
    did, bit for bit."""
    for rank in range(4):
        full = results[4][rank]["resume"]["full"]
        resumed = results["resumed"][rank]
        assert resumed["loaded_state"] > 0
        assert set(resumed["resumed"]) == set(full)
        for n, p in full.items():
            assert (resumed["resumed"][n] == p).all(), (rank, n)


def test_a_ranks_stages_of_unlike_optimizers_are_refused_naming_them(results):
    for rank in range(4):
        msg = results[4][rank]["refusal"]
        assert msg is not None and "stages 0 and 2" in msg and "'sharded'" in msg, msg
        assert "give them one setting" in msg, msg
