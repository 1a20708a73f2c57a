"""Run a plan's schedule over torch.distributed: one rank, one stage replica (or its share of a
replica held by several ranks: tensor parallelism, :mod:`~hapt_hf.pipeline.tensor_parallel`),
one action list.

Every rank holds the whole global batch (token ids), builds only its own stage, and runs its
stage's list from :func:`hapt_hf.planner.schedule.build_schedule`: receives posted once the
sender may send, waited for at the compute that needs them; sends right after the compute that
made them; each boundary's each direction on a group of its own (``transfer_groups``). The
loss is the mean over the non-ignored tokens of the WHOLE global batch: the last stage divides
each micro-batch's token sum by the global token count (every rank has the full batch) before
backward, so gradients add up.

Precision comes from the plan (:mod:`~hapt_hf.pipeline.precision`): fp32 modules and optimizer
state, the forward under autocast to the plan's compute dtype (on CPU too), activations and
their gradients on the wire in that dtype. A plan with dynamic loss scaling (fp16) scales the
last stage's loss, unscales every gradient after the all-reduces and lets the whole job decide
together whether a step overflowed (:mod:`~hapt_hf.pipeline.loss_scale`).

Around the action loop: settings, batch and results in :mod:`~hapt_hf.pipeline.runtime_types`,
process groups in :mod:`~hapt_hf.pipeline.process_group`, the gradient all-reduces (bucketed,
overlapping the last backward) and statistics in :mod:`~hapt_hf.pipeline.grad_sync`, gathers in
:mod:`~hapt_hf.pipeline.gather`, transfers in :mod:`~hapt_hf.pipeline.transfers`, failure records in
:mod:`~hapt_hf.pipeline.failure`.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PretrainedConfig

from hapt_hf.compat.torch_api import backward_input, backward_weight
from hapt_hf.core.schedules import runtime_refusal
from hapt_hf.pipeline.exit_guard import close_at_exit
from hapt_hf.pipeline.failure import FailureChannel, PipelineFailure, failed_during
from hapt_hf.pipeline.gather import gather_logits, gather_state_dict
from hapt_hf.pipeline.grad_sync import GradSync
from hapt_hf.pipeline.loss_scale import DynamicLossScaler
from hapt_hf.pipeline.placement import Piece, RankWork, max_in_flight, rank_works
from hapt_hf.pipeline.precision import (SharedWeightCasts, autocast_mismatch, compute_context,
                                        inference_context, lends_frozen, torch_dtype)
from hapt_hf.pipeline.process_group import init_distributed, local_device, stage_groups, transfer_groups
from hapt_hf.pipeline.tensor_parallel import (TensorParallelShards, full_state_dict, sequence_parallel_refusal,
                                              shard_stage, tp_plan_refusal)
from hapt_hf.pipeline.runtime_types import (Batch, BatchError, Prediction, RuntimeConfig, RuntimeSetupError,
                                            StepResult, batch_tokens, check_batch)
from hapt_hf.pipeline.transfers import Transfer
from hapt_hf.pipeline.zero import StageOptimizers
from hapt_hf.planner.plan import Plan, Stage
from hapt_hf.planner.schedule import Action, ActionKind

# settings, results, errors and process-group set-up: importable from here too, as always
__all__ = ["Batch", "RuntimeConfig", "StepResult", "Prediction", "RuntimeSetupError",
           "BatchError", "PipelineFailure", "init_distributed", "PipelineRuntime"]

_runtime_ids = itertools.count()


@dataclass
class _MicroBatch:
    """State of one micro-batch of one stage on this rank between its forward and the end of
    its backward."""

    recv: list[Transfer]
    inputs: Tensor | None = None
    output: Tensor | None = None
    grad_recv: list[Transfer] | None = None
    weight_state: Any = None
    """After a split backward's ``I``: what its ``W`` needs (the gradients kept at the graph
    nodes leading to the weights)."""
    root: tuple[Tensor, Tensor | None] | None = None
    """After ``I`` on the first stage (whose input, token ids, has no gradient): the output
    and its gradient, from which ``W`` runs the whole backward."""


def _several_stages_refusal(plan: Plan) -> str | None:
    """Why this runtime cannot hold the stages an interleaved plan gives one rank (one
    sentence), or None: a rank's stages are one module to the optimizer and to the
    tensor-parallel sharding, so they share their optimizer and sp settings."""
    for st in plan.stages:
        first = next(f for f in plan.stages if set(f.ranks) & set(st.ranks))
        if st.sequence_parallel != first.sequence_parallel:  # one sharding of the rank's blocks
            return (f"stages {first.index} and {st.index} sit on the same ranks "
                    f"{list(st.ranks)} but set sp {first.sequence_parallel} and "
                    f"{st.sequence_parallel}; give a rank's stages one setting")
        if st.optimizer != first.optimizer:
            return (f"stages {first.index} and {st.index} sit on the same ranks "
                    f"{list(st.ranks)} but set optimizer {first.optimizer!r} and "
                    f"{st.optimizer!r}; a rank's stages step as one optimizer: give them one "
                    "setting")
    return None


class PipelineRuntime:
    """Executes the plan's schedule for this rank. See the module docstring; the optimizer
    the plan asks for is made, prepared and stepped by :attr:`optimizers`
    (:class:`~hapt_hf.pipeline.zero.StageOptimizers`)."""

    def __init__(self, plan: Plan, model_config: PretrainedConfig,
                 config: RuntimeConfig = RuntimeConfig()) -> None:
        if not dist.is_initialized():
            raise RuntimeSetupError("torch.distributed is not initialised; call "
                                    "hapt_hf.pipeline.init_distributed() first")
        plan.validate(world_size=dist.get_world_size())
        problem = runtime_refusal(plan.schedule)
        if problem is not None:
            raise RuntimeSetupError(problem)
        mismatch = autocast_mismatch(plan.dtype, config.autocast_dtype)
        if mismatch:
            raise RuntimeSetupError(mismatch)
        for st in plan.stages:  # every rank refuses alike, before any collective
            problem = tp_plan_refusal(model_config, st.tp) or (sequence_parallel_refusal(
                model_config, st.tp, plan.layer_unit) if st.sequence_parallel else None)
            if problem is not None:
                raise RuntimeSetupError(f"stage {st.index}: {problem}")
        problem = _several_stages_refusal(plan)
        if problem is not None:
            raise RuntimeSetupError(problem)
        self.plan, self.config = plan, config
        self.loss_scaler: DynamicLossScaler | None = config.loss_scaler(plan)
        """The job's loss scale (fp16 plans); its state goes into checkpoints."""
        self.wire_dtype = torch_dtype(plan.dtype)
        """Activations and their gradients cross stage boundaries in the compute dtype."""
        self.rank = dist.get_rank()
        self.works: dict[int, RankWork] = {w.stage.index: w for w in rank_works(plan, self.rank)}
        """One per stage this rank holds, by stage index (several under an interleaved
        schedule); each carries the rank's whole list."""
        self.work: RankWork = next(iter(self.works.values()))
        """The rank's first stage's (its replica, slice and list are every one's)."""
        self.stage_plan: Stage = self.work.stage
        self._holds_last = any(w.is_last for w in self.works.values())
        self.device = torch.device(config.device or local_device())
        self._all_ranks = tuple(range(plan.world_size))
        # The channel comes first: a rank that fails while building its stage (a damaged
        # checkpoint file, say) or dies in the first collectives is named by the others.
        self.channel = FailureChannel(f"rt{next(_runtime_ids)}", self.rank, config.timeout_s)
        try:
            self._set_up(model_config)
        except BaseException:
            self.channel.close()
            raise
        close_at_exit(self, "shutdown")  # at exit, if still running (see exit_guard)
        # who takes part in this rank's gradient all-reduces (its replicas, the tied group)
        self._grad_peers = tuple(sorted(set(self.stage_plan.ranks) | (
            set(self.work.tied_ranks) if self._grads.tied_pg is not None else set())))
        self.in_flight_limit = max_in_flight(self.work.actions)
        """Forwards the schedule lets this rank hold before their backward ends (its warm-up;
        a split backward's deferral too)."""
        self.max_live_activations = 0
        """Most micro-batches whose forward state this rank kept at once (measured)."""
        self.weight_casts_shared = 0
        """16-bit weight casts the last step's backwards kept as an earlier micro-batch's
        (each a copy not kept; :class:`~hapt_hf.pipeline.precision.SharedWeightCasts`)."""
        self._live = 0

    def _set_up(self, model_config: PretrainedConfig) -> None:
        """Build this rank's stages (every rank refuses if one cannot) and the process groups."""
        from hapt_hf.pipeline.stage import RankStages, build_stage
        s = self.stage_plan.index
        # a tensor-parallel stage is held whole in host memory only; sharding then moves each
        # rank's slices to its device, so the device never holds the whole stage
        build_device = torch.device("cpu") if self.work.tp > 1 else self.device

        def build() -> dict[int, Any]:
            return {i: build_stage(
                model_config, w.stage.layers, seed=self.config.seed, init_weights=self.config.init_weights,
                checkpoint_dir=self.config.checkpoint_dir, device=build_device,
                recompute=w.stage.recompute,
                recompute_layers=w.stage.recomputed_units(self.plan.num_layers),
                layer_unit=self.plan.layer_unit,
                attn_implementation=self.plan.attn_implementation) for i, w in self.works.items()}
        self.stages = self.channel.agree("the stage build", s, build)
        """This rank's stage modules by stage index (the chunks of an interleaved rank)."""
        self.stage = (next(iter(self.stages.values())) if len(self.stages) == 1
                      else RankStages(self.stages))
        """The rank's part of the model as one module: its stage, or (interleaved) its chunks
        under the full model's paths (:class:`~hapt_hf.pipeline.stage.RankStages`)."""
        self.hidden_size = int(model_config.hidden_size)
        # what a stage's input and output are under autocast: the fp32 residual stream
        self._stream_dtype = next(self.stage.parameters()).dtype
        with self.channel.collective("the process-group set-up", s, self._all_ranks):
            groups = stage_groups(self.plan, self.rank, self.work.tied_ranks,
                                  bool(getattr(model_config, "tie_word_embeddings", False)))
            self._transfer_pgs = transfer_groups(self.plan, tuple(self.works.values()),
                                                 self.device)
        self.tp: TensorParallelShards | None = None
        """This replica's tensor-parallel sharding (None: the replica is this rank alone)."""
        if groups.tp is not None:
            with self.channel.collective("the tensor-parallel sharding", s, self.work.tp_ranks):
                self.tp = shard_stage(self.stage, model_config, groups.tp, self.device,
                                      sequence_parallel=self.stage_plan.sequence_parallel)
            self.stage.to(self.device)  # the parameters left whole, and the buffers
        self.optimizers = StageOptimizers(self.stage_plan, self.stage, groups.dp, self.channel)
        """This stage's optimizer as the plan says (a sharded one splits among the replicas'
        ranks that hold the same shard)."""
        self._grads = GradSync(self.stage, groups.dp, groups.tied, self.config.grad_bucket_bytes,
                               self.config.overlap_grad_sync, self.tp)

    @property
    def bucket_launch_s(self) -> list[float]:
        """When each gradient bucket of the last ``forward_backward`` went to the all-reduce,
        in seconds after the end of that iteration's last backward (negative: launched during
        it, i.e. overlapped), in launch order; [] for a stage without replicas."""
        return self._grads.launch_s()

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.stage.parameters())

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any = None,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """This stage's optimizer as the plan says (:meth:`StageOptimizers.make
        <hapt_hf.pipeline.zero.StageOptimizers.make>`): replicated, or sharded among the
        stage's replicas. ``params``: default, the stage's parameters that train."""
        return self.optimizers.make(optimizer_class, params, **kwargs)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer built elsewhere holding its state as the plan says
        (:meth:`StageOptimizers.prepare <hapt_hf.pipeline.zero.StageOptimizers.prepare>`);
        call it before the first step."""
        return self.optimizers.prepare(optimizer)

    def step_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None,
                       result: Any = None) -> Any:
        """Step the optimizer, then the LR scheduler; gives back ``result``
        (:meth:`StageOptimizers.step <hapt_hf.pipeline.zero.StageOptimizers.step>`)."""
        return self.optimizers.step(optimizer, lr_scheduler, result)

    # -- public steps ----------------------------------------------------------------------
    def forward_backward(self, batch: Batch) -> float:
        """One iteration's forwards and backwards; gradients added to ``.grad`` of every rank
        (unscaled under loss scaling; the overflow decision and the scale's update belong to
        :meth:`train_step`)."""
        ids, labels, mask, tokens = self._inputs(batch)
        self._grads.update_buckets()
        stash = self._grads.stash()
        loss_sum, _ = self._run(self.work.actions, ids, labels, mask, tokens, backward=True)
        with self.channel.collective("the gradient all-reduce", self.stage_plan.index,
                                     self._grad_peers):
            self._sync_grads()
        if self.loss_scaler is not None:
            # the last stage multiplied the loss by the scale: .grad then holds true gradients
            self._grads.unscale(self.loss_scaler.scale)
        self._grads.restore(stash)
        return self._global_loss(loss_sum, tokens)

    def evaluate(self, batch: Batch) -> float:
        """Forward only, in eval mode (:func:`~hapt_hf.pipeline.precision.inference_context`);
        the same loss definition as :meth:`forward_backward`."""
        ids, labels, mask, tokens = self._inputs(batch)
        with inference_context(self.stage, self.device):
            loss_sum, _ = self._run(self._forward_actions(), ids, labels, mask, tokens,
                                    backward=False)
        return self._global_loss(loss_sum, tokens)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so that the global norm (each parameter once) is <= max_norm."""
        sq, _ = self._grad_stats(norm=True, check=False)
        norm = math.sqrt(sq)
        self._grads.clip(norm, max_norm)
        return norm

    def _grad_stats(self, norm: bool, check: bool) -> tuple[float, bool]:
        """From ONE all-reduce over every rank: the squared global gradient norm, each
        parameter counted once (0 unless ``norm``), and whether any rank holds an inf or NaN
        gradient (False unless ``check``): the job's one overflow decision."""
        # replicas hold the same gradients after the sum: replica 0 counts them
        stats = self._grads.local_stats(norm and self.work.replica == 0, check,
                                        skip_tied=self._holds_last, device=self.device)
        what = "the gradient-norm all-reduce" if not check else "the overflow check"
        with self.channel.collective(what, self.stage_plan.index, self._all_ranks):
            dist.all_reduce(stats)
        return float(stats[0].item()), bool(stats[1].item() > 0)

    def train_step(self, batch: Batch, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None,
                   max_grad_norm: float | None = None) -> StepResult:
        """Zero, run the iteration, clip, step the optimizer and the LR scheduler.

        With loss scaling, the overflow flag rides in the clipping's all-reduce (one collective
        over every rank either way). On an overflow anywhere, every rank drops its gradients,
        skips the optimizer and the LR-scheduler step (as ``Trainer`` does for a step its
        GradScaler skipped) and halves the scale; the loss is reported all the same.
        ``optimizer``: from ``make_optimizer`` / ``prepare_optimizer`` where the plan shards it.
        """
        self.optimizers.check(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scale = None if self.loss_scaler is None else self.loss_scaler.scale
        loss = self.forward_backward(batch)
        clip = max_grad_norm is not None
        if self.loss_scaler is None:
            return self.step_optimizer(optimizer, lr_scheduler, StepResult(
                loss, self.clip_grad_norm_(max_grad_norm) if clip else None))
        sq, overflow = self._grad_stats(norm=clip, check=True)
        norm = math.sqrt(sq) if clip else None
        self.loss_scaler.update(overflow)
        if overflow:
            optimizer.zero_grad(set_to_none=True)
            return StepResult(loss, norm, skipped=True, loss_scale=scale)
        if clip:
            self._grads.clip(norm, max_grad_norm)
        return self.step_optimizer(optimizer, lr_scheduler, StepResult(loss, norm,
                                                                       loss_scale=scale))

    def predict(self, batch: Batch) -> Prediction:
        """Loss and full logits of one global batch, forward only, in eval mode
        (:func:`~hapt_hf.pipeline.precision.inference_context`); the loss as :meth:`evaluate`
        computes it."""
        ids, labels, mask, tokens = self._inputs(batch)
        with inference_context(self.stage, self.device):
            loss_sum, outs = self._run(self._forward_actions(), ids, labels, mask, tokens,
                                       backward=False, keep_logits=True)
        loss = self._global_loss(loss_sum, tokens)
        with self.channel.collective("the logits gather", self.stage_plan.index,
                                     self._all_ranks):
            logits = gather_logits(outs, ids.shape, self.plan, self.rank,
                                   self.stage.config.vocab_size, self.device)
        if logits is not None:  # without the sequence-parallel padding
            logits = logits[:, :batch.input_ids.shape[1]]
        return Prediction(loss, logits)

    def predict_logits(self, batch: Batch) -> Tensor | None:
        """Full logits [G, s, V] on rank 0 (None elsewhere), forward only, in eval mode."""
        return self.predict(batch).logits

    def gather_state_dict(self, dst: int = 0) -> dict[str, Tensor] | None:
        """The full model's state dict (Hugging Face keys) on rank ``dst``, None elsewhere."""
        mine = None
        if self.work.replica == 0:  # each of its ranks takes part in gathering the shards
            full = full_state_dict(self.stage.hf_state_dict())
            mine = {k: v.cpu() for k, v in full.items()} if self.work.tp_rank == 0 else None
        with self.channel.collective("the state-dict gather", self.stage_plan.index,
                                     self._all_ranks):
            return gather_state_dict(mine, self.rank, dst)

    def shutdown(self) -> None:
        """Stop the watchdog, drop the groups (not destroyed: see ``exit_guard``)."""
        self.channel.close()
        self._grads.release_pgs()
        self._transfer_pgs = {}

    # -- the action loop and its helpers ---------------------------------------------------
    def _forward_actions(self) -> tuple[Action, ...]:
        return tuple(a for a in self.work.actions
                     if a.kind in (ActionKind.F, ActionKind.RECV_F, ActionKind.SEND_F))

    def _run(self, actions: tuple[Action, ...], ids: Tensor, labels: Tensor,
             mask: Tensor | None, tokens: int, *, backward: bool,
             keep_logits: bool = False) -> tuple[Tensor, dict[int, Tensor]]:
        """Execute ``actions``; (this rank's loss sum, zero off the last stage; the last
        stage's logits by micro-batch when ``keep_logits``, else {})."""
        mbs: dict[tuple[int, int], _MicroBatch] = {}  # by (the action's stage, micro-batch)
        sends: list[Transfer] = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        logits: dict[int, Tensor] = {}
        seq = ids.shape[1]
        # each stage's last backward (B, or W of a split one) makes its gradients final: the
        # bucket hooks launch the replicas' all-reduce during it
        finals = {a.stage: i for i, a in enumerate(actions)
                  if a.kind in (ActionKind.B, ActionKind.W)}
        final_at = {i: s for s, i in finals.items()}
        # one 16-bit copy of each weight for the step's micro-batches in flight, not one each
        casts = (SharedWeightCasts(any(lends_frozen(m) for m in self.stages.values()))
                 if backward and self.plan.dtype != "fp32" else None)
        for i, a in enumerate(actions):
            k, s = a.microbatch, a.stage
            key, work = (s, k), self.works[s]
            try:
                if a.kind is ActionKind.RECV_F:
                    mbs[key] = _MicroBatch(self._post_recv(work.upstream, s, k, seq, "RECV_F"))
                elif a.kind is ActionKind.F:
                    m = mbs.setdefault(key, _MicroBatch([]))
                    # keeping logits: the stage returns them, and the loss is taken from them
                    out = self._forward(m, s, k, ids, None if keep_logits else labels, mask,
                                        tokens, backward, casts)
                    if work.is_last and keep_logits:
                        logits[k] = out
                        out = self.stages[s].loss_sum(out, labels[self._rows(k)].to(self.device))
                    if work.is_last and work.tp_rank == 0:  # once per replica
                        loss_sum += out.detach().double().cpu()
                elif a.kind is ActionKind.SEND_F:
                    sends += self._post_send(work.downstream, s, k, mbs[key].output, "SEND_F")
                    if not backward:
                        mbs[key].output = None
                elif a.kind is ActionKind.RECV_B:  # before F(k) on a stage one micro-batch deep
                    mbs.setdefault(key, _MicroBatch([])).grad_recv = self._post_recv(
                        work.downstream_grads, s, k, seq, "RECV_B")
                elif a.kind in (ActionKind.B, ActionKind.I, ActionKind.W):
                    final = self._grads.last_backward(list(self.stages[s].parameters())) \
                        if i in final_at else contextlib.nullcontext()
                    with final:
                        if a.kind is ActionKind.B:
                            self._backward(mbs[key], s, k)
                        elif a.kind is ActionKind.I:
                            self._backward_input(mbs[key], s, k)
                        else:
                            self._backward_weight(mbs.pop(key), s, k)
                    if a.kind is ActionKind.B and work.is_first:
                        mbs.pop(key, None)
                elif a.kind is ActionKind.SEND_B:
                    m = mbs[key] if self.plan_splits else mbs.pop(key)
                    sends += self._post_send(work.upstream_grads, s, k, m.inputs.grad, "SEND_B")
                    m.inputs = None
            except PipelineFailure:
                raise
            except Exception as e:  # noqa: BLE001 - recorded for every rank, then re-raised
                msg = failed_during(self.rank, f"{a.kind.value} (stage {s}, micro-batch {k})", e)
                raise PipelineFailure(self.channel.record(msg)) from e
        self.channel.wait(sends, self.stage_plan.index)
        if casts is not None:
            self.weight_casts_shared = casts.shared
        return loss_sum, logits

    @property
    def plan_splits(self) -> bool:
        """Whether the plan's schedule splits each backward into ``I`` and ``W``."""
        return any(a.kind is ActionKind.W for a in self.work.actions)

    def _forward(self, m: _MicroBatch, s: int, k: int, ids: Tensor, labels: Tensor | None,
                 mask: Tensor | None, tokens: int, backward: bool,
                 casts: SharedWeightCasts | None = None) -> Tensor:
        rows = self._rows(k)
        work = self.works[s]
        if work.is_first:
            x = ids[rows].to(self.device)
        else:
            self.channel.wait(m.recv, s)
            x = torch.cat([t.buffer for t in m.recv]) if len(m.recv) > 1 else m.recv[0].buffer
            x = x.to(self._stream_dtype)  # from the wire's compute dtype
            x.requires_grad_(backward)
        m.recv = []
        kwargs: dict[str, Any] = {}
        if mask is not None:
            kwargs["attention_mask"] = mask[rows].to(self.device)
        if work.is_last and labels is not None:
            kwargs["labels"] = labels[rows].to(self.device)
        with self._tp_compute("F", s, k), compute_context(self.plan.dtype, self.device, casts):
            out = self.stages[s](x, **kwargs)
        kept = out
        if work.is_last and labels is not None:
            kept = out / tokens  # the global mean: micro-batch and replica gradients just add
        if backward:
            m.inputs, m.output = (None if work.is_first else x), kept
            self._live += 1
            self.max_live_activations = max(self.max_live_activations, self._live)
        else:
            m.output = kept
        return out

    def _backward_root(self, m: _MicroBatch, s: int) -> tuple[Tensor, Tensor | None]:
        """Where micro-batch ``m``'s backward on stage ``s`` starts: the (scaled) loss on the
        last stage, else the output and the gradient received for it."""
        if self.works[s].is_last:
            scaler = self.loss_scaler
            return (m.output if scaler is None else m.output * scaler.scale), None
        self.channel.wait(m.grad_recv, s)
        bufs = [t.buffer for t in m.grad_recv]
        grad = torch.cat(bufs) if len(bufs) > 1 else bufs[0]
        return m.output, grad.to(m.output.dtype)

    def _backward(self, m: _MicroBatch, s: int, k: int) -> None:
        root, grad = self._backward_root(m, s)
        with self._tp_compute("B", s, k):
            torch.autograd.backward(root, grad)
        m.output, m.grad_recv = None, None
        self._live -= 1

    def _backward_input(self, m: _MicroBatch, s: int, k: int) -> None:
        """``I``: the gradient of the stage's input only (left in ``m.inputs.grad`` for
        ``SEND_B``), the graph kept for ``W``, as torch's pipelining splits a backward. The
        first stage's input (token ids) has none: its ``W`` runs the whole backward."""
        root, grad = self._backward_root(m, s)
        if self.works[s].is_first:
            m.root = (root, grad)
        else:
            with self._tp_compute("I", s, k):
                _, m.weight_state = backward_input(
                    [root], None if grad is None else [grad], [m.inputs],
                    self.stages[s].parameters())
        m.output, m.grad_recv = None, None

    def _backward_weight(self, m: _MicroBatch, s: int, k: int) -> None:
        """``W``: the weight gradients of the backward ``I`` began, added to ``.grad`` as the
        whole backward adds them."""
        with self._tp_compute("W", s, k):
            if m.root is not None:
                torch.autograd.backward(*m.root)
            else:
                # each group of weights goes to its buckets as soon as its gradients are in
                backward_weight(list(self.stages[s].parameters()), m.weight_state,
                                self._grads.accumulated)
        m.root = m.weight_state = None
        self._live -= 1

    def _tp_compute(self, kind: str, s: int, k: int) -> Any:
        """Around a compute of a tensor-parallel replica, whose all-reduces wait for its other
        ranks: a rank of the replica that stops is named (``FailureChannel.computing_with``)."""
        if self.tp is None:
            return contextlib.nullcontext()
        return self.channel.computing_with(
            f"{kind} (stage {s}, micro-batch {k}) with its tensor-parallel ranks "
            f"{list(self.work.tp_ranks)}", s, self.work.tp_ranks)

    def _transfer_pg(self, s: int, kind: str) -> Any:  # the boundary's group for the direction
        return self._transfer_pgs[(s - (kind in ("RECV_F", "SEND_B")), kind[-1] == "F")]

    def _post_recv(self, pieces: tuple[Piece, ...], s: int, k: int, seq: int,
                   kind: str) -> list[Transfer]:
        out, pg = [], self._transfer_pg(s, kind)
        src = s - 1 if kind == "RECV_F" else s + 1
        for p in pieces:
            buf = torch.empty((p.size, seq, self.hidden_size), dtype=self.wire_dtype,
                              device=self.device)
            what = f"{kind} of micro-batch {k} from rank {p.peer} (stage {src})"
            out.append(self.channel.start(lambda b=buf, q=p.peer: dist.irecv(b, q, pg, tag=k), p.peer,
                                          what, buf, s))
        return out

    def _post_send(self, pieces: tuple[Piece, ...], s: int, k: int, t: Tensor,
                   kind: str) -> list[Transfer]:
        t = t.detach().to(self.wire_dtype)
        out, pg = [], self._transfer_pg(s, kind)
        for p in pieces:
            buf = t[p.start:p.stop].contiguous()
            what = f"{kind} of micro-batch {k} to rank {p.peer}"
            out.append(self.channel.start(lambda b=buf, q=p.peer: dist.isend(b, q, pg, tag=k), p.peer,
                                          what, buf, s))
        return out

    def _inputs(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor | None, int]:
        """(input ids, labels, padding mask, tokens the loss averages over) of a batch that
        fits the plan."""
        ids, labels, mask = check_batch(batch, self.plan.global_batch_size)
        tokens = batch.num_items or batch_tokens(labels)
        return (*self._sequence_parallel_padding(ids, labels, mask), tokens)

    def _sequence_parallel_padding(self, ids: Tensor, labels: Tensor, mask: Tensor | None
                                   ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The batch right-padded to a multiple of every sequence-parallel stage's TP degree,
        which splits the sequence evenly (as is where it divides): padding masked, its labels
        ignored, so no real token's output changes (causal attention looks back only) and the
        loss's terms are the same."""
        multiple = math.lcm(*(st.tp for st in self.plan.stages if st.sequence_parallel))
        pad = -ids.shape[1] % multiple
        if not pad:
            return ids, labels, mask
        fill = torch.nn.functional.pad
        mask = torch.ones_like(ids) if mask is None else mask
        return fill(ids, (0, pad)), fill(labels, (0, pad), value=-100), fill(mask, (0, pad))

    def _rows(self, k: int) -> slice:
        base = k * self.plan.micro_batch_size
        lo, hi = self.work.samples
        return slice(base + lo, base + hi)

    def _sync_grads(self) -> None:
        """The gradient all-reduce (inside the collective that names a rank lost in it)."""
        self._grads.sync()

    def _global_loss(self, loss_sum: Tensor, tokens: int) -> float:
        t = loss_sum.to(self.device)  # zero except on the last stage's replicas
        with self.channel.collective("the loss all-reduce", self.stage_plan.index,
                                     self._all_ranks):
            dist.all_reduce(t)
        return float(t.item() / tokens)
