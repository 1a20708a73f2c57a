"""The causal-LM loss on logits split by vocabulary columns over a replica's ranks.

A last stage whose LM head is split by vocabulary rows (:func:`hapt_hf.core.tp.head_sharded`)
leaves its logits as a ``DTensor`` sharded on the vocabulary (``ColwiseParallel(output_layouts=
Shard(-1), use_local_output=False)``). Gathering them whole on every rank would keep ``t``
times the logits and their fp32 log-softmax on each; instead each rank takes the loss of its
columns, as Megatron-LM's vocabulary-parallel cross-entropy and torch's ``loss_parallel`` do:
two all-reduces over the replica, of one number a token (the largest logit) and of two (the
sum of the exponentials, the target's logit, which one rank holds), and the backward is each rank's
columns of ``softmax - one_hot(target)``, with no collective of its own (the head input's
gradient is summed over the replica by the head's ``ColwiseParallel``).

torch's ``loss_parallel()`` context gives the same on DTensors, but it must also be in force
around the backward, which the pipeline runs elsewhere (and, under ``zero_bubble``, split
into its input and weight gradients); this function's backward needs nothing in force.

The loss is what transformers' ``ForCausalLMLoss`` takes with ``num_items_in_batch=1`` (the
sum over tokens whose shifted label is not -100), from the logits cast to fp32 as it casts
them; only the order in which the exponentials are summed differs (over the shards, then
across them).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

__all__ = ["is_vocab_sharded", "vocab_parallel_loss_sum", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""The label transformers' loss skips."""


def is_vocab_sharded(logits: Any) -> bool:
    """Whether ``logits`` are a DTensor split on their last (vocabulary) dimension."""
    return isinstance(logits, DTensor) and len(logits.placements) == 1 \
        and isinstance(logits.placements[0], Shard) \
        and logits.placements[0].dim in (-1, logits.ndim - 1)


def vocab_parallel_loss_sum(logits: DTensor, labels: Tensor) -> Tensor:
    """The SUM of per-token cross-entropies over shifted labels that are not -100 (0-dim,
    fp32, the same on every rank of the mesh), from ``logits`` [b, s, vocab] split on the
    vocabulary over a 1-D mesh and the un-shifted ``labels`` [b, s]."""
    if not is_vocab_sharded(logits):
        raise ValueError("vocab_parallel_loss_sum takes logits sharded on the vocabulary "
                         f"(a DTensor with placements (Shard(-1),)), got {type(logits).__name__}")
    mesh = logits.device_mesh
    vocab = logits.shape[-1]
    chunk = -(-vocab // mesh.size())  # torch.chunk's split: the first ranks take ceil(V / t)
    offset = min(mesh.get_local_rank() * chunk, vocab)
    local = logits.to_local()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    rows = shifted.numel()  # a rank may hold no column (a vocabulary smaller than t)
    return _VocabParallelCrossEntropy.apply(local.reshape(rows, local.shape[-1]),
                                            shifted.reshape(rows).to(local.device), offset,
                                            mesh.get_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of rows whose columns are split over ``group`` (this rank's columns
    start at ``offset``); targets of -100 count nothing. ``x`` in any float dtype: the loss is
    taken on its fp32 copy, as transformers upcasts the logits, and that one copy is worked in
    place (the forward holds the logits and one fp32 copy, which becomes the saved softmax);
    the gradient comes back in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, target: Tensor, offset: int, group: Any) -> Tensor:
        width = x.shape[-1]
        ctx.dtype = x.dtype
        with torch.no_grad():
            z = x.float() if x.dtype != torch.float32 else x.clone()
            top = z.max(dim=-1).values if width else z.new_full((z.shape[0],), -torch.inf)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            z.sub_(top[:, None])
            valid = target != IGNORE_INDEX
            local = target - offset
            mine = valid & (local >= 0) & (local < width)
            index = local.clamp(0, max(width - 1, 0))[:, None]
            picked = torch.where(mine, z.gather(1, index).squeeze(1), 0.0) if width \
                else torch.zeros_like(top)
            z.exp_()  # the exponentials in place, then the softmax
            total = z.sum(dim=-1)
            sums = torch.stack([picked, total])
            dist.all_reduce(sums, group=group)  # one call for the target's logit and the sum
            picked, total = sums[0], sums[1]
            loss = torch.where(valid, total.log() - picked, 0.0).sum()
            z.div_(total[:, None])
        ctx.save_for_backward(z, index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        softmax, index, mine, valid = ctx.saved_tensors
        out = softmax.clone()  # a backward run twice (retain_graph) finds the softmax as saved
        if out.shape[-1]:  # the target's column, where this rank holds it (no host sync)
            out.scatter_add_(1, index, -mine.to(out.dtype)[:, None])
        out.mul_((valid.to(out.dtype) * grad)[:, None])
        return out.to(ctx.dtype), None, None, None
