"""The loss on logits split by vocabulary columns equals transformers' on the whole logits.

Gloo ranks hold columns of the same logits as ``torch.chunk`` splits them (the first ranks
one column wider where ``t`` does not divide the vocabulary, and a rank with no column where
it is smaller than ``t``); each takes ``vocab_parallel_loss_sum`` and its backward, and both
are compared with ``ForCausalLMLoss`` (``causal_lm_loss_sum``) and its gradient on one
process: the loss the same on every rank, each rank's gradient its columns of the whole one.
Tolerance: rtol 1e-6, atol 1e-6 (fp32; the exponentials are summed over the shards, then
across them). Labels hold -100 (at the ends of rows and inside them) and ids in every rank's
columns; one case has no counted token at all.
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
