"""Mixed precision in the runtime: autocast to the plan's dtype on CPU, activations on the wire
in that dtype (the planner's bytes), and fp16's dynamic loss scaling decided once for the job.

Tolerances against fp32 (losses of 3 steps of a tiny LLaMA, Adam at lr 1e-3): bf16 within
BF16_TOL, fp16 within FP16_TOL (absolute, on losses near ln(97) = 4.6). Each 16-bit run must
differ from fp32 somewhere: autocast is on.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

MBS, M, SEQ, STEPS, VOCAB = 2, 4, 8, 3, 97
BF16_TOL, FP16_TOL = 2e-3, 5e-4  # measured: 1.3e-4 and 6e-5


def _config(blocks: int):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=blocks, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=32, tie_word_embeddings=False)


def _plan(blocks: tuple[int, ...], widths: tuple[int, ...], dtype: str) -> Plan:
    n, stages, rank, start = len(blocks), [], 0, 0
    for i, (b, w) in enumerate(zip(blocks, widths)):
        end = start + b + (i == 0) + (i == n - 1)
        stages.append(Stage.even(i, (start, end), "cpu", "cpu", tuple(range(rank, rank + w)),
                                 warmup=n - i, micro_batch_size=MBS))
        start, rank = end, rank + w
    plan = Plan("tiny-llama", start, SEQ, MBS * M, MBS, M, "1f1b", tuple(stages))
    loss_scaling = "dynamic" if dtype == "fp16" else None
    return replace(plan, dtype=dtype, loss_scaling=loss_scaling).validate()


def _batches(steps: int = STEPS) -> list:
    from hapt_hf.pipeline import Batch
    g = torch.Generator().manual_seed(3)
    return [Batch(torch.randint(0, VOCAB, (MBS * M, SEQ), generator=g)) for _ in range(steps)]


def _runtime(plan: Plan, blocks: int, **config):
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    return PipelineRuntime(plan, _config(blocks), RuntimeConfig(timeout_s=60, seed=5, **config))


def _params(rt) -> dict:
    return {n: p.detach().numpy().copy() for n, p in rt.stage.named_parameters()}


# -- 16-bit training stays near fp32, and is not fp32 -----------------------------------------

LAYOUT = ((1, 2), (1, 2))  # uneven: 1 block on one rank, 2 blocks on two replicas


def _train_each_dtype(rank: int, world_size: int) -> dict:
    blocks, widths = LAYOUT
    out = {}
    for dtype in ("fp32", "bf16", "fp16"):
        rt = _runtime(_plan(blocks, widths, dtype), sum(blocks))
        opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
        linear_out: set[str] = set()  # what the stage's matmuls computed in
        hooks = [m.register_forward_hook(lambda m, i, o, seen=linear_out: seen.add(str(o.dtype)))
                 for m in rt.stage.modules() if isinstance(m, torch.nn.Linear)]
        results = [rt.train_step(b, opt, max_grad_norm=1.0) for b in _batches()]
        for h in hooks:
            h.remove()
        out[dtype] = {"losses": [r.loss for r in results], "params": _params(rt),
                      "linear_out": sorted(linear_out),
                      "skipped": [r.skipped for r in results],
                      "scales": [r.loss_scale for r in results],
                      "dtypes": sorted({str(p.dtype) for p in rt.parameters()} |
                                       {str(v.dtype) for s in opt.state.values()
                                        for v in s.values() if torch.is_tensor(v) and v.ndim})}
        rt.shutdown()
    return out


@pytest.fixture(scope="module")
def each_dtype():
    return [o.value for o in run_ranks(_train_each_dtype, 3)]


@pytest.mark.parametrize("dtype,tol", [("bf16", BF16_TOL), ("fp16", FP16_TOL)])
def test_16bit_losses_near_fp32_and_not_fp32(each_dtype, dtype, tol):
    from hapt_hf.pipeline.precision import torch_dtype
    ref, got = each_dtype[0]["fp32"]["losses"], each_dtype[0][dtype]["losses"]
    assert all(abs(a - b) <= tol for a, b in zip(got, ref)), (dtype, got, ref)
    assert got != ref  # bit-identical losses would mean no autocast
    for rank_out in each_dtype:  # every rank's stage computed in 16 bits
        moved = [n for n, p in rank_out[dtype]["params"].items()
                 if not (p == rank_out["fp32"]["params"][n]).all()]
        assert moved, f"{dtype}: every parameter equals fp32's on a rank"
        assert rank_out[dtype]["linear_out"] == [str(torch_dtype(dtype))]  # autocast on CPU
        assert rank_out["fp32"]["linear_out"] == ["torch.float32"]
        assert rank_out[dtype]["dtypes"] == ["torch.float32"]  # master weights, Adam state
        assert rank_out[dtype]["skipped"] == [False] * STEPS


def test_loss_scale_only_for_fp16(each_dtype):
    assert each_dtype[0]["fp16"]["scales"] == [2.0 ** 16] * STEPS
    assert each_dtype[0]["bf16"]["scales"] == each_dtype[0]["fp32"]["scales"] == [None] * STEPS


# -- one overflow decision for the whole job --------------------------------------------------

OVERFLOW_RANK, OVERFLOW_STEP, GROWTH = 2, 2, 2


def _overflow(rank: int, world_size: int) -> dict:
    rt = _runtime(_plan((1, 1, 1, 1), (1, 1, 1, 1), "fp16"), 4,
                  loss_scale_init=2.0 ** 10, loss_scale_growth_interval=GROWTH)
    opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    first = next(rt.stage.parameters())
    steps = []
    for i, b in enumerate(_batches(6)):
        hook = None
        if i == OVERFLOW_STEP and rank == OVERFLOW_RANK:  # one gradient of one stage overflows
            hook = first.register_hook(lambda g: torch.full_like(g, math.inf))
        before = _params(rt)
        r = rt.train_step(b, opt, sched, max_grad_norm=1.0)
        if hook is not None:
            hook.remove()
        after = _params(rt)
        steps.append({"skipped": r.skipped, "scale": r.loss_scale,
                      "unchanged": all((before[n] == after[n]).all() for n in before),
                      "adam_step": int(opt.state[first]["step"]) if opt.state else 0,
                      "sched": sched.last_epoch, "norm": r.grad_norm})
    out = {"steps": steps, "scale": rt.loss_scaler.scale, "skipped": rt.loss_scaler.skipped_steps}
    rt.shutdown()
    return out


def test_an_overflow_on_one_stage_skips_the_same_step_on_every_rank():
    outs = [o.value for o in run_ranks(_overflow, 4)]
    s = 2.0 ** 10
    # grows after 2 clean steps, halves at the overflow, grows again 2 clean steps later
    scales = [s, s, 2 * s, s, s, 2 * s]
    for rank, out in enumerate(outs):
        steps = out["steps"]
        assert [x["skipped"] for x in steps] == [i == OVERFLOW_STEP for i in range(6)], rank
        assert [x["scale"] for x in steps] == scales, rank
        assert [x["unchanged"] for x in steps] == [i == OVERFLOW_STEP for i in range(6)], rank
        assert [x["adam_step"] for x in steps] == [1, 2, 2, 3, 4, 5], rank
        assert [x["sched"] for x in steps] == [1, 2, 2, 3, 4, 5], rank  # not stepped either
        assert math.isinf(steps[OVERFLOW_STEP]["norm"]), rank
        assert out["scale"] == 2 * s and out["skipped"] == 1, rank


# -- bytes on the wire are the planner's -------------------------------------------------------

def _recording(isend, plan: Plan, sent: list):
    """``dist.isend`` that also notes (peer's stage, tag = micro-batch, bytes, dtype)."""
    def recording_isend(tensor, dst, *args, tag=0, **kw):
        sent.append((plan.stage_of_rank(dst).index, tag,
                     tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return isend(tensor, dst, *args, tag=tag, **kw)
    return recording_isend


def _sent_bytes(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    blocks, widths = (2, 1, 1), (1, 2, 1)
    out = {}
    real_isend = dist.isend
    for dtype in ("fp32", "bf16", "fp16"):
        plan = _plan(blocks, widths, dtype)
        rt = _runtime(plan, sum(blocks))
        sent: list[tuple[int, int, int, str]] = []
        dist.isend = _recording(real_isend, plan, sent)
        try:
            rt.train_step(_batches(1)[0], torch.optim.SGD(rt.parameters(), lr=0.0))
        finally:
            dist.isend = real_isend
        out[dtype] = {"stage": rt.stage_plan.index, "sent": sent}
        rt.shutdown()
    return out


def test_bytes_sent_per_microbatch_equal_the_planners():
    from hapt_hf.pipeline.precision import torch_dtype
    from hapt_hf.planner.model_spec import ModelSpec
    outs = [o.value for o in run_ranks(_sent_bytes, 4)]
    blocks, widths = (2, 1, 1), (1, 2, 1)
    for dtype in ("fp32", "bf16", "fp16"):
        plan = _plan(blocks, widths, dtype)
        spec = ModelSpec.from_config(_config(sum(blocks)), SEQ, dtype)
        for cut in range(plan.num_stages - 1):  # between stage cut and cut + 1
            want = spec.boundary_bytes(plan.stages[cut].layers[1] - 1, MBS)
            for k in range(M):
                for src, dst in ((cut, cut + 1), (cut + 1, cut)):  # activations, gradients
                    got = [(n, d) for o in outs for (peer, tag, n, d) in o[dtype]["sent"]
                           if o[dtype]["stage"] == src and peer == dst and tag == k]
                    assert sum(n for n, _ in got) == want, (dtype, cut, k, src, got, want)
                    assert {d for _, d in got} == {str(torch_dtype(dtype))}
