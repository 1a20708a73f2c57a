"""LoRA's frozen base weights under 16-bit autocast, one process: a stage with several
micro-batches in flight keeps one 16-bit cast of each frozen projection weight for the step
(not one per micro-batch), as it does for the weights that train, and trains bit for bit as
with each micro-batch's own casts: every loss, every trainable gradient, and the parameters
after the steps. LLaMA's projections are ``nn.Linear``; GPT-2's are transformers' ``Conv1D``
(``c_attn``, ``c_proj``, ``c_fc``: peft wraps the adapted ones with ``fan_in_fan_out``), and a
GPT-2 stage whose first block is frozen whole keeps one cast of that block's weights too. The
same on two Gloo ranks through the runtime's steps (1F1B in bf16, and zero_bubble in fp16 with
a recomputed block; GPT-2 with LoRA in bf16)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from transformers import Conv1D, GPT2Config, LlamaConfig

from benchmarks.ranks import run_ranks
from hapt_hf.compat.torch_api import cast_parameter, saved_tensors_hooks_in_force
from hapt_hf.integration.lora import apply_lora, apply_lora_config
from hapt_hf.pipeline.precision import SharedWeightCasts, compute_context, torch_dtype
from hapt_hf.pipeline.stage import build_stage
from tests.pipeline.test_runtime_memory import (PartialCase, assert_step_casts_train_as_own,
                                              train_shared_and_own)

VOCAB, SEQ, ROWS, N, STEPS = 97, 8, 2, 3, 2  # N micro-batches in flight
BLOCKS = 3
FROZEN_PER_BLOCK = 7  # the base q, k, v, o (adapted) and gate, up, down
ADAPTERS_PER_BLOCK = 8  # lora_A and lora_B of q, k, v, o
GPT2_TARGETS = ("c_attn", "c_proj")  # the attention's c_attn, c_proj and the MLP's c_proj
GPT2_FROZEN_PER_BLOCK = 4  # the base c_attn, c_proj, c_proj (adapted) and c_fc: all Conv1D
GPT2_ADAPTERS_PER_BLOCK = 6  # lora_A and lora_B of each adapted one


def _config(family: str = "llama"):
    if family == "gpt2":
        return GPT2Config(n_layer=BLOCKS + 1, n_embd=32, n_inner=64, n_head=4, vocab_size=VOCAB,
                          n_positions=32, tie_word_embeddings=False, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return LlamaConfig(num_hidden_layers=BLOCKS + 1, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=32, tie_word_embeddings=False)


def gpt2_lora(stage: nn.Module, r: int = 4) -> None:
    """LoRA of rank ``r`` on a GPT-2 stage's ``GPT2_TARGETS`` as a user's peft ``LoraConfig``
    for GPT-2 gives it (``fan_in_fan_out``: its ``Conv1D`` holds the weight transposed), every
    other weight frozen."""
    from peft import LoraConfig
    apply_lora_config(stage, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                        target_modules=list(GPT2_TARGETS), fan_in_fan_out=True))
    for n, p in stage.named_parameters():
        p.requires_grad = "lora_" in n


def _stage(last: bool, recompute_layers: int = 0, family: str = "llama"):
    """Blocks 0..2 fed hidden states (``last``: blocks 1..3, the final norm and the frozen LM
    head), LoRA of rank 4 on the attention projections (GPT-2: ``GPT2_TARGETS``), adapters B
    drawn non-zero."""
    layers = (2, 3 + BLOCKS) if last else (1, 1 + BLOCKS)
    stage = build_stage(_config(family), layers, seed=3, recompute_layers=recompute_layers)
    if family == "gpt2":
        gpt2_lora(stage)
    else:
        apply_lora(stage, r=4)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for n, p in stage.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return stage


def _frozen_first_block_stage():
    """GPT-2 blocks 0..2 fed hidden states, no adapters: the first block frozen whole (its
    four ``Conv1D`` and its norms), the rest training."""
    stage = build_stage(_config("gpt2"), (1, 1 + BLOCKS), seed=3)
    first = next(m for n, m in stage.named_modules() if n.endswith("h.0"))
    for p in first.parameters():
        p.requires_grad = False
    return stage


def _frozen_projections(stage) -> list[nn.Parameter]:
    return [m.weight for m in stage.modules()
            if type(m) in (nn.Linear, Conv1D) and not m.weight.requires_grad]


class KeptCasts:
    """The 16-bit casts autograd keeps as the hooks in force leave them, of the frozen
    projection weights (told by their values: a cast, or its transpose) and of the trainable
    ones (told by their graph), held so that storages stay apart while counted."""

    def __init__(self, frozen: list[nn.Parameter], dtype: torch.dtype) -> None:
        self.casts = [w.detach().to(dtype) for w in frozen]
        self.frozen: list[torch.Tensor] = []
        self.trained: list[torch.Tensor] = []

    def _is_frozen_cast(self, t: torch.Tensor) -> bool:
        return any((c.shape == t.shape and torch.equal(c, t))
                   or (c.t().shape == t.shape and torch.equal(c.t(), t)) for c in self.casts)

    @contextlib.contextmanager
    def counting(self):
        outer = saved_tensors_hooks_in_force()

        def pack(t):
            packed = outer[0](t) if outer is not None else t
            if isinstance(packed, torch.Tensor) and packed.dtype in (torch.bfloat16, torch.float16):
                if cast_parameter(packed) is not None:
                    self.trained.append(packed)
                elif not packed.requires_grad and self._is_frozen_cast(packed):
                    self.frozen.append(packed)
            return packed, outer

        def unpack(saved):
            packed, hooks = saved
            return hooks[1](packed) if hooks is not None else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    @staticmethod
    def copies(kept: list[torch.Tensor]) -> int:
        return len({t.untyped_storage().data_ptr() for t in kept})


def _train(stage, dtype: str, share: bool, last: bool) -> dict:
    """STEPS steps of N micro-batches, all N forwards in flight before their backwards, AdamW
    on the adapters: the casts kept at the first step's peak, the step's count of shared casts,
    the outputs (the loss sums on the last stage), every trainable gradient, input gradient
    and the parameters after."""
    g = torch.Generator().manual_seed(5)
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    out: dict = {"outputs": [], "grads": [], "input_grads": [], "frozen": [], "trained": [],
                 "shared": []}
    for _ in range(STEPS):
        casts = SharedWeightCasts() if share else None
        kept = KeptCasts(_frozen_projections(stage), torch_dtype(dtype))
        xs = [torch.randn(ROWS, SEQ, 32, generator=g).requires_grad_(True) for _ in range(N)]
        labels = [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(N)]
        ys = []
        for x, y in zip(xs, labels):
            with compute_context(dtype, "cpu", casts), kept.counting():
                ys.append(stage(x, labels=y) if last else stage(x))
        out["frozen"].append(kept.copies(kept.frozen))
        out["trained"].append(kept.copies(kept.trained))
        kept.frozen.clear()
        kept.trained.clear()
        for y in ys:
            grad = None if last else torch.randn(y.shape, generator=g).to(y.dtype)
            torch.autograd.backward(y, grad)
        out["outputs"].append([y.detach().clone() for y in ys])
        out["input_grads"].append([x.grad.clone() for x in xs])
        out["grads"].append({n: p.grad.clone() for n, p in stage.named_parameters()
                             if p.requires_grad})
        out["shared"].append(casts.shared if casts is not None else 0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(type(w) is nn.Parameter for w in _frozen_projections(stage))
    out["params"] = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return out


def _assert_bit_for_bit(a: dict, b: dict) -> None:
    for key in ("outputs", "input_grads"):
        for step_a, step_b in zip(a[key], b[key], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(step_a, step_b, strict=True)), key
    for step_a, step_b in zip(a["grads"], b["grads"], strict=True):
        assert step_a.keys() == step_b.keys() and step_a
        for n in step_a:
            assert torch.equal(step_a[n], step_b[n]), f"gradient of {n} differs"
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"{n} differs after the steps"


def _assert_one_cast_per_step(own: dict, shared: dict, frozen: int, trained: int) -> None:
    """Each micro-batch its own casts without sharing (``frozen`` and ``trained`` per
    micro-batch); with it one of each for the step, every micro-batch after the first taking
    the first one's; and the two runs bit for bit alike."""
    assert own["frozen"] == [N * frozen] * STEPS
    assert own["trained"] == [N * trained] * STEPS
    assert shared["frozen"] == [frozen] * STEPS
    assert shared["trained"] == [trained] * STEPS
    assert shared["shared"] == [(N - 1) * (frozen + trained)] * STEPS
    _assert_bit_for_bit(own, shared)


@pytest.mark.parametrize("last", [False, True], ids=["blocks", "blocks+head"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_cast_of_each_frozen_weight_per_step_bit_for_bit(dtype, last):
    frozen = BLOCKS * FROZEN_PER_BLOCK + (1 if last else 0)  # the LM head is frozen too
    trained = BLOCKS * ADAPTERS_PER_BLOCK
    own = _train(_stage(last), dtype, share=False, last=last)
    shared = _train(_stage(last), dtype, share=True, last=last)
    _assert_one_cast_per_step(own, shared, frozen, trained)


@pytest.mark.parametrize("last", [False, True], ids=["blocks", "blocks+head"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_cast_of_each_frozen_conv1d_weight_per_step_bit_for_bit(dtype, last):
    """GPT-2 with peft's LoRA: the frozen ``Conv1D`` weights (adapted or not) are lent the
    step's one cast as ``nn.Linear``'s are."""
    stage = _stage(last, family="gpt2")
    conv = [m for m in stage.modules() if type(m) is Conv1D]
    assert len(conv) == BLOCKS * GPT2_FROZEN_PER_BLOCK
    assert all(not m.weight.requires_grad for m in conv)
    frozen = BLOCKS * GPT2_FROZEN_PER_BLOCK + (1 if last else 0)  # the LM head is nn.Linear
    trained = BLOCKS * GPT2_ADAPTERS_PER_BLOCK
    own = _train(stage, dtype, share=False, last=last)
    shared = _train(_stage(last, family="gpt2"), dtype, share=True, last=last)
    _assert_one_cast_per_step(own, shared, frozen, trained)


def test_a_frozen_conv1d_block_keeps_one_cast_per_step_bit_for_bit():
    """A GPT-2 stage with its first block frozen (no adapters): that block's four ``Conv1D``
    weights kept once for the step, the trained blocks' casts shared as before."""
    own = _train(_frozen_first_block_stage(), "bf16", share=False, last=False)
    shared = _train(_frozen_first_block_stage(), "bf16", share=True, last=False)
    _assert_one_cast_per_step(own, shared, GPT2_FROZEN_PER_BLOCK,
                              (BLOCKS - 1) * GPT2_FROZEN_PER_BLOCK)


def test_recomputed_blocks_keep_no_cast_of_their_frozen_weights():
    own = _train(_stage(False, recompute_layers=1), "bf16", share=False, last=False)
    shared = _train(_stage(False, recompute_layers=1), "bf16", share=True, last=False)
    assert own["frozen"] == [N * (BLOCKS - 1) * FROZEN_PER_BLOCK] * STEPS
    assert shared["frozen"] == [(BLOCKS - 1) * FROZEN_PER_BLOCK] * STEPS
    _assert_bit_for_bit(own, shared)


def test_the_frozen_weights_are_given_back_when_a_forward_fails():
    stage = _stage(False)
    projection = next(m for m in stage.modules() if type(m) is nn.Linear
                      and not m.weight.requires_grad)
    frozen = {id(m): m.weight for m in stage.modules() if type(m) is nn.Linear}

    def fail(module, args):  # runs after the step's cast is lent to the projection
        assert module.weight.dtype == torch.bfloat16
        raise RuntimeError("a failing forward")

    handle = projection.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a failing forward"):
        with compute_context("bf16", "cpu", SharedWeightCasts()):
            stage(torch.randn(ROWS, SEQ, 32, requires_grad=True))
    handle.remove()
    assert {id(m): m.weight for m in stage.modules() if type(m) is nn.Linear} == frozen
    assert all(type(w) is nn.Parameter for w in frozen.values())


def test_fp32_and_forwards_outside_the_step_leave_frozen_weights_alone():
    stage = _stage(False)
    seen = []
    projection = next(m for m in stage.modules() if type(m) is nn.Linear
                      and not m.weight.requires_grad)
    projection.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    x = torch.randn(ROWS, SEQ, 32, requires_grad=True)
    with compute_context("fp32", "cpu", SharedWeightCasts()):
        stage(x)
    with compute_context("bf16", "cpu"):  # no step's casts: autocast's own
        stage(x)
    with compute_context("bf16", "cpu", SharedWeightCasts()):
        stage(x)
    assert [w.dtype for w in seen] == [torch.float32, torch.float32, torch.bfloat16]
    assert type(projection.weight) is nn.Parameter


# -- on Gloo ranks: the runtime's steps ---------------------------------------------------------

RUNTIME_CASES = [PartialCase("1|1-lora-bf16", "llama", (3, 2), ((2,), (2,)), (1, 1), partial=(0, 0),
                             dtype="bf16"),
                 PartialCase("1|1-lora-zero-bubble-fp16", "llama", (2, 2), ((2,), (2,)), (1, 1),
                             partial=(1, 0), schedule="zero_bubble", dtype="fp16"),
                 PartialCase("1|1-gpt2-lora-bf16", "gpt2", (3, 2), ((2,), (2,)), (1, 1),
                             partial=(0, 0), dtype="bf16")]


def _with_lora(rt, case: PartialCase) -> None:
    """LoRA on the rank's stage, adapters that change the function from the first step."""
    if case.family == "gpt2":
        gpt2_lora(rt.stage)
    else:
        apply_lora(rt.stage, r=4)
    with torch.no_grad():
        for n, p in rt.stage.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)


def _train_lora_runtime(rank: int, case: PartialCase) -> dict:
    """Two steps of ``case`` with LoRA on each rank's stage, with the step's shared casts, then
    with each micro-batch's own: losses, parameters, and the casts shared (AdamW's default
    weight decay)."""
    return train_shared_and_own(rank, case, prepare=_with_lora, opt_kw={})


def _run_all(rank: int, world_size: int) -> dict:
    return {c.name: _train_lora_runtime(rank, c) for c in RUNTIME_CASES}


@pytest.fixture(scope="module")
def runtime_results() -> list[dict]:
    return [o.value for o in run_ranks(_run_all, 2, timeout_s=240)]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", RUNTIME_CASES, ids=[c.name for c in RUNTIME_CASES])
def test_the_runtime_shares_frozen_casts_bit_for_bit(runtime_results, case):
    gpt2 = case.family == "gpt2"
    per_block = (GPT2_FROZEN_PER_BLOCK + GPT2_ADAPTERS_PER_BLOCK if gpt2
                 else FROZEN_PER_BLOCK + ADAPTERS_PER_BLOCK)

    def per_micro_batch(stage, kept_blocks):
        head = 1 if stage.layers[1] == case.plan().num_layers else 0  # the frozen LM head
        n = kept_blocks * per_block + head
        if stage.layers[0] == 0 and not stage.recompute_layers:
            # the first block's input (the frozen embedding's output) needs no gradient: its
            # q, k, v projections (GPT-2: its c_attn) and their lora_A keep no cast of their
            # weight
            n -= 2 if gpt2 else 6
        return n

    assert_step_casts_train_as_own(runtime_results, case, per_micro_batch)


def test_lending_only_where_a_stage_has_a_frozen_projection():
    """The runtime turns on the module hooks that lend frozen casts only for stages that hold a
    frozen projection: a LoRA stage does, the same stage before LoRA does not, and a step's
    casts made without lending leave a frozen weight's casts to autocast (one per forward)."""
    from hapt_hf.pipeline.precision import lends_frozen
    plain = build_stage(_config(), (1, 1 + BLOCKS), seed=3)
    assert not lends_frozen(plain)
    assert lends_frozen(_stage(last=False))
    assert not lends_frozen(build_stage(_config("gpt2"), (1, 1 + BLOCKS), seed=3))
    assert lends_frozen(_stage(last=False, family="gpt2"))
    assert lends_frozen(_frozen_first_block_stage())  # its Conv1D only
    stage = _stage(last=False)
    seen = []
    projection = next(m for m in stage.modules() if type(m) is nn.Linear
                      and not m.weight.requires_grad)
    projection.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    x = torch.randn(ROWS, SEQ, 32, requires_grad=True)
    for lend in (False, True):
        with compute_context("bf16", "cpu", SharedWeightCasts(lend_frozen=lend)):
            stage(x)
    assert seen == [torch.float32, torch.bfloat16]
