"""``transformers.Trainer`` internals HaptTrainer uses (tested on transformers 5.23).

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
           "determine_best_metric", "run_output_dir", "load_callback_state"]


class TrainerHooks:
    """Mixin put before ``Trainer``: its private checkpoint hooks call the subclass's
    ``save_checkpoint(trial)`` and ``load_best_model()``.

    Tested on transformers 5.23 (``Trainer._save_checkpoint(model, trial)``,
    ``Trainer._load_best_model()``).
    """

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        del model  # the subclass saves every stage of the pipeline
        self.save_checkpoint(trial)

    def _load_best_model(self) -> None:
        self.load_best_model()


def set_train_batch_size(trainer: Trainer, size: int) -> None:
    """The batch size Trainer records for a step (``_train_batch_size``, saved with the state).

    Tested on transformers 5.23.
    """
    trainer._train_batch_size = size


def prepare_state(trainer: Trainer, max_steps: int, num_epochs: int, trial: Any) -> None:
    """What Trainer's loop records in ``state`` before the first step (steps, epochs, trial).

    Tested on transformers 5.23 (``TrainerState.init_training_references``).
    """
    trainer.state.init_training_references(trainer, max_steps, num_epochs, trial)


def learning_rate(trainer: Trainer) -> float:
    """The scheduler's current learning rate, as Trainer logs it.

    Tested on transformers 5.23 (``Trainer._get_learning_rate``).
    """
    return trainer._get_learning_rate()


def determine_best_metric(trainer: Trainer, metrics: dict[str, float], trial: Any) -> bool:
    """Trainer's best-metric bookkeeping (``state.best_metric``, ``best_global_step``);
    True when ``metrics`` is a new best.

    Tested on transformers 5.23 (``Trainer._determine_best_metric``).
    """
    return trainer._determine_best_metric(metrics=metrics, trial=trial)


def run_output_dir(trainer: Trainer, trial: Any) -> str:
    """The directory this run's ``checkpoint-N`` folders go in (per trial in a search).

    Tested on transformers 5.23 (``Trainer._get_output_dir``).
    """
    return trainer._get_output_dir(trial=trial)


def load_callback_state(trainer: Trainer) -> None:
    """Restore the stateful callbacks (early stopping...) from the loaded ``state``.

    Tested on transformers 5.23 (``Trainer._load_callback_state``).
    """
    trainer._load_callback_state()
