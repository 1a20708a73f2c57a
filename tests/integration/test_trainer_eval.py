"""HaptTrainer's evaluation, prediction, data checks and best-model loading, on Gloo ranks.

The model has dropout (0.1, the transformers GPT-2 default): evaluation and prediction must run
as a single process's ``model.eval()`` does, and must not move the RNG that training's dropout
draws from, so a run that evaluates in the middle trains exactly as one that does not.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.planner.plan import Plan, StagePlan
from hapt_hf.testing import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, VOCAB, MBS, M = 8, 97, 2, 2
G = MBS * M
RTOL, ATOL = 1e-5, 4e-5


def _config(dropout: float = 0.1):
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                      tie_word_embeddings=True)


def _plan(world_size: int) -> Plan:
    """Uneven stages: embedding + 3 blocks | 1 block + head (on two replicas with 3 ranks);
    one stage on one rank."""
    if world_size == 1:
        return Plan("tiny-gpt2", 6, SEQ, G, MBS, M, "1f1b",
                    (StagePlan(0, (0, 6), "cpu", "cpu", (0,), 1),))
    last = tuple(range(1, world_size))
    return Plan("tiny-gpt2", 6, SEQ, G, MBS, M, "1f1b", (
        StagePlan(0, (0, 4), "cpu", "cpu", (0,), 2),
        StagePlan(1, (4, 6), "cpu", "cpu", last, 1))).validate(world_size=world_size)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _args(out: str, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=MBS,
                             gradient_accumulation_steps=M, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, **kw)


def _trainer(world_size: int, out: str, dropout: float = 0.1, train=None, eval_=None, **kw):
    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    runtime = PipelineRuntime(_plan(world_size), _config(dropout), RuntimeConfig(timeout_s=60))
    return HaptTrainer(runtime, runtime.plan, _args(out, **kw), train_dataset=train,
                       eval_dataset=eval_)


def _np(t):
    """Tensors go back to the test as numpy arrays: pickled by value, not through shared
    memory that a rank's fast exit would tear down."""
    return None if t is None else t.detach().numpy().copy()


def _weights(trainer) -> dict:
    return {k: _np(v) for k, v in trainer.runtime.stage.state_dict().items()}


def _reference():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)  # the stages' weights equal this model's (RuntimeConfig.seed = 0)
    return AutoModelForCausalLM.from_config(_config(), attn_implementation=DEFAULT_ATTN_IMPLEMENTATION).eval()


# -- evaluation and prediction equal model.eval() on one process ------------------------------

def _eval_and_predict(rank: int, world_size: int, out: str) -> dict:
    from transformers import set_seed
    trainer = _trainer(world_size, out, train=_rows(8, 1), eval_=_rows(8, 2))
    stage = trainer.runtime.stage
    stage.train()
    set_seed(7)
    before = torch.get_rng_state()
    metrics = trainer.evaluate()
    test = _rows(6, 3)  # not a multiple of the global batch: the tail batch is filled up
    pred = trainer.predict(test)
    step_loss, step_logits, _ = trainer.prediction_step(trainer.model, {"input_ids": test[:G]},
                                                        prediction_loss_only=False)
    return {"eval_loss": metrics["eval_loss"], "test_loss": pred.metrics["test_loss"],
            "logits": _np(pred.predictions), "step_loss": float(step_loss),
            "step_logits": _np(step_logits),
            "rng_kept": torch.equal(before, torch.get_rng_state()),
            "all_training": all(m.training for m in stage.modules())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_and_predict_equal_one_process_in_eval_mode(world_size, tmp_path):
    got = [o.value for o in run_ranks(_eval_and_predict, world_size, str(tmp_path))]
    model, eval_rows, test = _reference(), _rows(8, 2), _rows(6, 3)
    with torch.no_grad():
        ref_eval = sum(model(input_ids=b, labels=b).loss.item()
                       for b in eval_rows.split(G)) / 2
        ref = model(input_ids=test, labels=test)
        ref_step = model(input_ids=test[:G], labels=test[:G]).loss.item()
    for r, v in enumerate(got):
        assert v["rng_kept"], f"rank {r}: evaluation moved the training RNG"
        assert v["all_training"], f"rank {r}: the stage was left out of training mode"
        torch.testing.assert_close(v["eval_loss"], ref_eval, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(v["test_loss"], ref.loss.item(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(v["step_loss"], ref_step, rtol=RTOL, atol=ATOL)
    assert all(v["logits"] is None and v["step_logits"] is None for v in got[1:])
    torch.testing.assert_close(torch.from_numpy(got[0]["logits"]), ref.logits,
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.from_numpy(got[0]["step_logits"]), ref.logits[:G],
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


# -- data that does not fit the plan is refused before the first step ---------------------------

def _refusals(rank: int, world_size: int, out: str) -> dict:
    from datasets import Dataset

    from hapt_hf.integration.data import DataError
    from hapt_hf.integration.trainer import TrainingArgsError
    ragged = Dataset.from_dict({"input_ids": [list(range(SEQ)), list(range(SEQ - 3))] * 4})
    cases = {"long_rows": dict(train=_rows(8, 1).repeat(1, 2)),
             "ragged": dict(train=ragged),
             "small_eval": dict(train=_rows(8, 1), eval_=_rows(G - 1, 2)),
             "best_metric": dict(train=_rows(8, 1), eval_=_rows(8, 2), eval_strategy="steps",
                                 eval_steps=1, load_best_model_at_end=True,
                                 metric_for_best_model="accuracy")}
    msgs = {}
    for name, kw in cases.items():
        try:
            _trainer(world_size, out, **kw)
        except (DataError, TrainingArgsError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
    return {"msgs": msgs, "out_exists": Path(out).exists()}


def test_data_and_settings_that_do_not_fit_are_refused_at_construction(tmp_path):
    out = tmp_path / "out"
    got = run_ranks(_refusals, 1, str(out))[0].value
    msgs = got["msgs"]
    assert "rows have 16 tokens but the plan was made for seq_len 8" in msgs["long_rows"]
    assert "blocks of 8 tokens" in msgs["long_rows"]
    assert "uneven lengths (5 to 8 tokens)" in msgs["ragged"] and "pack_tokens" in msgs["ragged"]
    assert msgs["small_eval"].startswith("DataError: eval_dataset has 3 samples, fewer than one "
                                         "global batch of the plan (4)")
    assert "metric_for_best_model='accuracy'" in msgs["best_metric"]
    assert "eval_loss" in msgs["best_metric"]
    assert not got["out_exists"], "a refused trainer must not create the output directory"


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
    saved, last = load_file(best / "model.safetensors"), load_file(
        tmp_path / "checkpoint-4" / "model.safetensors")
    for v in got:
        for k, w in v["weights"].items():
            key = "transformer.wte.weight" if k == "lm_head.weight" else k  # tied: stored once
            assert torch.equal(torch.from_numpy(w), saved[key]), k
        assert any(not torch.equal(torch.from_numpy(w), last[k]) for k, w in v["weights"].items()
                   if k in last), "the final weights are the last checkpoint's"
