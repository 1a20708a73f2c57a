"""``HaptAccelerator``: a user's own Accelerate loop on a hapt plan, two lines changed.

```python
accelerator = HaptAccelerator(gradient_accumulation_steps=4)  # was: Accelerator(...)
model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
    model, optimizer, train_dl, eval_dl, scheduler)
for batch in train_dl:                       # this process's batches, Accelerate's count
    with accelerator.accumulate(model):
        loss = model(**batch).loss           # first micro-step of a window: the pipeline's step
        accelerator.backward(loss)           # checks it is that loss
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the global norm
        optimizer.step(); scheduler.step(); optimizer.zero_grad()  # act on sync steps only
```

The loop means what it means under Accelerate on ``num_processes`` processes: the same batches
per process and count, sync points, scheduler steps (Accelerate's own ``AcceleratedScheduler``:
``num_processes`` steps per optimizer step unless ``split_batches``), ``gather_for_metrics``,
``save_state``/``load_state``, ``skip_first_batches``. One optimizer step consumes
``batch_size x num_processes x gradient_accumulation_steps`` rows (``split_batches``: ``batch_size
x gradient_accumulation_steps``), the global batch the plan is made for; the pipeline runs them
at the first micro-step of each window. ``prepare`` plans (rank 0 plans or loads the plan and
broadcasts it, as the recipes do), builds only this rank's stage and copies its tensors from
the model the loop built (or, for a model built on the meta device, reads only them from its
checkpoint directory) and points the optimizer at the stage's parameters. Every Accelerator
argument is either honoured or refused by name (:data:`HONOURED_ACCELERATOR_ARGS`).

The class holds what stands in for ``Accelerator``'s methods: prepare, the step calls, the model
out, and ``save_state`` / ``load_state``, which choose the directory and the state to keep
(the state directory itself, written and read, is ``accelerate_checkpoint``'s).
"""
from __future__ import annotations

import os
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch import nn

from hapt_hf.errors import CheckpointError, DataError
from hapt_hf.integration import elastic
from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.accelerate_checkpoint import (RunShape, SavedState, check_state_dir,
                                                       latest_numbered_dir, next_numbered_dir,
                                                       read_portable, read_rank_state,
                                                       write_portable, write_rank_state,
                                                       writing_state)
from hapt_hf.integration.accelerate_data import AccelerateSettingError, PipelineDataLoader
from hapt_hf.integration.accelerate_objects import (PipelineEngine, PipelineModelView,
                                                    PipelineOptimizer, WindowStart)
from hapt_hf.integration.accelerate_settings import (HONOURED_ACCELERATOR_ARGS,
                                                     MIXED_PRECISION_TO_PLAN,
                                                     check_accelerator_arguments)
from hapt_hf.integration.config import HaptConfig, HaptConfigError
from hapt_hf.integration.launch import init_process_group, read_launch_env
from hapt_hf.integration.plan_resolution import format_plan, resolve_plan
from hapt_hf.integration.trainer_setup import stage_runtime
from hapt_hf.planner.plan import Plan

__all__ = ["HaptAccelerator", "AccelerateSettingError", "HONOURED_ACCELERATOR_ARGS",
           "MIXED_PRECISION_TO_PLAN"]


class HaptAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` puts the model on a hapt plan.

    Args:
        hapt_plugin: The hapt config: a :class:`HaptConfig`, a path to ``hapt.yaml``, or None
            to read the ``HAPT_CONFIG`` variable (``HAPT_CONFIG=hapt.yaml accelerate launch``).
            Its ``global_batch_size`` may be left out: the training DataLoader defines it.
        *args, **kwargs: ``Accelerator``'s own; those a pipeline cannot honour are refused.
    """

    def __init__(self, *args: Any, hapt_plugin: HaptConfig | str | Path | None = None,
                 **kwargs: Any) -> None:
        check_accelerator_arguments(args, kwargs)
        self.hapt_config = hapt_plugin if isinstance(hapt_plugin, HaptConfig) \
            else HaptConfig.from_args_or_env(None if hapt_plugin is None else str(hapt_plugin))
        for key in ("checkpoint_local_dir", "checkpoint_retries"):
            if getattr(self.hapt_config, key) is not None:
                raise HaptConfigError(f"{self.hapt_config.source}: '{key}' is kept by "
                                      "HaptTrainer's checkpoints only; HaptAccelerator's "
                                      "save_state writes into its output directory: leave the "
                                      "key out")
        self.launch = read_launch_env()  # refuses accelerate's one-process MULTI_CPU start
        init_process_group(self.launch, self.hapt_config.timeout_s)
        if "cpu" not in kwargs:  # accelerate launch's use_cpu, or a machine without CUDA
            kwargs["cpu"] = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") \
                or not torch.cuda.is_available()
        super().__init__(**kwargs)
        self._check_state()
        self.engine: PipelineEngine | None = None
        self.plan: Plan | None = None
        self.hapt_optimizers: list[PipelineOptimizer] = []
        self.hapt_schedulers: list[AcceleratedScheduler] = []
        self.hapt_loaders: list[PipelineDataLoader] = []
        self._views: weakref.WeakSet[PipelineDataLoader] = weakref.WeakSet()

    def _check_state(self) -> None:
        if self.num_processes != self.launch.world_size:
            raise AccelerateSettingError(
                f"Accelerate sees {self.num_processes} process(es) but {self.launch.world_size} "
                "were started (no GPU and cpu not set?); pass cpu=True or launch with "
                "recipes/configs/accelerate_cpu.yaml (use_cpu: true)")
        other = {DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM}
        if self.distributed_type in other:
            raise AccelerateSettingError(f"distributed_type {self.distributed_type} (from the "
                                         "accelerate config) cannot run with a hapt plan; use "
                                         "MULTI_GPU (use_cpu: true on CPUs)")
        dynamo = getattr(self.state, "dynamo_plugin", None)
        if dynamo is not None and str(dynamo.backend).split(".")[-1] not in ("NO", "no"):
            raise AccelerateSettingError(f"dynamo_backend {dynamo.backend} cannot be honoured: "
                                         "pipeline stages are not compiled; set it to 'no'")
        if self.mixed_precision not in MIXED_PRECISION_TO_PLAN:
            raise AccelerateSettingError(f"mixed_precision={self.mixed_precision!r} cannot be "
                                         f"honoured; use one of {sorted(MIXED_PRECISION_TO_PLAN)}")

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        if device_placement is not None:
            raise AccelerateSettingError("prepare(device_placement=...) cannot be honoured: the "
                                         "runtime places each stage's inputs; leave it out")
        models = [a for a in args if isinstance(a, nn.Module)]
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        if len(models) > 1:
            raise AccelerateSettingError("prepare got several models; a hapt plan runs one")
        if models and self.engine is not None:
            raise AccelerateSettingError("prepare got a model a second time; prepare it once")
        if models:
            self._build(models[0], loaders)
        if self.engine is None:
            raise AccelerateSettingError("prepare the model first, together with the training "
                                         "DataLoader (its batches set the global batch)")
        out = [self._prepare_one(a, models[0] if models else None) for a in args]
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, model: nn.Module | None) -> Any:
        if isinstance(obj, nn.Module):
            return self.engine
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizer(obj, model)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            # Accelerate's own wrapper: num_processes steps per optimizer step unless
            # split_batches, none on a non-sync micro-step or a skipped step
            mine = [o for o in self.hapt_optimizers if o.source is getattr(obj, "optimizer", None)]
            sched = AcceleratedScheduler(obj, mine[:1] or self.hapt_optimizers,
                                         step_with_optimizer=self.step_scheduler_with_optimizer,
                                         split_batches=self.split_batches)
            self.hapt_schedulers.append(sched)
            return sched
        if isinstance(obj, torch.utils.data.DataLoader):
            loader = self._loader(obj)
            self.hapt_loaders.append(loader)
            return loader
        if isinstance(obj, PipelineDataLoader):
            return obj
        raise AccelerateSettingError(f"prepare got a {type(obj).__name__}; with a hapt plan it "
                                     "takes the model, optimizers, LR schedulers and DataLoaders")

    def _loader(self, loader: torch.utils.data.DataLoader) -> PipelineDataLoader:
        return PipelineDataLoader(loader, self.num_processes, self.process_index,
                                  self.split_batches, self.device)

    def _build(self, model: nn.Module, loaders: list) -> None:
        if not loaders:
            raise AccelerateSettingError("prepare the model together with the training "
                                         "DataLoader: the rows of its accumulation window are "
                                         "the global batch the plan is made for")
        train = self._loader(loaders[0])
        steps = self.gradient_accumulation_steps
        rows = train.total_batch_size * steps
        how = (f"the training DataLoader's batch_size={loaders[0].batch_size} "
               + ("(split_batches) " if self.split_batches else
                  f"x num_processes={self.num_processes} ")
               + f"x gradient_accumulation_steps={steps}")
        cfg = self.hapt_config.with_global_batch(rows, how)
        seq_len = cfg.seq_len or _row_length(train.dataset)
        precision = MIXED_PRECISION_TO_PLAN[self.mixed_precision]
        asked = cfg.requested_precision
        if asked not in (None, "auto", precision):
            raise AccelerateSettingError(
                f"Accelerator mixed_precision={self.mixed_precision!r} (= {precision}) but the "
                f"hapt config ({cfg.source}) says precision: {asked}; make the two agree")
        planned = replace(cfg, precision=precision, dtype=None) if cfg.plan is None else cfg
        self.plan = resolve_plan(planned, model.config, seq_len, self.launch)
        if self.plan.global_batch_size != rows:
            raise AccelerateSettingError(
                f"the plan {cfg.plan} runs global batches of {self.plan.global_batch_size} but "
                f"{how} = {rows} rows per optimizer step; make the two agree or re-plan")
        if self.plan.dtype != precision:
            raise AccelerateSettingError(
                f"Accelerator mixed_precision={self.mixed_precision!r} but the plan "
                f"{cfg.plan} computes in {self.plan.dtype}; set mixed_precision to match or "
                "re-plan")
        self.print(format_plan(self.plan))
        self.engine = PipelineEngine(stage_runtime(model, self.plan, cfg.timeout_s,
                                                   error=AccelerateSettingError), self)
        self.engine.train(model.training)

    def _optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None
                   ) -> PipelineOptimizer:
        if model is None:
            raise AccelerateSettingError("prepare the optimizer together with its model")
        wrapped = PipelineOptimizer.over_stage(optimizer, model, self.engine.runtime)
        self.hapt_optimizers.append(wrapped)
        return wrapped

    # -- what the engine reads ----------------------------------------------------------------
    def batch_sources(self) -> list[PipelineDataLoader]:
        """Every prepared loader and ``skip_first_batches`` view still in use."""
        return [*self.hapt_loaders, *self._views]

    def window_start(self) -> WindowStart:
        """The loop's state before the accumulation window whose first micro-step runs now
        (``accumulate`` has counted it already)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return WindowStart(self.step - 1, (torch.get_rng_state(), cuda),
                           [s.scheduler.state_dict() for s in self.hapt_schedulers])

    # -- the step -----------------------------------------------------------------------------
    def backward(self, loss: Any, **kwargs: Any) -> None:
        if kwargs:
            raise AccelerateSettingError(f"accelerator.backward({sorted(kwargs)[0]}=...) cannot "
                                         "be honoured: the pipeline ran the backward in model()")
        self._engine().check_backward(loss)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if norm_type != 2:
            raise AccelerateSettingError(f"clip_grad_norm_(norm_type={norm_type}) cannot be "
                                         "honoured: the pipeline clips by the 2-norm")
        self._check_all_parameters(parameters, "clip_grad_norm_")
        norm = self._engine().runtime.clip_grad_norm_(float(max_norm))
        for opt in self.hapt_optimizers:
            opt.grad_norm = norm
        return torch.tensor(norm)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self._check_all_parameters(parameters, "clip_grad_value_")
        torch.nn.utils.clip_grad_value_(list(self._engine().stage.parameters()), clip_value)

    def _check_all_parameters(self, parameters: Any, what: str) -> None:
        given = {id(p) for p in ([parameters] if isinstance(parameters, torch.Tensor)
                                 else parameters)}
        if given != self._engine().parameters_ids():
            raise AccelerateSettingError(f"{what} got a subset of the parameters; with a hapt "
                                         "plan it clips model.parameters() as a whole")

    def autocast(self, autocast_handler: Any = None):
        """Accelerate's own: the plan's forward already runs under autocast to its precision,
        so the region computes as it would anyway; another handler cannot be honoured."""
        if autocast_handler is not None:
            raise AccelerateSettingError("accelerator.autocast(autocast_handler=...) cannot be "
                                         "honoured: the plan computes every forward in its own "
                                         "precision (mixed_precision); leave the handler out")
        return super().autocast()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self.hapt_optimizers)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> PipelineDataLoader:
        """As Accelerate's: the loader's epoch from this process's batch ``num_batches`` on."""
        if not isinstance(dataloader, PipelineDataLoader):
            raise AccelerateSettingError("skip_first_batches takes a DataLoader returned by "
                                         "prepare")
        view = dataloader.skipping(num_batches)
        self._views.add(view)
        return view

    # -- the model out ------------------------------------------------------------------------
    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, PipelineEngine):
            return PipelineModelView(model, self.save)
        return model

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict:
        """The full model's state dict on the main process, {} on the others (collective)."""
        return self._engine().runtime.gather_state_dict(dst=0) or {}

    def save_model(self, model: Any, save_directory: str, max_shard_size: Any = "10GB",
                   safe_serialization: bool = True) -> None:
        """Each stage writes its own weights file (``model-0000k-of-0000n.safetensors``), the
        main process the index and config (collective); no rank gathers the model."""
        if max_shard_size != "10GB":
            raise AccelerateSettingError(f"save_model(max_shard_size={max_shard_size!r}) cannot "
                                         "be honoured with a hapt plan: each pipeline stage "
                                         "writes its weights as one file; leave it out")
        PipelineModelView(self._engine()).save_pretrained(
            save_directory, safe_serialization=safe_serialization)

    # -- checkpoints --------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """Commit the state directory atomically (collective): the model (each stage's
        weights written by that stage), each rank's optimizer, scheduler, RNG and loss-scaler
        state, the loaders' positions, the registered objects, ``accelerator.step`` and the
        plan, and the same state in the portable form any plan loads (tensors by parameter
        name, see ``accelerate_checkpoint``). With automatic checkpoint naming, as
        Accelerate: ``project_dir/checkpoints/checkpoint_<iteration>``, the oldest removed past
        ``total_limit``. Inside an accumulation window (the pipeline has run it, its optimizer
        step is still to come) the state saved is the one before the window: resuming runs the
        whole window again."""
        if kwargs or not safe_serialization:
            raise AccelerateSettingError("save_state's save_model_func kwargs and "
                                         "safe_serialization=False cannot be honoured with a "
                                         "hapt plan: the model is written as safetensors")
        runtime, out = self._engine().runtime, self._state_dir(output_dir)
        with writing_state(out, runtime, self.plan) as tmp:
            opt, sched = self._single_optimizer()
            window = self._engine().open_window()
            loaders = [d.state_dict() for d in self.hapt_loaders]
            step, rng = self.step, None
            if window is not None:
                start = window.start
                step, rng = start.step, start.rng
                sched = SavedState(start.schedulers[0]) if sched is not None else None
                for d, state in zip(self.hapt_loaders, loaders):
                    if d.cursor is window.cursor:
                        state["position"] = window.first
            loop = {"loaders": loaders, "custom": [o.state_dict() for o in self._custom_objects],
                    "step": step}
            write_rank_state(tmp, runtime, opt, sched, rng, loop)
            write_portable(tmp, runtime, opt, sched, rng, loop, self._run_shape())
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration += 1
        return str(out)

    def _state_dir(self, output_dir: str | None) -> Path:
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise AccelerateSettingError("save_state needs an output_dir (or "
                                             "ProjectConfiguration(automatic_checkpoint_naming="
                                             "True))")
            return Path(output_dir)
        out = next_numbered_dir(Path(self.project_dir) / "checkpoints", self.save_iteration,
                                config.total_limit, self.is_main_process)
        self.wait_for_everyone()
        return out

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Under the plan that saved it, every rank reads its own files (bit for bit); under
        another plan (other processes, cluster file, stages, replicas or optimizer sharding, the
        same global batch and model), every rank reads its stage's tensors and optimizer state
        by parameter name from the portable form and the loop's counters are moved into this
        run's units. The ranks agree on the outcome before going on. With automatic
        checkpoint naming and no ``input_dir``: the latest ``checkpoint_<n>``."""
        if kwargs:
            raise AccelerateSettingError(f"load_state({sorted(kwargs)[0]}=...) cannot be "
                                         "honoured with a hapt plan; give the directory only")
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise AccelerateSettingError("load_state needs an input_dir written by "
                                             "save_state (or automatic checkpoint naming)")
            input_dir = str(latest_numbered_dir(Path(self.project_dir) / "checkpoints"))
        runtime, ckpt = self._engine().runtime, Path(input_dir)
        opt, sched = self._single_optimizer()
        if ckpt.is_dir() and not ckpt_io.same_placement(ckpt, self.plan):
            self._apply_loop(read_portable(ckpt, runtime, opt, sched, self._run_shape()))
            return

        def load() -> None:
            check_state_dir(ckpt, self.plan)
            ckpt_io.load_stage_weights(runtime.stage, ckpt)
            self._apply_loop(read_rank_state(ckpt, runtime, opt, sched))
        runtime.channel.agree("loading the state", runtime.stage_plan.index, load,
                              refusals=(CheckpointError, ckpt_io.CheckpointError))

    def resume_if_restarted(self, checkpoints_dir: str | os.PathLike | None = None) -> str | None:
        """Resume an elastic run where torchrun's agent restarted the workers (collective; call
        it after ``prepare``, before the loop): on a restart, load the newest complete
        ``checkpoint_<n>`` state this run saved under ``checkpoints_dir`` (default, with
        automatic checkpoint naming: ``project_dir/checkpoints``, where ``save_state()`` puts
        them), on the plan made for the GPUs present, as ``load_state`` does, and return its
        directory; the next ``save_state()`` then writes ``checkpoint_<n+1>``. On a first start,
        or outside an elastic agent that may restart, nothing is loaded and it returns None.
        A restart is told as for HaptTrainer (``hapt_hf.integration.elastic``): a failure
        counted by any node's agent, or ``hapt_elastic.json`` in ``checkpoints_dir`` naming this
        run's ``--rdzv-id`` (a node joined); states an earlier run left there are not resumed."""
        if checkpoints_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise AccelerateSettingError(
                    "resume_if_restarted needs the directory the loop saves its checkpoint_<n> "
                    "states in, or ProjectConfiguration(automatic_checkpoint_naming=True) and "
                    "save_state() with no directory")
            checkpoints_dir = Path(self.project_dir) / "checkpoints"
        engine = self._engine()
        chosen = elastic.resume_point(engine.runtime.rank, self.num_processes, None,
                                      checkpoints_dir, elastic.plan_groups(self.plan),
                                      naming=elastic.ACCELERATE_NAMING)
        if chosen is None:
            return None
        self.load_state(str(chosen))
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = int(chosen.name.rsplit("_", 1)[1]) + 1
        return str(chosen)

    def _apply_loop(self, loop: dict[str, Any]) -> None:
        for loader, state in zip(self.hapt_loaders, loop["loaders"]):
            loader.load_state_dict(state)
        for obj, state in zip(self._custom_objects, loop["custom"]):
            obj.load_state_dict(state)
        self.step = loop["step"]

    def _run_shape(self) -> RunShape:
        return RunShape(self.num_processes,
                        bool(self.step_scheduler_with_optimizer and not self.split_batches),
                        self.gradient_accumulation_steps,
                        tuple(d.total_batch_size for d in self.hapt_loaders))

    def _single_optimizer(self) -> tuple[Any, Any]:
        if len(self.hapt_optimizers) > 1 or len(self.hapt_schedulers) > 1:
            raise AccelerateSettingError("save_state / load_state with a hapt plan keep one "
                                         "optimizer and one LR scheduler; prepare one of each")
        opt = self.hapt_optimizers[0].optimizer if self.hapt_optimizers else None
        sched = self.hapt_schedulers[0].scheduler if self.hapt_schedulers else None
        if opt is None:
            raise AccelerateSettingError("save_state / load_state need a prepared optimizer")
        return opt, sched

    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            raise AccelerateSettingError("call accelerator.prepare(model, ...) first")
        return self.engine


def _row_length(dataset: Any) -> int:
    """The sequence length of the data, read from its first row (no RNG drawn)."""
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError):
        raise DataError("cannot read the sequence length from the dataset's first row; set "
                        "seq_len in the hapt config") from None
