"""HaptTrainer's evaluation, prediction, data checks and best-model loading, on Gloo ranks.

The model has dropout (0.1, the transformers GPT-2 default): evaluation and prediction must run
as a single process's ``model.eval()`` does, and must not move the RNG that training's dropout
draws from, so a run that evaluates in the middle trains exactly as one that does not. As
``Trainer`` evaluates, every row counts: eval batches of ``per_device_eval_batch_size x
processes`` rows (each run as global batches of the plan, a short one filled with ignored rows),
``eval_loss`` the mean over rows of each batch's loss, ``compute_metrics`` on the logits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, VOCAB, MBS = 8, 97, 2
ACCUMULATION = 2  # gradient_accumulation_steps; per device = global batch / (it x processes)
EVAL_PER_DEVICE = 3  # per_device_eval_batch_size: eval batches of 6 rows on 2 ranks, 9 on 3
RTOL, ATOL = 1e-5, 4e-5


def _global_batch(world_size: int) -> int:
    """2 micro-batches of 2 samples; 3 of them on 3 ranks (a global batch they divide)."""
    return MBS * (3 if world_size == 3 else 2)


def _config(dropout: float = 0.1):
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                      tie_word_embeddings=True)


def _plan(world_size: int) -> Plan:
    """Uneven stages: embedding + 3 blocks | 1 block + head (on two replicas with 3 ranks);
    one stage on one rank."""
    g = _global_batch(world_size)
    if world_size == 1:
        return Plan("tiny-gpt2", 6, SEQ, g, MBS, g // MBS, "1f1b",
                    (Stage.even(0, (0, 6), "cpu", "cpu", (0,), 1, micro_batch_size=MBS),))
    last = tuple(range(1, world_size))
    return Plan("tiny-gpt2", 6, SEQ, g, MBS, g // MBS, "1f1b", (
        Stage.even(0, (0, 4), "cpu", "cpu", (0,), 2, micro_batch_size=MBS),
        Stage.even(1, (4, 6), "cpu", "cpu", last, 1, micro_batch_size=MBS))).validate(world_size=world_size)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _args(out: str, world_size: int, **kw):
    from transformers import TrainingArguments
    settings = dict(output_dir=out, gradient_accumulation_steps=ACCUMULATION,
                    per_device_train_batch_size=_global_batch(world_size) // (
                        ACCUMULATION * world_size),
                    per_device_eval_batch_size=EVAL_PER_DEVICE, report_to=[], use_cpu=True,
                    disable_tqdm=True, seed=0)
    return TrainingArguments(**{**settings, **kw})


def _trainer(world_size: int, out: str, dropout: float = 0.1, train=None, eval_=None,
             trainer_kw: dict | None = None, **kw):
    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    runtime = PipelineRuntime(_plan(world_size), _config(dropout), RuntimeConfig(timeout_s=60))
    return HaptTrainer(args=_args(out, world_size, **kw), runtime=runtime, train_dataset=train,
                       eval_dataset=eval_, **(trainer_kw or {}))


def _np(t):
    """Tensors go back to the test as numpy arrays: pickled by value, not through shared
    memory that a rank's fast exit would tear down."""
    return None if t is None else t.detach().numpy().copy()


def _weights(trainer) -> dict:
    return {k: _np(v) for k, v in trainer.runtime.stage.state_dict().items()}


def _reference():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)  # the stages' weights equal this model's (RuntimeConfig.seed = 0)
    return AutoModelForCausalLM.from_config(
        _config(), attn_implementation=DEFAULT_ATTN_IMPLEMENTATION).eval()


def _argmax(logits, labels):
    """run_clm's preprocess_logits_for_metrics."""
    return logits.argmax(dim=-1)


def _accuracy(eval_preds) -> dict:
    """run_clm's compute_metrics: accuracy of the next-token argmax."""
    preds, labels = eval_preds
    return {"accuracy": float((preds[:, :-1] == labels[:, 1:]).mean())}


def _ragged():
    """Rows of uneven length (texts not grouped into blocks), as a dataset."""
    from datasets import Dataset
    rows = _rows(7, 5)
    return Dataset.from_dict({"input_ids": [r[:n].tolist()
                                            for r, n in zip(rows, (8, 5, 3, 8, 6, 2, 4))]})


def _pad(features) -> dict:
    """A padding collator: on the right to the batch's longest row, labels -100 there."""
    rows = [torch.as_tensor(f["input_ids"]) for f in features]
    n = max(len(r) for r in rows)
    pad = [n - len(r) for r in rows]
    cat = torch.nn.functional.pad
    return {"input_ids": torch.stack([cat(r, (0, k), value=0) for r, k in zip(rows, pad)]),
            "labels": torch.stack([cat(r, (0, k), value=-100) for r, k in zip(rows, pad)]),
            "attention_mask": torch.stack([cat(torch.ones_like(r), (0, k), value=0)
                                           for r, k in zip(rows, pad)])}


# -- evaluation and prediction equal model.eval() on one process ------------------------------

def _eval_and_predict(rank: int, world_size: int, out: str) -> dict:
    from transformers import set_seed
    trainer = _trainer(world_size, out, train=_rows(8, 1), eval_=_rows(10, 2),
                       trainer_kw={"data_collator": _pad})
    g = trainer.plan.global_batch_size
    stage = trainer.runtime.stage
    stage.train()
    set_seed(7)
    before = torch.get_rng_state()
    metrics = trainer.evaluate()
    small = trainer.evaluate(_rows(3, 4))  # fewer rows than one global batch: all of them
    ragged = trainer.evaluate(_ragged())  # padded by the collator; its own tokens count
    test = _rows(7, 3)  # not a multiple of the global batch: the tail batch is filled up
    pred = trainer.predict(test)
    step_loss, step_logits, _ = trainer.prediction_step(trainer.model, {"input_ids": test[:g]},
                                                        prediction_loss_only=False)
    # run_clm's accuracy (compute_metrics on the argmax of preprocess_logits_for_metrics)
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = _accuracy, _argmax
    with_metrics = trainer.evaluate()
    return {"eval_loss": metrics["eval_loss"], "small_loss": small["eval_loss"],
            "ragged_loss": ragged["eval_loss"], "test_loss": pred.metrics["test_loss"],
            "logits": pred.predictions, "label_ids": pred.label_ids,
            "step_loss": float(step_loss), "step_logits": _np(step_logits),
            "metrics_loss": with_metrics["eval_loss"], "accuracy": with_metrics["eval_accuracy"],
            "rng_kept": torch.equal(before, torch.get_rng_state()),
            "all_training": all(m.training for m in stage.modules())}


def _trainer_eval_loss(model, data: list[dict], world_size: int) -> float:
    """Trainer's eval_loss: the mean over rows of each eval batch's loss."""
    per_batch = EVAL_PER_DEVICE * world_size
    total = 0.0
    for lo in range(0, len(data), per_batch):
        batch = _pad(data[lo:lo + per_batch])
        total += model(**batch).loss.item() * len(batch["input_ids"])
    return total / len(data)


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_and_predict_equal_one_process_in_eval_mode(world_size, tmp_path):
    got = [o.value for o in run_ranks(_eval_and_predict, world_size, str(tmp_path))]
    model, test, g = _reference(), _rows(7, 3), _global_batch(world_size)
    items = {name: [{"input_ids": r} for r in rows] for name, rows in (
        ("eval", _rows(10, 2)), ("small", _rows(3, 4)), ("test", test))}
    items["ragged"] = [{"input_ids": r} for r in _ragged()["input_ids"]]
    with torch.no_grad():
        ref = {name: _trainer_eval_loss(model, data, world_size) for name, data in items.items()}
        logits = model(input_ids=test).logits
        ref_step = model(input_ids=test[:g], labels=test[:g]).loss.item()
        eval_rows = _rows(10, 2)
        accuracy = float((model(input_ids=eval_rows).logits.argmax(-1)[:, :-1]
                          == eval_rows[:, 1:]).float().mean())
    for r, v in enumerate(got):
        assert v["rng_kept"], f"rank {r}: evaluation moved the training RNG"
        assert v["all_training"], f"rank {r}: the stage was left out of training mode"
        for name, key in (("eval", "eval_loss"), ("eval", "metrics_loss"),
                          ("small", "small_loss"), ("ragged", "ragged_loss"),
                          ("test", "test_loss")):
            torch.testing.assert_close(v[key], ref[name], rtol=RTOL, atol=ATOL, msg=key)
        torch.testing.assert_close(v["step_loss"], ref_step, rtol=RTOL, atol=ATOL)
        assert v["accuracy"] == pytest.approx(accuracy, abs=1e-6), r  # on every rank
    assert all(v["logits"] is None and v["step_logits"] is None for v in got[1:])
    torch.testing.assert_close(torch.from_numpy(got[0]["logits"]), logits, rtol=RTOL, atol=ATOL)
    assert (got[0]["label_ids"] == test.numpy()).all()
    torch.testing.assert_close(torch.from_numpy(got[0]["step_logits"]), logits[:g],
                               rtol=RTOL, atol=ATOL)


# -- evaluating in the middle changes no later step -------------------------------------------

def _train(rank: int, world_size: int, out: str, evaluate: bool) -> dict:
    torch.manual_seed(1234)
    trainer = _trainer(world_size, out, train=_rows(16, 1), eval_=_rows(8, 2), max_steps=6,
                       learning_rate=1e-3, logging_steps=1,
                       eval_strategy="steps" if evaluate else "no", eval_steps=2)
    trainer.train()
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "evals": [h["eval_loss"] for h in history if "eval_loss" in h],
            "weights": _weights(trainer)}


def _train_both(rank: int, world_size: int, out: str) -> tuple[dict, dict]:
    return _train(rank, world_size, out + "/a", True), _train(rank, world_size, out + "/b", False)


def test_training_with_evaluation_equals_training_without(tmp_path):
    for r, (with_eval, without) in enumerate(o.value for o in run_ranks(_train_both, 2,
                                                                          str(tmp_path))):
        assert len(with_eval["evals"]) == 3 and not without["evals"]
        assert len(with_eval["losses"]) == 6
        assert with_eval["losses"] == without["losses"], f"rank {r}"
        for k, w in with_eval["weights"].items():
            assert (w == without["weights"][k]).all(), f"rank {r}: {k} differs"


# -- settings that do not fit are refused at construction, rows that do not fit at step one ---

def _refusals(rank: int, world_size: int, out: str) -> dict:
    from hapt_hf.integration.data import DataError
    from hapt_hf.integration.trainer import TrainingArgsError
    cases = {"batch_mapping": dict(train=_rows(8, 1), per_device_train_batch_size=1),
             "best_metric": dict(train=_rows(8, 1), eval_=_rows(8, 2), eval_strategy="steps",
                                 eval_steps=1, load_best_model_at_end=True,
                                 metric_for_best_model="accuracy"),
             "loss_func": dict(train=_rows(8, 1),
                               trainer_kw={"compute_loss_func": lambda *a, **k: 0.0})}
    msgs = {}
    for name, kw in cases.items():
        try:
            _trainer(world_size, out, **kw)
        except (DataError, TrainingArgsError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    out_exists = Path(out).exists()
    # with compute_metrics, another best-model metric is one HaptTrainer can compute
    accepted = _trainer(world_size, out + "-metric", train=_rows(8, 1), eval_=_rows(8, 2),
                        trainer_kw={"compute_metrics": _accuracy}, eval_strategy="steps",
                        eval_steps=1, load_best_model_at_end=True,
                        metric_for_best_model="accuracy")
    # rows longer than the plan's seq_len: refused at construction, before anything is written
    long_out = out + "-long"
    try:
        _trainer(world_size, long_out, train=_rows(8, 1).repeat(1, 2), max_steps=1)
    except DataError as e:
        msgs["long_rows"] = f"{type(e).__name__}: {e}"
    return {"msgs": msgs, "out_exists": out_exists, "accepted": type(accepted).__name__,
            "long_written": Path(long_out).exists()}


def test_settings_and_rows_that_do_not_fit_are_refused_before_any_step(tmp_path):
    out = tmp_path / "out"
    got = run_ranks(_refusals, 1, str(out))[0].value
    msgs = got["msgs"]
    assert msgs["batch_mapping"] == (
        "BatchMappingError: per_device_train_batch_size=1 x gradient_accumulation_steps=2 x 1 "
        "processes = 2 samples per step, but the plan runs global batches of 4; set "
        "per_device_train_batch_size=4 with gradient_accumulation_steps=1 or "
        "per_device_train_batch_size=2 with gradient_accumulation_steps=2")
    assert "metric_for_best_model='accuracy'" in msgs["best_metric"]
    assert "eval_loss" in msgs["best_metric"] and "compute_metrics" in msgs["best_metric"]
    assert msgs["loss_func"].startswith("TrainingArgsError: HaptTrainer(compute_loss_func=...) "
                                        "cannot be honoured")
    assert not got["out_exists"], "a refused trainer must not create the output directory"
    assert got["accepted"] == "HaptTrainer"
    assert msgs["long_rows"] == (
        "DataError: train_dataset rows hold 16 tokens but the plan was made for seq_len 8; group "
        "the texts into rows of 8 tokens (run_clm's --block_size 8) or set seq_len: 16 in the "
        "hapt config"), msgs["long_rows"]
    assert not got["long_written"], "a refused trainer must not create the output directory"


# -- load_best_model_at_end restores the best checkpoint ----------------------------------------

def _best(rank: int, world_size: int, out: str) -> dict:
    # Training on one repeated token makes the model predict it everywhere: the loss on rows
    # of another token rises step after step, so the best checkpoint is an early one.
    train, held_out = (torch.full((16, SEQ), t, dtype=torch.long) for t in (5, 7))
    trainer = _trainer(world_size, out, dropout=0.0, train=train, eval_=held_out, max_steps=4,
                       learning_rate=5e-2, lr_scheduler_type="constant", logging_steps=1,
                       eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                       save_total_limit=2, load_best_model_at_end=True,
                       metric_for_best_model="eval_loss")
    trainer.train()
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    return {"evals": evals, "best": trainer.state.best_model_checkpoint,
            "weights": _weights(trainer)}


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    from safetensors.torch import load_file
    got = [o.value for o in run_ranks(_best, 2, str(tmp_path))]
    evals = got[0]["evals"]
    best_step = min(evals, key=lambda se: se[1])[0]
    assert len(evals) == 4 and best_step != 4, f"the run must make the last eval worse: {evals}"
    best = tmp_path / f"checkpoint-{best_step}"
    assert all(v["best"] == str(best) for v in got)
    # the best checkpoint survives save_total_limit=2 beside the last one
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == sorted(
        {best.name, "checkpoint-4"})
    saved, last = ({k: v for f in sorted(d.glob("model-*.safetensors")) for k, v in load_file(f).items()}
                   for d in (best, tmp_path / "checkpoint-4"))  # each stage's file
    for v in got:
        for k, w in v["weights"].items():
            key = "transformer.wte.weight" if k == "lm_head.weight" else k  # tied: stored once
            assert torch.equal(torch.from_numpy(w), saved[key]), k
        assert any(not torch.equal(torch.from_numpy(w), last[k]) for k, w in v["weights"].items()
                   if k in last), "the final weights are the last checkpoint's"
