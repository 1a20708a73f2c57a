"""HaptTrainer's evaluation: one forward pass over every row of a dataset, as ``Trainer``
evaluates on one process.

The rows come in ``Trainer``'s one-process eval batches; each batch runs as the plan's global
batches (the last one filled with ignored rows). ``eval_loss`` is Trainer's: the mean over rows
of each batch's loss, that loss divided by the token count Trainer divides by. The logits (rank 0
holds them) go through ``preprocess_logits_for_metrics`` batch by batch; ``compute_metrics``
runs on rank 0 and its result is sent to every rank, so every rank's bookkeeping (best metric,
early stopping) agrees.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from transformers.trainer_pt_utils import nested_concat, nested_numpify
from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

from hapt_hf.integration.trainer_data import fill_rows, slice_rows, to_batch
from hapt_hf.pipeline.process_group import world_size
from hapt_hf.pipeline.runtime import Batch, PipelineRuntime

__all__ = ["EvalPass", "eval_pass", "count_tokens"]


class EvalPass(NamedTuple):
    """What one forward pass over a dataset gives (logits after preprocessing, on rank 0)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, Any]
    num_samples: int
    num_batches: int


def count_tokens(batch: Batch, predicted: int, rule: str) -> int:
    """The tokens ``Trainer`` divides ``batch``'s summed loss by: every label that is not -100
    under the ``'unshifted'`` rule (``compat.trainer_api.loss_count_rule``), else ``predicted``
    (the labels after the causal shift that are not -100)."""
    return int((batch.labels != -100).sum()) if rule == "unshifted" else predicted


def eval_pass(runtime: PipelineRuntime, loader, rule: str, prefix: str, with_logits: bool,
              preprocess: Callable | None, compute_metrics: Callable | None) -> EvalPass:
    """Forward every row of ``loader``'s batches through the pipeline (collective). The
    random streams training draws from are left as they were: a DataLoader draws its seed from
    the global generator each time it is iterated, so the pass runs in a fork of them."""
    devices = [runtime.device] if runtime.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _eval_pass(runtime, loader, rule, prefix, with_logits, preprocess, compute_metrics)


def _eval_pass(runtime: PipelineRuntime, loader, rule: str, prefix: str, with_logits: bool,
               preprocess: Callable | None, compute_metrics: Callable | None) -> EvalPass:
    g, seq_len = runtime.plan.global_batch_size, runtime.plan.seq_len
    weighted, rows_seen, batches = 0.0, 0, 0
    preds, labels = None, None
    for part in loader:
        batch = to_batch([part], None, seq_len, "eval_dataset")
        loss_sum, tokens, logits = 0.0, 0, []
        for lo in range(0, len(batch.input_ids), g):
            chunk = fill_rows(slice_rows(batch, lo, lo + g), g)
            n = int((chunk.labels[:, 1:] != -100).sum())
            if with_logits:
                pred = runtime.predict(chunk)
                loss = pred.loss
                if pred.logits is not None:
                    logits.append(pred.logits[:min(g, len(batch.input_ids) - lo)])
            else:
                loss = runtime.evaluate(chunk)
            loss_sum, tokens = loss_sum + loss * n, tokens + count_tokens(chunk, n, rule)
        rows = len(batch.input_ids)
        if tokens:
            weighted += loss_sum / tokens * rows
            rows_seen += rows
        batches += 1
        if logits:
            out = torch.cat(logits)
            if preprocess is not None:
                out = preprocess(out, batch.labels)
            preds = out if preds is None else nested_concat(preds, out, padding_index=-100)
            labels = batch.labels if labels is None \
                else nested_concat(labels, batch.labels, padding_index=-100)
    metrics = {f"{prefix}_loss": weighted / max(rows_seen, 1)}
    metrics.update(_metrics(runtime, compute_metrics, preds, labels, prefix))
    return EvalPass(None if preds is None else nested_numpify(preds),
                    None if labels is None else nested_numpify(labels), metrics, rows_seen,
                    batches)


def _metrics(runtime: PipelineRuntime, compute_metrics: Callable | None, preds, labels,
             prefix: str) -> dict[str, Any]:
    """``compute_metrics`` on rank 0 (which holds the logits), the result on every rank."""
    if compute_metrics is None:
        return {}
    found: dict[str, Any] = {}
    if runtime.rank == 0:
        found = denumpify_detensorize(compute_metrics(EvalPrediction(
            predictions=nested_numpify(preds), label_ids=nested_numpify(labels))))
    if world_size() > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in found.items()}
