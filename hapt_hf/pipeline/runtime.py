"""Run a plan's schedule over torch.distributed: one rank, one stage replica, one action list.

Every rank holds the whole global batch (it is small: token ids), builds only its own stage, and
executes its stage's action list from :func:`hapt_hf.planner.schedule.build_schedule`. Receives
are posted where the list posts them and waited for at the compute that needs them; sends are
posted right after the compute that produced them. The loss is the mean over the non-ignored
tokens of the WHOLE global batch: the last stage returns per-micro-batch token sums, each is
divided by the global token count (counted from the full batch every rank has) before backward,
so that replica and micro-batch gradients simply add up.

The replicas of a stage all-reduce their gradients in buckets of about ``GRAD_BUCKET_BYTES``
(the cost model's figure), in reverse parameter order, as DDP does: during the iteration's last
backward, a hook on every trainable parameter counts the gradients made final, and each bucket
is launched (asynchronously) once all of its gradients are, in bucket order, so the transfer
overlaps the rest of that backward. The step waits for every bucket before it returns.

Precision comes from the plan (:mod:`hapt_hf.pipeline.precision`): fp32 modules and optimizer
state, the forward under autocast to the plan's compute dtype (on CPU too), activations and
their gradients on the wire in that dtype. A plan with dynamic loss scaling (fp16) scales the
last stage's loss, unscales every gradient after the all-reduces and lets the whole job decide
together whether a step overflowed (:mod:`hapt_hf.pipeline.loss_scale`).
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PretrainedConfig

from hapt_hf.pipeline.comm import FailureChannel, PipelineFailure, Transfer, failed_during
from hapt_hf.pipeline.loss_scale import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE, DynamicLossScaler
from hapt_hf.pipeline.placement import Piece, RankWork, max_in_flight, rank_work, replica_slice
from hapt_hf.pipeline.precision import autocast_mismatch, compute_context, torch_dtype
from hapt_hf.core.defaults import GRAD_BUCKET_BYTES
from hapt_hf.planner.plan import Plan, StagePlan
from hapt_hf.planner.schedule import Action, ActionKind, build_schedule

__all__ = ["Batch", "RuntimeConfig", "StepResult", "Prediction", "RuntimeSetupError",
           "BatchError", "PipelineFailure", "init_distributed", "exit_distributed",
           "PipelineRuntime"]

_runtime_ids = itertools.count()


class RuntimeSetupError(ValueError):
    """The runtime cannot start as asked (no process group, wrong world size, bad setting)."""


class BatchError(ValueError):
    """A batch that does not fit the plan; the message names the field and the fix."""


@dataclass(frozen=True)
class Batch:
    """The whole global batch; every rank gets the same one."""

    input_ids: Tensor
    """[global_batch, seq] token ids."""
    labels: Tensor | None = None
    """[global_batch, seq] un-shifted labels, -100 ignored; None: the input ids."""
    attention_mask: Tensor | None = None
    """[global_batch, seq] padding mask (1 = token, 0 = padding); None: no padding."""


@dataclass(frozen=True)
class RuntimeConfig:
    timeout_s: float = 300.0
    """Bound on any wait for another rank; past it the run fails with a message naming the rank."""
    seed: int = 0
    """Weights equal the same layers of a full model built with this seed (no checkpoint)."""
    checkpoint_dir: str | None = None
    """Local Hugging Face checkpoint (safetensors) to load this stage's weights from."""
    autocast_dtype: torch.dtype | None = None
    """None: compute in the plan's precision (autocast on CUDA and CPU for bf16 / fp16). Set,
    it must equal the plan's compute dtype; another is refused, naming both."""
    device: str | None = None
    """Default: cuda:LOCAL_RANK if CUDA is available, else cpu."""
    overlap_grad_sync: bool = True
    """All-reduce a stage's gradients among its replicas in buckets launched during the
    iteration's last backward, as their gradients become final (as DDP does), so that the
    transfer hides behind that backward. False: every bucket goes after the backward ends."""
    grad_bucket_bytes: int = GRAD_BUCKET_BYTES
    """Gradient bytes per all-reduce bucket (a bucket closes once it holds at least this many).
    The planner's cost model prices the default."""
    loss_scale_init: float | None = None
    """First loss scale of a plan with dynamic loss scaling (fp16); None: 2**16, as
    ``torch.amp.GradScaler``. Refused for a plan without loss scaling."""
    loss_scale_growth_interval: int | None = None
    """Clean steps in a row before the loss scale doubles; None: 2000, as GradScaler. Refused
    for a plan without loss scaling."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise RuntimeSetupError(f"RuntimeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if not self.grad_bucket_bytes > 0:
            raise RuntimeSetupError(f"RuntimeConfig.grad_bucket_bytes must be > 0, got "
                                    f"{self.grad_bucket_bytes}; the default is "
                                    f"{GRAD_BUCKET_BYTES} (25 MiB)")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise RuntimeSetupError(f"RuntimeConfig.autocast_dtype must be torch.bfloat16, "
                                    f"torch.float16 or None, got {self.autocast_dtype}")
        if self.loss_scale_init is not None and not self.loss_scale_init > 0:
            raise RuntimeSetupError(f"RuntimeConfig.loss_scale_init must be > 0, got "
                                    f"{self.loss_scale_init}; the default is 2**16")
        g = self.loss_scale_growth_interval
        if g is not None and not (isinstance(g, int) and g >= 1):
            raise RuntimeSetupError(f"RuntimeConfig.loss_scale_growth_interval must be an "
                                    f"integer >= 1, got {g!r}; the default is 2000")

    def loss_scaler(self, plan: Plan) -> DynamicLossScaler | None:
        """The loss scaler the plan's precision asks for (None: no loss scaling); loss-scale
        settings given for a plan that has none are refused."""
        given = [f"{n}={v}" for n, v in (("loss_scale_init", self.loss_scale_init),
                                         ("loss_scale_growth_interval",
                                          self.loss_scale_growth_interval)) if v is not None]
        if plan.loss_scaling is None:
            if given:
                raise RuntimeSetupError(f"RuntimeConfig.{given[0]} but the plan computes in "
                                        f"{plan.dtype} without loss scaling (only fp16 plans "
                                        "scale the loss); leave it unset")
            return None
        return DynamicLossScaler(
            DEFAULT_INIT_SCALE if self.loss_scale_init is None else self.loss_scale_init,
            DEFAULT_GROWTH_INTERVAL if self.loss_scale_growth_interval is None
            else self.loss_scale_growth_interval)


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss over the non-ignored tokens of the global batch (same on every rank)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when not clipped); inf or NaN on a step
    skipped for an overflow."""
    skipped: bool = False
    """The optimizer step was skipped on every rank: a gradient overflowed (loss scaling)."""
    loss_scale: float | None = None
    """The loss scale this step's backward ran with (None: no loss scaling)."""


@dataclass(frozen=True)
class Prediction:
    """What a forward-only pass over one global batch gives back."""

    loss: float
    """Mean loss over the non-ignored tokens of the global batch (same on every rank)."""
    logits: Tensor | None
    """[global_batch, seq, vocab] float32 logits on rank 0; None on every other rank."""


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int]:
    """Set up the default process group from the environment torchrun/accelerate set.

    Gloo on CPU, NCCL on CUDA. Returns (rank, world_size); a no-op if already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeSetupError(f"environment variable(s) {missing} are not set; start the "
                                "script with `torchrun` or `accelerate launch`, which set them")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def exit_distributed(code: int = 0) -> NoReturn:
    """End a process that used torch.distributed: destroy the process group, run the ``atexit``
    handlers, flush stdout and stderr, and exit with ``code`` without finalizing the interpreter.

    Why not a normal exit: a Gloo worker thread frees a finished collective (an all-reduce, the
    all-gather behind ``all_gather_object``) only a moment after the collective has returned to
    Python, and freeing its tensors' Python objects needs the GIL. On a loaded machine that
    moment can come after the main thread has begun finalizing the interpreter; CPython then
    ends the worker thread (``pthread_exit``) as it asks for the GIL, and that unwinding through
    the work's destructor, which must not throw, calls ``std::terminate``: "terminate called
    without an active exception", exit 134, after the program had printed its result (seen in
    a core dump: ``take_gil`` <- ``THPVariable_dealloc`` <- ``~AsyncAllgatherWork`` <-
    ``ProcessGroupGloo::runLoop`` while the main thread was in ``Py_FinalizeEx``). Neither
    ``destroy_process_group`` (Gloo's ``shutdown()`` leaves the worker threads running) nor any
    other call waits for those threads; a process that does not finalize cannot race them. The
    same holds for any daemon thread inside a C++ call at exit (a store call of the failure
    channel's watchdog, a runtime that was not shut down).
    """
    import atexit
    import sys

    if dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs before finalizing: loggers, writers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code)


@dataclass
class _MicroBatch:
    """State of one micro-batch on this rank between its forward and its backward."""

    recv: list[Transfer]
    inputs: Tensor | None = None
    output: Tensor | None = None
    grad_recv: list[Transfer] | None = None


class PipelineRuntime:
    """Executes the plan's schedule for this rank. See the module docstring."""

    def __init__(self, plan: Plan, model_config: PretrainedConfig,
                 config: RuntimeConfig = RuntimeConfig()) -> None:
        if not dist.is_initialized():
            raise RuntimeSetupError("torch.distributed is not initialised; call "
                                    "hapt_hf.pipeline.init_distributed() first")
        plan.validate(world_size=dist.get_world_size())
        mismatch = autocast_mismatch(plan.dtype, config.autocast_dtype)
        if mismatch:
            raise RuntimeSetupError(mismatch)
        self.plan = plan
        self.config = config
        self.loss_scaler: DynamicLossScaler | None = config.loss_scaler(plan)
        """The job's loss scale (fp16 plans); its state goes into checkpoints."""
        self.wire_dtype = torch_dtype(plan.dtype)
        """Activations and their gradients cross stage boundaries in the compute dtype."""
        self.rank = dist.get_rank()
        self.schedule = build_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                                       plan.warmups())
        self.work: RankWork = rank_work(plan, self.rank, self.schedule)
        self.stage_plan: StagePlan = self.work.stage
        self.device = torch.device(config.device or _default_device())
        self._all_ranks = tuple(range(plan.world_size))
        # The channel comes first: a rank that fails while building its stage (a damaged
        # checkpoint file, say) or dies in the first collectives is named by the others.
        self.channel = FailureChannel(f"rt{next(_runtime_ids)}", self.rank, config.timeout_s)
        try:
            self._set_up(model_config)
        except BaseException:
            self.channel.close()
            raise
        # who takes part in this rank's gradient all-reduces (its replicas, the tied group)
        self._grad_peers = tuple(sorted(set(self.stage_plan.ranks) | (
            set(self.work.tied_ranks) if self._tied_group is not None else set())))
        self.in_flight_limit = max_in_flight(self.work.actions)
        """Forwards the schedule lets this stage hold before their backward (its warm-up)."""
        self.max_live_activations = 0
        """Most micro-batches whose forward state this rank kept at once (measured)."""
        self._live = 0
        self._buckets: _GradBuckets | None = None

    def _set_up(self, model_config: PretrainedConfig) -> None:
        """Build this rank's stage (every rank refuses if one cannot) and the process groups."""
        from hapt_hf.pipeline.stage import build_stage
        s = self.stage_plan.index
        self.stage = self.channel.agree("the stage build", s, lambda: build_stage(
            model_config, self.stage_plan.layers, seed=self.config.seed,
            checkpoint_dir=self.config.checkpoint_dir, device=self.device,
            recompute=self.stage_plan.recompute, layer_unit=self.plan.layer_unit,
            attn_implementation=self.plan.attn_implementation))
        self.hidden_size = int(model_config.hidden_size)
        # what a stage's input and output are under autocast: the fp32 residual stream
        self._stream_dtype = next(self.stage.parameters()).dtype
        self._tied = list(self.stage.tied_parameters())
        with self.channel.collective("the process-group set-up", s, self._all_ranks):
            self._dp_group, self._tied_group = self._make_groups(model_config)

    @property
    def bucket_launch_s(self) -> list[float]:
        """When each gradient bucket of the last ``forward_backward`` went to the all-reduce,
        in seconds after the end of that iteration's last backward (negative: launched during
        it, i.e. overlapped), in launch order; [] for a stage without replicas."""
        return [] if self._buckets is None else self._buckets.launch_s()

    # -- setup -----------------------------------------------------------------------------
    def _make_groups(self, model_config: PretrainedConfig) -> tuple[Any, Any]:
        # new_group is collective over the default group: every rank creates every group, in
        # the same order, and keeps the ones it belongs to.
        mine = None
        for st in self.plan.stages:
            if st.dp > 1:
                g = dist.new_group(list(st.ranks))
                if self.rank in st.ranks:
                    mine = g
        tied = None
        if getattr(model_config, "tie_word_embeddings", False) and self.plan.num_stages > 1:
            g = dist.new_group(list(self.work.tied_ranks))
            if self.rank in self.work.tied_ranks:
                tied = g
        return mine, tied

    def _update_buckets(self) -> None:
        """Bucket the parameters that train now: adapters added or parameters frozen after the
        runtime was built (LoRA through the recipe) change them."""
        if self._dp_group is None:
            return
        # frozen parameters (e.g. a LoRA base) take no part; every replica freezes the same
        # ones. Tied ones are summed over the tied group, which holds the replicas too.
        tied = {id(p) for p in self._tied}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in tied]
        # the buckets hold these parameters, so an id here cannot belong to a new one
        if self._buckets is not None and self._buckets.ids == [id(p) for p in params]:
            return
        if self._buckets is not None:
            self._buckets.close()
        self._buckets = _GradBuckets(params, self._dp_group, self.config.grad_bucket_bytes,
                                     self.config.overlap_grad_sync)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.stage.parameters())

    # -- public steps ----------------------------------------------------------------------
    def forward_backward(self, batch: Batch) -> float:
        """One iteration's forwards and backwards; gradients added to ``.grad`` of every rank
        (unscaled under loss scaling; the overflow decision and the scale's update belong to
        :meth:`train_step`)."""
        ids, labels, mask = self._check_batch(batch)
        self._update_buckets()
        stash = self._stash_grads()
        tokens = max(1, int((labels[:, 1:] != -100).sum()))
        loss_sum, _ = self._run(self.work.actions, ids, labels, mask, tokens, backward=True)
        with self.channel.collective("the gradient all-reduce", self.stage_plan.index,
                                     self._grad_peers):
            self._sync_grads()
        self._unscale_grads()
        self._restore_grads(stash)
        return self._global_loss(loss_sum, tokens)

    def _unscale_grads(self) -> None:
        """Divide this iteration's gradients by the loss scale the last stage multiplied the
        loss by (a power of two: exact), so that ``.grad`` holds the true gradients; an
        overflow stays inf or NaN for the check that follows."""
        if self.loss_scaler is None:
            return
        inv = 1.0 / self.loss_scaler.scale
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(inv)

    def evaluate(self, batch: Batch) -> float:
        """Forward only, in eval mode (see :meth:`_inference`); the same loss definition as
        :meth:`forward_backward`."""
        ids, labels, mask = self._check_batch(batch)
        tokens = max(1, int((labels[:, 1:] != -100).sum()))
        with self._inference():
            loss_sum, _ = self._run(self._forward_actions(), ids, labels, mask, tokens,
                                    backward=False)
        return self._global_loss(loss_sum, tokens)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so that the global norm (each parameter once) is <= max_norm."""
        sq, _ = self._grad_stats(norm=True, check=False)
        norm = math.sqrt(sq)
        self._clip(norm, max_norm)
        return norm

    def _clip(self, norm: float, max_norm: float) -> None:
        coef = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    def _grad_stats(self, norm: bool, check: bool) -> tuple[float, bool]:
        """From ONE all-reduce over every rank: the squared global gradient norm, each
        parameter counted once (0 unless ``norm``), and whether any rank holds an inf or NaN
        gradient (False unless ``check``): the job's one overflow decision."""
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        grads = [p.grad.detach() for p in self.parameters() if p.grad is not None]
        if norm and self.work.replica == 0:  # replicas hold the same gradients after the sum
            tied = {id(p) for p in self._tied} if self.work.is_last else set()
            for p in self.parameters():
                if p.grad is not None and id(p) not in tied:
                    stats[0] += p.grad.detach().double().pow(2).sum()
        if check and grads:  # one device-side flag, no host sync per gradient
            stats[1] = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).double()
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
        """
        optimizer.zero_grad(set_to_none=True)
        scale = None if self.loss_scaler is None else self.loss_scaler.scale
        loss = self.forward_backward(batch)
        clip = max_grad_norm is not None
        if self.loss_scaler is None:
            return self._step(optimizer, lr_scheduler, StepResult(
                loss, self.clip_grad_norm_(max_grad_norm) if clip else None))
        sq, overflow = self._grad_stats(norm=clip, check=True)
        norm = math.sqrt(sq) if clip else None
        self.loss_scaler.update(overflow)
        if overflow:
            optimizer.zero_grad(set_to_none=True)
            return StepResult(loss, norm, skipped=True, loss_scale=scale)
        if clip:
            self._clip(norm, max_grad_norm)
        return self._step(optimizer, lr_scheduler, StepResult(loss, norm, loss_scale=scale))

    @staticmethod
    def _step(optimizer: torch.optim.Optimizer, lr_scheduler: Any, result: StepResult) -> StepResult:
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        return result

    def predict(self, batch: Batch) -> Prediction:
        """Loss and full logits of one global batch, forward only, in eval mode (see
        :meth:`_inference`); the loss as :meth:`evaluate` computes it."""
        ids, labels, mask = self._check_batch(batch)
        tokens = max(1, int((labels[:, 1:] != -100).sum()))
        with self._inference():
            loss_sum, outs = self._run(self._forward_actions(), ids, labels, mask, tokens,
                                       backward=False, keep_logits=True)
        loss = self._global_loss(loss_sum, tokens)
        with self.channel.collective("the logits gather", self.stage_plan.index,
                                     self._all_ranks):
            return Prediction(loss, self._gather_logits(outs, ids.shape))

    def predict_logits(self, batch: Batch) -> Tensor | None:
        """Full logits [G, s, V] on rank 0 (None elsewhere), forward only, in eval mode."""
        return self.predict(batch).logits

    def gather_state_dict(self, dst: int = 0) -> dict[str, Tensor] | None:
        """The full model's state dict (Hugging Face keys) on rank ``dst``, None elsewhere."""
        mine = ({k: v.detach().cpu() for k, v in self.stage.hf_state_dict().items()}
                if self.work.replica == 0 else None)
        parts: list[Any] | None = [None] * dist.get_world_size() if self.rank == dst else None
        with self.channel.collective("the state-dict gather", self.stage_plan.index,
                                     self._all_ranks):
            dist.gather_object(mine, parts, dst=dst)
        if parts is None:
            return None
        full: dict[str, Tensor] = {}
        for p in parts:
            full.update(p or {})
        return full

    def shutdown(self) -> None:
        """Stop the watchdog. The process groups stay: destroying a subgroup lets the next
        ``new_group`` over the same ranks reuse its name and meet stale store entries."""
        self.channel.close()
        self._dp_group = self._tied_group = None

    # -- the action loop -------------------------------------------------------------------
    def _forward_actions(self) -> tuple[Action, ...]:
        return tuple(a for a in self.work.actions
                     if a.kind in (ActionKind.F, ActionKind.RECV_F, ActionKind.SEND_F))

    @contextlib.contextmanager
    def _inference(self):
        """Run a forward-only pass as a single process's ``model.eval()`` under ``no_grad``
        would: dropout off, and the RNG streams training draws from (the CPU generator, and
        this rank's CUDA device) left as they were, so that evaluating between two steps
        changes nothing that follows. Every module gets its own mode back afterwards."""
        modes = [(m, m.training) for m in self.stage.modules()]
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                self.stage.eval()
                yield
        finally:
            for m, training in modes:
                m.training = training

    def _run(self, actions: tuple[Action, ...], ids: Tensor, labels: Tensor,
             mask: Tensor | None, tokens: int, *, backward: bool,
             keep_logits: bool = False) -> tuple[Tensor, dict[int, Tensor]]:
        """Execute ``actions``; (this rank's loss sum, zero off the last stage; the last
        stage's logits by micro-batch when ``keep_logits``, else {})."""
        mbs: dict[int, _MicroBatch] = {}
        sends: list[Transfer] = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        logits: dict[int, Tensor] = {}
        seq = ids.shape[1]
        s = self.stage_plan.index
        # the iteration's last backward makes every gradient final: the bucket hooks fire in it
        last_b = max((i for i, a in enumerate(actions) if a.kind is ActionKind.B), default=-1)
        for i, a in enumerate(actions):
            k = a.microbatch
            try:
                if a.kind is ActionKind.RECV_F:
                    mbs[k] = _MicroBatch(self._post_recv(self.work.upstream, k, seq, "RECV_F"))
                elif a.kind is ActionKind.F:
                    m = mbs.setdefault(k, _MicroBatch([]))
                    # keeping logits: the stage returns them, and the loss is taken from them
                    out = self._forward(m, k, ids, None if keep_logits else labels, mask,
                                        tokens, backward)
                    if self.work.is_last and keep_logits:
                        logits[k] = out
                        out = self.stage.loss_sum(out, labels[self._rows(k)].to(self.device))
                    if self.work.is_last:
                        loss_sum += out.detach().double().cpu()
                elif a.kind is ActionKind.SEND_F:
                    sends += self._post_send(self.work.downstream, k, mbs[k].output, "SEND_F")
                    if not backward:
                        mbs[k].output = None
                elif a.kind is ActionKind.RECV_B:
                    mbs[k].grad_recv = self._post_recv(self.work.downstream, k, seq, "RECV_B")
                elif a.kind is ActionKind.B and i == last_b and self._buckets is not None:
                    self._buckets.arm()
                    self._backward(mbs[k])
                    self._buckets.backward_done()
                elif a.kind is ActionKind.B:
                    self._backward(mbs[k])
                elif a.kind is ActionKind.SEND_B:
                    m = mbs.pop(k)
                    sends += self._post_send(self.work.upstream, k, m.inputs.grad, "SEND_B")
            except PipelineFailure:
                raise
            except Exception as e:  # noqa: BLE001 - recorded for every rank, then re-raised
                msg = failed_during(self.rank, f"{a.kind.value} (stage {s}, micro-batch {k})", e)
                raise PipelineFailure(self.channel.record(msg)) from e
            if a.kind is ActionKind.B and self.work.is_first:
                mbs.pop(k, None)
        self.channel.wait(sends, s)
        return loss_sum, logits

    def _forward(self, m: _MicroBatch, k: int, ids: Tensor, labels: Tensor | None,
                 mask: Tensor | None, tokens: int, backward: bool) -> Tensor:
        rows = self._rows(k)
        if self.work.is_first:
            x = ids[rows].to(self.device)
        else:
            self.channel.wait(m.recv, self.stage_plan.index)
            x = torch.cat([t.buffer for t in m.recv]) if len(m.recv) > 1 else m.recv[0].buffer
            x = x.to(self._stream_dtype)  # from the wire's compute dtype
            x.requires_grad_(backward)
        m.recv = []
        kwargs: dict[str, Any] = {}
        if mask is not None:
            kwargs["attention_mask"] = mask[rows].to(self.device)
        if self.work.is_last and labels is not None:
            kwargs["labels"] = labels[rows].to(self.device)
        with self._autocast():
            out = self.stage(x, **kwargs)
        kept = out
        if self.work.is_last and labels is not None:
            kept = out / tokens  # the global mean: micro-batch and replica gradients just add
        if backward:
            m.inputs, m.output = (None if self.work.is_first else x), kept
            self._live += 1
            self.max_live_activations = max(self.max_live_activations, self._live)
        else:
            m.output = kept
        return out

    def _backward(self, m: _MicroBatch) -> None:
        if self.work.is_last:
            scaler = self.loss_scaler
            (m.output if scaler is None else m.output * scaler.scale).backward()
        else:
            self.channel.wait(m.grad_recv, self.stage_plan.index)
            bufs = [t.buffer for t in m.grad_recv]
            grad = torch.cat(bufs) if len(bufs) > 1 else bufs[0]
            torch.autograd.backward(m.output, grad.to(m.output.dtype))
        m.output, m.grad_recv = None, None
        self._live -= 1

    def _post_recv(self, pieces: tuple[Piece, ...], k: int, seq: int, kind: str) -> list[Transfer]:
        out = []
        for p in pieces:
            buf = torch.empty((p.size, seq, self.hidden_size), dtype=self.wire_dtype,
                              device=self.device)
            what = (f"{kind} of micro-batch {k} from rank {p.peer} "
                    f"(stage {self.plan.stage_of_rank(p.peer).index})")
            out.append(self.channel.start(lambda b=buf, q=p.peer: dist.irecv(b, q, tag=k), p.peer, what,
                                          buf, self.stage_plan.index))
        return out

    def _post_send(self, pieces: tuple[Piece, ...], k: int, t: Tensor, kind: str) -> list[Transfer]:
        t = t.detach().to(self.wire_dtype)
        out = []
        for p in pieces:
            buf = t[p.start:p.stop].contiguous()
            what = f"{kind} of micro-batch {k} to rank {p.peer}"
            out.append(self.channel.start(lambda b=buf, q=p.peer: dist.isend(b, q, tag=k), p.peer, what,
                                          buf, self.stage_plan.index))
        return out

    # -- internals -------------------------------------------------------------------------
    def _rows(self, k: int) -> slice:
        base = k * self.plan.micro_batch_size
        lo, hi = self.work.samples
        return slice(base + lo, base + hi)

    def _autocast(self):
        return compute_context(self.plan.dtype, self.device)

    def _check_batch(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor | None]:
        ids = batch.input_ids
        g = self.plan.global_batch_size
        if ids.ndim != 2 or ids.shape[0] != g or ids.is_floating_point():
            raise BatchError(f"Batch.input_ids must be integer token ids of shape "
                             f"[global_batch_size={g}, seq], got {ids.dtype} "
                             f"{tuple(ids.shape)}; pass the whole global batch on every rank")
        for name in ("labels", "attention_mask"):
            t = getattr(batch, name)
            if t is not None and tuple(t.shape) != tuple(ids.shape):
                raise BatchError(f"Batch.{name} has shape {tuple(t.shape)} but input_ids has "
                                 f"{tuple(ids.shape)}; give them the same shape")
        labels = batch.labels if batch.labels is not None else ids
        return ids, labels, batch.attention_mask

    def _stash_grads(self) -> list[Tensor | None]:
        # grads already there (accumulation) must not be all-reduced a second time
        stash = [p.grad for p in self.parameters()]
        for p in self.parameters():
            p.grad = None
        return stash

    def _restore_grads(self, stash: list[Tensor | None]) -> None:
        for p, old in zip(self.parameters(), stash):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)

    def _sync_grads(self) -> None:
        """Finish the gradient all-reduce: launch the buckets the last backward did not (all of
        them without overlap), sum the tied embedding, wait for every bucket."""
        # frozen parameters (e.g. a LoRA base) take no part; every replica freezes the same ones
        trainable = [p for p in self.parameters() if p.requires_grad]
        for p in trainable:
            if p.grad is None:  # unused in this iteration: still part of the all-reduce
                p.grad = torch.zeros_like(p)
        if self._buckets is not None:
            self._buckets.launch_rest()
        tied = [p.grad for p in self._tied if p.requires_grad]
        if self._tied_group is not None and tied:
            _all_reduce_flat(tied, self._tied_group)
        if self._buckets is not None:
            self._buckets.wait()

    def _global_loss(self, loss_sum: Tensor, tokens: int) -> float:
        t = loss_sum.to(self.device)  # zero except on the last stage's replicas
        with self.channel.collective("the loss all-reduce", self.stage_plan.index,
                                     self._all_ranks):
            dist.all_reduce(t)
        return float(t.item() / tokens)

    def _gather_logits(self, outs: dict[int, Tensor], shape: torch.Size) -> Tensor | None:
        mbs = self.plan.micro_batch_size
        full = None
        last = self.plan.stages[-1]
        if self.rank == 0:
            vocab = self.stage.config.vocab_size
            full = torch.empty((shape[0], shape[1], vocab), dtype=torch.float32)
        for k in range(self.plan.num_microbatches):
            for r, peer in enumerate(last.ranks):
                lo, hi = (k * mbs + x for x in replica_slice(mbs, last.dp, r))
                if peer == self.rank == 0:
                    full[lo:hi] = outs[k].float().cpu()
                elif peer == self.rank:
                    dist.send(outs[k].float().contiguous(), 0, tag=k)
                elif self.rank == 0:
                    buf = torch.empty_like(full[lo:hi], device=self.device)
                    dist.recv(buf, peer, tag=k)
                    full[lo:hi] = buf.cpu()
        return full


class _GradBuckets:
    """One stage's replica all-reduce in buckets, launched in bucket order as the iteration's
    last backward makes their gradients final (DDP's reducer, without its gradient views)."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, bucket_bytes: int,
                 overlap: bool) -> None:
        self.ids = [id(p) for p in params]
        # reverse parameter order is roughly the order the backward finishes them
        self.buckets: list[list[torch.nn.Parameter]] = []
        cur, size = [], 0
        for p in reversed(params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.group = group
        self.armed = False
        self._reset()
        self._times: tuple[list[float], float] = ([], 0.0)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in params] if overlap else []

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._seen: set[int] = set()
        self._next = 0
        self._works: list[tuple[int, Tensor, Any]] = []
        self._launched: list[float] = []
        self._backward_end = None

    def arm(self) -> None:
        """Count the gradients of the backward that starts now (the iteration's last)."""
        self._reset()
        self.armed = True

    def backward_done(self) -> None:
        self.armed = False
        self._backward_end = time.perf_counter()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        # fires once per backward for each parameter whose gradient it accumulated
        if not self.armed:
            return
        i = self._bucket_of[id(p)]
        if id(p) in self._seen:
            if i < self._next:  # its bucket is already on the wire without this gradient
                raise RuntimeError("a parameter received a second gradient in one backward "
                                   "after its bucket was all-reduced; set "
                                   "RuntimeConfig(overlap_grad_sync=False)")
            return
        self._seen.add(id(p))
        self._missing[i] -= 1
        # buckets go in order on every replica: collectives must match across the group
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, i: int) -> None:
        grads = [p.grad for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._works.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._launched.append(time.perf_counter())
        self._next = i + 1

    def launch_rest(self) -> None:
        """Launch what the backward left (every bucket when nothing was armed); every
        gradient must exist by now."""
        self.armed = False
        if self._backward_end is None:  # no armed backward ran: nothing was launched yet
            self._reset()
            self._backward_end = time.perf_counter()
        while self._next < len(self.buckets):
            self._launch(self._next)

    def wait(self) -> None:
        """Wait for every bucket and write the sums back into the gradients."""
        works, self._works = self._works, []
        for i, flat, work in works:
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._times = (self._launched, self._backward_end or 0.0)
        self._reset()

    def launch_s(self) -> list[float]:
        launched, end = self._times
        return [t - end for t in launched]


def _all_reduce_flat(grads: list[Tensor], group) -> None:
    """One all-reduce (SUM) over the concatenation of ``grads`` instead of one per tensor."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"
