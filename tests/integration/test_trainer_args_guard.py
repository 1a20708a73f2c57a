"""Every TrainingArguments option a user sets is honoured by HaptTrainer or refused by name."""
from __future__ import annotations

import pytest

from hapt_hf.errors import TrainingArgsError
from hapt_hf.integration.trainer_checks import (HONOURED_TRAINING_ARGS,
                                                check_training_args_honoured, wants_recompute)


def _args(tmp_path, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], **kw)


@pytest.mark.parametrize("setting", [
    {"label_smoothing_factor": 0.1}, {"prediction_loss_only": True},
    {"dataloader_num_workers": 2}, {"torch_compile": True}, {"ddp_find_unused_parameters": True},
    {"eval_on_start": True}, {"save_only_model": True}, {"activation_checkpointing_kwargs":
                                                         {"use_reentrant": False}},
])
def test_unhonoured_option_is_refused_by_name(tmp_path, setting):
    (name, value), = setting.items()
    with pytest.raises(TrainingArgsError, match=rf"TrainingArguments\({name}=") as e:
        check_training_args_honoured(_args(tmp_path, **setting))
    assert "cannot be honoured" in str(e.value)


@pytest.mark.parametrize("setting", [
    {"learning_rate": 1e-4}, {"warmup_steps": 3}, {"max_grad_norm": 0.5}, {"seed": 7},
    {"logging_steps": 2}, {"save_total_limit": 1}, {"disable_tqdm": True},
    {"lr_scheduler_type": "cosine"}, {"gradient_checkpointing": True},
    # what Trainer's one-process data loading and evaluation read
    {"per_device_eval_batch_size": 4}, {"data_seed": 3}, {"dataloader_drop_last": True},
    {"remove_unused_columns": False}, {"label_names": ["labels"]},
    {"metric_for_best_model": "accuracy"},
])
def test_honoured_option_passes(tmp_path, setting):
    assert set(setting) <= set(HONOURED_TRAINING_ARGS)
    check_training_args_honoured(_args(tmp_path, **setting))


def test_a_best_model_metric_other_than_the_loss_needs_compute_metrics(tmp_path):
    from hapt_hf.integration.trainer_checks import check_best_metric
    args = _args(tmp_path, metric_for_best_model="accuracy")
    with pytest.raises(TrainingArgsError, match=r"metric_for_best_model='accuracy'.*eval_loss"):
        check_best_metric(args)
    check_best_metric(args, compute_metrics=lambda p: {"accuracy": 1.0})
    check_best_metric(_args(tmp_path, metric_for_best_model="eval_loss"))


def test_gradient_checkpointing_maps_to_recompute(tmp_path):
    assert wants_recompute(_args(tmp_path, gradient_checkpointing=True))
    assert not wants_recompute(_args(tmp_path))


def recompute_worker(rank: int, world: int, out: str, kw: dict):
    from transformers import GPT2Config, TrainingArguments

    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    from hapt_hf.planner.plan import Plan, Stage

    plan = Plan("t", 4, 8, 2, 1, 2, "1f1b", (Stage.even(0, (0, 4), "cpu", "cpu", (0,), 1, micro_batch_size=1),))
    runtime = PipelineRuntime(plan, GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50),
                              RuntimeConfig(timeout_s=60))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, report_to=[], **kw)
    try:
        HaptTrainer(args=args, runtime=runtime)
    except TrainingArgsError as e:
        return str(e)
    return runtime.stage.recompute


@pytest.mark.multiproc
def test_trainer_honours_checkpointing_and_refuses_label_smoothing(tmp_path):
    from benchmarks.ranks import run_ranks
    on = run_ranks(recompute_worker, 1, str(tmp_path), {"gradient_checkpointing": True})
    assert on[0].value is True
    off = run_ranks(recompute_worker, 1, str(tmp_path), {"label_smoothing_factor": 0.1})
    assert "label_smoothing_factor=0.1" in off[0].value


def retries_worker(rank: int, world: int, out: str, kw: dict):
    from transformers import GPT2Config, TrainingArguments

    from hapt_hf.integration.config import HaptConfigError
    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    from hapt_hf.planner.plan import Plan, Stage

    plan = Plan("t", 4, 8, 2, 1, 2, "1f1b", (Stage.even(0, (0, 4), "cpu", "cpu", (0,), 1, micro_batch_size=1),))
    runtime = PipelineRuntime(plan, GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50),
                              RuntimeConfig(timeout_s=60))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, report_to=[])
    try:
        return HaptTrainer(args=args, runtime=runtime, **kw).checkpoint_retries
    except (TrainingArgsError, HaptConfigError) as e:
        return str(e)


@pytest.mark.multiproc
def test_checkpoint_retries_need_the_local_copy_and_are_checked(tmp_path):
    """Retries that nothing would retry (no checkpoint_local_dir) are refused by name, as are
    bad values; good ones are kept as given."""
    from benchmarks.ranks import run_ranks
    local = str(tmp_path / "local")
    cases = [({"checkpoint_retries": {"attempts": 3}},
              "checkpoint_retries is set but checkpoint_local_dir is not"),
             ({"checkpoint_retries": {"attempts": 0}, "checkpoint_local_dir": local},
              "'checkpoint_retries.attempts' is 0; give a whole number of attempts >= 1"),
             ({"checkpoint_retries": {"attempts": 3, "retry_s": 5}, "checkpoint_local_dir": local},
              {"attempts": 3, "retry_s": 5}),
             ({"checkpoint_local_dir": local}, None)]
    for kw, want in cases:
        got = run_ranks(retries_worker, 1, str(tmp_path / "out"), kw)[0].value
        if isinstance(want, str):
            assert want in got, (kw, got)
        else:
            assert got == want, (kw, got)


def test_model_and_model_init_together_are_refused(tmp_path):
    """Trainer would re-make the model with model_init at train(); the stages are built once."""
    from torch import nn

    from hapt_hf import HaptTrainer
    with pytest.raises(TrainingArgsError, match="model= and model_init=.*give one of the two"):
        HaptTrainer(model=nn.Linear(2, 2), model_init=lambda: nn.Linear(2, 2),
                    args=_args(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_compute_loss_func_is_refused(tmp_path):
    from torch import nn

    from hapt_hf import HaptTrainer
    with pytest.raises(TrainingArgsError, match="compute_loss_func=.*cannot be honoured"):
        HaptTrainer(model=nn.Linear(2, 2), args=_args(tmp_path / "out"),
                    compute_loss_func=lambda *a, **k: 0)


def test_label_names_other_than_labels_are_refused(tmp_path):
    from hapt_hf.integration.trainer_checks import check_training_args_honoured
    check_training_args_honoured(_args(tmp_path, label_names=["labels"]))
    with pytest.raises(TrainingArgsError, match=r"label_names=\['target'\]\) cannot be honoured"):
        check_training_args_honoured(_args(tmp_path, label_names=["target"]))
