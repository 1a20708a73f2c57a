"""``transformers.Trainer`` internals HaptTrainer uses (tested on transformers 5.23 and 5.24).

HaptTrainer replaces Trainer's inner loop (:mod:`hapt_hf.integration.trainer` says why) and
keeps the rest: the state, callbacks, logging, best-model bookkeeping. The loop it replaces
set some of that up through Trainer's private methods; they are reached here, one function
each. :class:`TrainerHooks` routes Trainer's private checkpoint hooks to HaptTrainer's public
methods, should any of Trainer's own code call them.
"""
from __future__ import annotations

from typing import Any

from transformers import Trainer

__all__ = ["TrainerHooks", "set_train_batch_size", "prepare_state", "learning_rate",
           "determine_best_metric", "run_output_dir", "load_callback_state",
           "see_launched_world", "remove_unused_columns", "collator_with_removed_columns",
           "loss_count_rule", "train_sampler"]


class TrainerHooks:
    """Mixin put before ``Trainer``: its private checkpoint hooks call the subclass's
    ``save_checkpoint(trial)`` and ``load_best_model()``.

    Tested on transformers 5.23 and 5.24 (``Trainer._save_checkpoint(model, trial)``,
    ``Trainer._load_best_model()``).
    """

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        del model  # the subclass saves every stage of the pipeline
        self.save_checkpoint(trial)

    def _load_best_model(self) -> None:
        self.load_best_model()


def set_train_batch_size(trainer: Trainer, size: int) -> None:
    """The batch size Trainer records for a step (``_train_batch_size``, saved with the state).

    Tested on transformers 5.23 and 5.24.
    """
    trainer._train_batch_size = size


def prepare_state(trainer: Trainer, max_steps: int, num_epochs: int, trial: Any) -> None:
    """What Trainer's loop records in ``state`` before the first step (steps, epochs, trial).

    Tested on transformers 5.23 and 5.24 (``TrainerState.init_training_references``).
    """
    trainer.state.init_training_references(trainer, max_steps, num_epochs, trial)


def learning_rate(trainer: Trainer) -> float:
    """The scheduler's current learning rate, as Trainer logs it.

    Tested on transformers 5.23 and 5.24 (``Trainer._get_learning_rate``).
    """
    return trainer._get_learning_rate()


def determine_best_metric(trainer: Trainer, metrics: dict[str, float], trial: Any) -> bool:
    """Trainer's best-metric bookkeeping (``state.best_metric``, ``best_global_step``);
    True when ``metrics`` is a new best.

    Tested on transformers 5.23 and 5.24 (``Trainer._determine_best_metric``).
    """
    return trainer._determine_best_metric(metrics=metrics, trial=trial)


def run_output_dir(trainer: Trainer, trial: Any) -> str:
    """The directory this run's ``checkpoint-N`` folders go in (per trial in a search).

    Tested on transformers 5.23 and 5.24 (``Trainer._get_output_dir``).
    """
    return trainer._get_output_dir(trial=trial)


def load_callback_state(trainer: Trainer) -> None:
    """Restore the stateful callbacks (early stopping...) from the loaded ``state``.

    Tested on transformers 5.23 and 5.24 (``Trainer._load_callback_state``).
    """
    trainer._load_callback_state()


def see_launched_world(args: Any) -> None:
    """Make ``args`` see every launched process on a machine without CUDA.

    ``TrainingArguments`` sets up its devices once, lazily: with ``use_cpu`` False on a machine
    without CUDA it takes a torchrun launch for ONE process (``NOT_PARALLEL``), so every rank
    would log, save and write its results as the main process. Where the process group holds
    more processes than ``args`` sees and there is no CUDA, ``use_cpu`` is set (what such a
    launch means) and the cached device set-up dropped, so it runs again on the launched world.

    Tested on transformers 5.23 and 5.24 (the cached property ``_setup_devices``).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or args.world_size == dist.get_world_size() \
            or torch.cuda.is_available():
        return
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)
    args.__dict__.pop("distributed_state", None)
    _ = args.device  # set up again, now on the launched world


def remove_unused_columns(trainer: Trainer, dataset: Any, description: str) -> Any:
    """A ``datasets.Dataset`` without the columns the model's forward does not take.

    Tested on transformers 5.23 and 5.24 (``Trainer._remove_unused_columns``).
    """
    return trainer._remove_unused_columns(dataset, description=description)


def collator_with_removed_columns(trainer: Trainer, collator: Any, description: str) -> Any:
    """The data collator wrapped to drop the columns the model's forward does not take.

    Tested on transformers 5.23 and 5.24 (``Trainer._get_collator_with_removed_columns``).
    """
    return trainer._get_collator_with_removed_columns(collator, description=description)


def loss_count_rule(trainer: Trainer, model: Any) -> str:
    """How ``Trainer`` would count the tokens it divides a step's summed loss by, for ``model``.

    ``'shifted'``: labels after the causal shift that are not -100 (the token mean);
    ``'unshifted'``: every label that is not -100, as Trainer counts for a model whose
    ``loss_type`` is not a causal-LM loss (``GPT2LMHeadModel`` has none) or, before 5.24, for
    every model; ``'batch_mean'``: the model takes no loss kwargs, so Trainer averages each
    micro-batch's own mean loss. Call after ``Trainer.__init__``.

    Tested on transformers 5.23 and 5.24 (``Trainer._loss_shifts_labels``, new in 5.24,
    ``LOSS_MAPPING``, ``accepts_loss_kwargs``).
    """
    import inspect

    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    if hasattr(model, "accepts_loss_kwargs"):
        accepts = bool(model.accepts_loss_kwargs)
    else:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    if not accepts:
        return "batch_mean"
    if not hasattr(trainer, "_loss_shifts_labels"):
        return "unshifted"
    causal = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return "shifted" if causal else "unshifted"


def train_sampler(trainer: Trainer, dataset: Any) -> Any:
    """The sampler Trainer draws its training rows with (``train_sampling_strategy``).

    Tested on transformers 5.23 and 5.24 (``Trainer._get_train_sampler``).
    """
    return trainer._get_train_sampler(dataset)
