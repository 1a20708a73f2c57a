"""The loss on logits split by vocabulary columns equals transformers' on the whole logits.

Gloo ranks hold columns of the same logits as ``torch.chunk`` splits them (the first ranks
one column wider where ``t`` does not divide the vocabulary, and a rank with no column where
it is smaller than ``t``); each takes ``vocab_parallel_loss_sum`` and its backward, and both
are compared with ``ForCausalLMLoss`` (``causal_lm_loss_sum``) and its gradient on one
process: the loss the same on every rank, each rank's gradient its columns of the whole one.
Tolerance: rtol 1e-6, atol 1e-6 (fp32; the exponentials are summed over the shards, then
across them). Labels hold -100 (at the ends of rows and inside them) and ids in every rank's
columns; one case has no counted token at all.

In 16 bits, a TP-2 stage whose head is split (so its loss is this one) trains three clipped
AdamW steps under bf16, and under fp16 with dynamic loss scaling, against one process running
the same model under ``torch.autocast`` with the same optimizer: losses within 2e-3 (bf16) and
5e-4 (fp16) of the reference's, the tolerances of ``test_runtime_precision.py`` against fp32
(the row-wise all-reduces add 16-bit partial sums that one process keeps in one matmul;
measured: 1.2e-4 and 4.1e-5 at most).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.compat.transformers_api import causal_lm_loss_sum

pytestmark = pytest.mark.multiproc

CASES = [(97, "some"), (96, "some"), (3, "some"), (97, "none")]
"""(vocabulary, counted tokens): 97 over 2-4 ranks is uneven, 3 over 4 leaves a rank no column."""


def _data(vocab: int, counted: str, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(3, 7, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (3, 7), generator=g)
    labels[0, 2] = labels[2, 5] = -100
    if counted == "none":
        labels[:, 1:] = -100
    return logits, labels


def _shards(rank: int, world: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hapt_hf.pipeline.vocab_parallel import is_vocab_sharded, vocab_parallel_loss_sum
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for vocab, counted in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            logits, labels = _data(vocab, counted, dtype)
            whole = logits.clone().requires_grad_(True)
            ref = causal_lm_loss_sum(whole, labels, vocab)
            ref.backward()
            split = distribute_tensor(logits, mesh, [Shard(-1)], src_data_rank=None)
            split.requires_grad_(True)
            saved: list[int] = []

            def pack(t, saved=saved):
                saved.append(t.numel() * t.element_size())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = vocab_parallel_loss_sum(split, labels)
            loss.backward()
            grad = split.grad.to_local()
            cols = torch.chunk(torch.arange(vocab), world)
            mine = cols[rank] if rank < len(cols) else torch.arange(0)
            # plain lists: tensors would travel as shared memory the exiting rank takes along
            out.append({"case": (vocab, counted, str(dtype)), "sharded": is_vocab_sharded(split),
                        "loss": float(loss.detach()), "ref": float(ref.detach()), "dtype": str(loss.dtype),
                        "grad": grad.float().tolist(), "ref_grad": whole.grad[..., mine].float().tolist(),
                        "width": grad.shape[-1], "saved": saved, "rows": labels.numel()})
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return {w: [o.value for o in run_ranks(_shards, w, timeout_s=120)] for w in (2, 3, 4)}


@pytest.mark.parametrize("world", (2, 3, 4))
def test_the_loss_and_each_ranks_gradient_columns_match_the_whole_logits(results, world):
    for rank, per_rank in enumerate(results[world]):
        for r in per_rank:
            where = f"rank {rank} of {world}, {r['case']}"
            assert r["sharded"], where
            assert r["dtype"] == str(torch.float32), where  # taken in fp32, as transformers upcasts
            torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(r["ref"]), rtol=1e-6, atol=1e-6,
                                       msg=lambda m, where=where: f"{where}: {m}")
            grad, ref_grad = torch.tensor(r["grad"]), torch.tensor(r["ref_grad"])
            assert grad.shape == ref_grad.shape, where
            # a bf16 gradient is the fp32 one rounded: one bf16 step apart at most
            rtol = 1e-6 if r["case"][2] == str(torch.float32) else 2 ** -7
            torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=1e-6,
                                       msg=lambda m, where=where: f"{where}: {m}")
    # 3 columns over 4 ranks: torch.chunk leaves the last rank none, and it still takes part
    widths = [next(r["width"] for r in per if r["case"][0] == 3) for per in results[world]]
    chunks = [len(c) for c in torch.chunk(torch.arange(3), world)]
    assert widths == chunks + [0] * (world - len(chunks))


@pytest.mark.parametrize("world", (2, 3, 4))
def test_what_the_loss_keeps_for_its_backward_is_the_ranks_columns_of_one_fp32_softmax(results, world):
    # what the planner prices (cost_model.head_rank_keep_bytes): ceil(V / t) fp32 columns a
    # token, not V; beside them a few bytes a token (the target's column, two masks)
    for per_rank in results[world]:
        for r in per_rank:
            softmax = 4 * r["rows"] * r["width"]
            assert softmax in r["saved"], r["case"]
            # the target's column (int64) and the two masks (bool): 10 bytes a token
            assert sum(r["saved"]) == softmax + 10 * r["rows"], (r["case"], r["saved"])


def test_the_loss_sum_counts_what_transformers_counts():
    # nothing counted: 0, as ForCausalLMLoss with num_items_in_batch=1
    logits, labels = _data(97, "none")
    assert float(causal_lm_loss_sum(logits, labels, 97)) == 0.0


def test_whole_logits_are_refused_by_name():
    from hapt_hf.pipeline.vocab_parallel import vocab_parallel_loss_sum
    logits, labels = _data(5, "some")
    with pytest.raises(ValueError, match="sharded on the vocabulary"):
        vocab_parallel_loss_sum(logits, labels)


def _train_16bit(rank: int, world: int) -> dict:
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    from tests.pipeline.test_runtime_equivalence import make_batches
    from tests.pipeline.test_tensor_parallel_runtime import Case, tiny_config
    case = Case("tp2-head", "llama", (2,), ((2,),), (2,))
    config = tiny_config(case.family, case.num_blocks)
    out = {}
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        plan = replace(case.plan(), dtype=dtype,
                       loss_scaling="dynamic" if dtype == "fp16" else None).validate(world)
        scale = {"loss_scale_init": 2.0 ** 8} if dtype == "fp16" else {}
        rt = PipelineRuntime(plan, config, RuntimeConfig(timeout_s=60, seed=7, **scale))
        torch.manual_seed(7)
        ref = AutoModelForCausalLM.from_config(config,
                                               attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
        opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
        losses, ref_losses = [], []
        for b in make_batches(config.vocab_size, seed=11, rows=plan.global_batch_size):
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch_dtype):
                ref_loss = ref(b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            res = rt.train_step(b, opt, max_grad_norm=0.5)
            losses.append(res.loss)
            ref_losses.append(float(ref_loss))
            assert not res.skipped
        out[dtype] = {"losses": losses, "ref": ref_losses, "head": rt.tp.head}
        rt.shutdown()
    return out


@pytest.fixture(scope="module")
def sixteen_bit() -> list[dict]:
    return [o.value for o in run_ranks(_train_16bit, 2, timeout_s=180)]


@pytest.mark.parametrize("dtype,tol", [("bf16", 2e-3), ("fp16", 5e-4)])
def test_a_split_head_trains_in_16_bits_as_one_process_under_autocast(sixteen_bit, dtype, tol):
    for rank, per_rank in enumerate(sixteen_bit):
        r = per_rank[dtype]
        assert r["head"], "the head is not split: the test would not take this loss"
        for i, (got, want) in enumerate(zip(r["losses"], r["ref"])):
            assert abs(got - want) <= tol, (rank, dtype, i, got, want)


def test_the_gpu_checks_loss_part_runs_on_one_cpu_rank():
    # benchmarks/gpu_check.py's part 5 as `--device cpu` runs it: one rank, both losses
    from benchmarks.gpu_check import SIZES, _loss_on_one_rank
    args = {"size": "tiny", "dtype": "bf16", "device": "cpu", "micro_batch": 2, "seq": 16,
            "repeats": 2}
    r = run_ranks(_loss_on_one_rank, 1, args, timeout_s=120)[0].value
    tokens, vocab = 2 * 16, SIZES["tiny"].vocab
    assert r["tokens"] == tokens
    assert abs(r["vocab_parallel"]["loss"] - r["transformers"]["loss"]) <= 1e-5 * r["transformers"]["loss"]
    assert r["grad_rel"] <= 1e-6
    # what the loss keeps: its softmax over the whole vocabulary at t = 1, 10 bytes a token
    assert r["vocab_parallel"]["saved"] == 4 * tokens * vocab + 10 * tokens
    assert r["vocab_parallel"]["ms"] > 0 and r["transformers"]["ms"] > 0
