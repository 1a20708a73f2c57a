"""A model type without a hand formula (Qwen3) planned and trained end to end on Gloo ranks.

The plan comes from the planner (figures read off the model by hapt_hf.profiling.model_reader)
on a two-rank cluster, cut as two pipeline stages; HaptTrainer on two ranks must log the same
losses as ``transformers.Trainer`` on one process training the whole model from the same weights
(its per-device batch the whole data-parallel batch, the same accumulation and seed).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.chain_check import tiny_config
from benchmarks.ranks import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, MBS, M = 8, 2, 2
G = MBS * M  # 1 per device x 2 accumulation x 2 processes
ACCUMULATION = 2


def _config():
    return tiny_config("qwen3", blocks=3)


def _plan(world_size: int):
    """The planner's figures for qwen3; two stages on two ranks, one stage on one."""
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.plan import Plan, Stage
    from hapt_hf.profiling.model_figures import MeasuringReader

    spec = ModelSpec.from_config(_config(), SEQ, "fp32", name="tiny-qwen3", reader=MeasuringReader())
    cut = ((0, spec.num_layers),) if world_size == 1 else ((0, 3), (3, spec.num_layers))
    # 1F1B: a stage runs as many forwards before its first backward as stages from it to the end
    stages = tuple(Stage.even(i, r, "cpu", "cpu", (i,), len(cut) - i, micro_batch_size=MBS)
                   for i, r in enumerate(cut))
    return Plan(spec.name, spec.num_layers, SEQ, G, MBS, M, "1f1b", stages).validate(
        world_size=world_size)


def _rows(n: int, seed: int) -> torch.Tensor:
    # a few tokens only: a model that trains learns their frequencies within a few steps
    return torch.randint(0, 4, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _args(out: str, per_device: int):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=out, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=ACCUMULATION, report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0, max_steps=4,
                             learning_rate=1e-2, logging_steps=1)


def _runtime(world_size: int):
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    return PipelineRuntime(_plan(world_size), _config(), RuntimeConfig(timeout_s=60))


def _train(rank: int, world_size: int, out: str) -> list[float]:
    from hapt_hf.integration.trainer import HaptTrainer

    torch.manual_seed(1234)
    trainer = HaptTrainer(args=_args(out, G // (ACCUMULATION * world_size)),
                          runtime=_runtime(world_size), train_dataset=_rows(16, 1))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _one_process(rank: int, world_size: int, out: str) -> list[float]:
    """Trainer on one process, the whole model holding the weights the stages start from (a
    one-stage runtime's), the rows as HaptTrainer takes a tensor: {'input_ids', 'labels'}."""
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_config(_config())
    model.load_state_dict(_runtime(1).stage.state_dict())
    assert model.loss_type == "ForCausalLM"  # Trainer's loss: the token mean, as HaptTrainer's
    rows = [{"input_ids": r, "labels": r} for r in _rows(16, 1)]
    trainer = Trainer(model=model, args=_args(out, G // ACCUMULATION), train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_planner_figures_for_qwen3_are_read_off_the_model():
    plan = _plan(2)
    assert plan.num_layers == 5 and [s.layers for s in plan.stages] == [(0, 3), (3, 5)]


def test_two_ranks_train_qwen3_as_one_process(tmp_path):
    one = run_ranks(_one_process, 1, str(tmp_path / "one"))[0].value
    two = run_ranks(_train, 2, str(tmp_path / "two"))
    assert len(one) == 4 and one[-1] < one[0]
    for outcome in two:
        torch.testing.assert_close(outcome.value, one, rtol=1e-5, atol=1e-5)


def test_launch_accepts_verified_types_and_refuses_the_rest():
    from transformers import BertConfig

    from hapt_hf.integration.launch import LaunchError
    from hapt_hf.integration.plan_resolution import check_model_family
    check_model_family(_config())  # qwen3: verified by the chain check, no hand formula
    with pytest.raises(LaunchError, match="'bert'.*verified types of docs/models.md"):
        check_model_family(BertConfig())
