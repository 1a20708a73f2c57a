"""What one stage keeps per micro-batch in flight, in one process: one 16-bit copy of each weight
for all the micro-batches of a step (not one each), and partial recompute (only the first k
block units recompute); both with the gradients bit for bit what they were."""
from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig

from hapt_hf.compat.torch_api import (backward_input, backward_weight, cast_parameter,
                                      saved_tensors_hooks_in_force)
from hapt_hf.pipeline import stage as stage_module
from hapt_hf.pipeline.precision import SharedWeightCasts, compute_context
from hapt_hf.pipeline.stage import build_stage

VOCAB, SEQ, ROWS, N = 97, 8, 2, 3  # N micro-batches in flight
BLOCKS = 3  # the stage: blocks 0..2 of a 4-block model, fed hidden states
WEIGHTS_PER_BLOCK = 7  # q, k, v, o, gate, up, down


def _config() -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=BLOCKS + 1, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=32, tie_word_embeddings=False)


def _stage(unit: str = "block", **kw):
    layers = (1, 1 + BLOCKS) if unit == "block" else (1, 1 + 2 * BLOCKS)
    return build_stage(_config(), layers, seed=3, layer_unit=unit, **kw)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(ROWS, SEQ, 32, generator=g) for _ in range(N + 1)]


class KeptCasts:
    """The 16-bit weight casts autograd keeps, as the hooks in force leave them (held here, so
    that storages stay apart while counted)."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    @contextlib.contextmanager
    def counting(self):
        outer = saved_tensors_hooks_in_force()

        def pack(t):
            packed = outer[0](t) if outer is not None else t
            if isinstance(packed, torch.Tensor) and packed.dtype in (torch.bfloat16, torch.float16) \
                    and cast_parameter(packed) is not None:
                self.kept.append(packed)
            return packed, outer

        def unpack(saved):
            packed, hooks = saved
            return hooks[1](packed) if hooks is not None else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def copies(self) -> int:
        return len({t.untyped_storage().data_ptr() for t in self.kept})


def _run(stage, dtype: str, share: bool, split: bool = False) -> tuple[int, dict]:
    """N forwards in flight, then their backwards (1F1B's cool-down order, or zero_bubble's
    split I then W, each W after the next I); the copies kept at the peak, and the gradients."""
    casts = SharedWeightCasts() if share else None
    kept = KeptCasts()
    xs = _inputs()
    outs = []
    for x in xs[:N]:
        x = x.clone().requires_grad_(True)
        with compute_context(dtype, "cpu", casts), kept.counting():
            outs.append((x, stage(x)))
    copies = kept.copies()
    kept.kept.clear()
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(ROWS, SEQ, 32, generator=g) for _ in outs]
    params = list(stage.parameters())
    if split:
        states = []
        for (x, out), grad in zip(outs, grads):
            states.append(backward_input([out], [grad], [x], params)[1])
            if len(states) > 1:
                backward_weight(params, states.pop(0))
        backward_weight(params, states.pop(0))
    else:
        for (_, out), grad in zip(outs, grads):
            torch.autograd.backward(out, grad)
    return copies, {n: p.grad.clone() for n, p in stage.named_parameters()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n} differs"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_copy_of_each_weight_for_every_micro_batch_in_flight(dtype):
    weights = BLOCKS * WEIGHTS_PER_BLOCK
    before, grads_before = _run(_stage(), dtype, share=False)
    after, grads_after = _run(_stage(), dtype, share=True)
    assert before == N * weights  # each micro-batch its own cast of every weight
    assert after == weights
    _equal(grads_before, grads_after)


def test_the_split_backward_runs_on_the_shared_copies():
    _, whole = _run(_stage(), "bf16", share=False)
    copies, split = _run(_stage(), "bf16", share=True, split=True)
    assert copies == BLOCKS * WEIGHTS_PER_BLOCK
    _equal(whole, split)


def test_recomputed_blocks_keep_no_copy_and_the_rest_share_one():
    copies, grads = _run(_stage(recompute_layers=1), "bf16", share=True)
    assert copies == (BLOCKS - 1) * WEIGHTS_PER_BLOCK
    _, plain = _run(_stage(), "bf16", share=False)
    _equal(grads, plain)


def test_fp32_keeps_no_16_bit_copy():
    copies, _ = _run(_stage(), "fp32", share=True)
    assert copies == 0


@pytest.mark.parametrize("unit, k, runs", [
    ("block", 2, ["b0", "b1"]),
    # halves: 3 of 6 units end inside block 1, which runs as its two halves
    ("half", 3, ["b0", "b1.attn"]),
    ("half", 2, ["b0"]),
])
def test_partial_recompute_checkpoints_the_first_k_units_only(monkeypatch, unit, k, runs):
    called = []
    real = stage_module.checkpoint

    def counting(run, *args, **kw):
        called.append(run.__name__)
        return real(run, *args, **kw)

    monkeypatch.setattr(stage_module, "checkpoint", counting)
    _, plain = _run(_stage(unit), "fp32", share=False)
    assert called == []
    _, partial = _run(_stage(unit, recompute_layers=k), "fp32", share=False)
    names = {"run_block": "b{}", "run_attention_half": "b{}.attn", "run_mlp_half": "b{}.mlp"}
    per_forward = called[:len(called) // N]
    assert [names[c].format(i) for c, i in zip(per_forward, _block_order(per_forward))] == runs
    assert len(called) == N * len(runs)  # once per forward
    _equal(plain, partial)
    _, whole = _run(_stage(unit, recompute=True), "fp32", share=False)
    _equal(plain, whole)


def _block_order(calls: list[str]) -> list[int]:
    """Block index of each call in a forward's sequence of checkpointed runs (a whole block,
    or an attention half, begins the next block)."""
    out, index = [], -1
    for c in calls:
        if c != "run_mlp_half":
            index += 1
        out.append(index)
    return out


def test_recomputes_reads_the_first_k_units():
    whole = _stage(recompute_layers=2)
    assert [whole.recomputes(i, h) for i in range(BLOCKS) for h in ("attn", "mlp")] == \
        [True, True, True, True, False, False]
    halves = _stage("half", recompute_layers=3)
    assert [halves.recomputes(i, h) for i in range(BLOCKS) for h in ("attn", "mlp")] == \
        [True, True, True, False, False, False]
    halves.recompute = True  # as HaptTrainer's gradient_checkpointing sets it: all of them
    assert all(halves.recomputes(i, h) for i in range(BLOCKS) for h in ("attn", "mlp"))
