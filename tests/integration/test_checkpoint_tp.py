"""Checkpoints and tensor-parallel replicas, without ranks: a checkpoint is resumed only by a plan
whose replicas hold the same ranks (two replicas of one rank are not one replica of two, though
the stage lists the same ranks), and an optimizer state written as one rank's tensor-parallel
shards is never taken by an optimizer of whole parameters."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hapt_hf.integration.trainer_checkpoint import (CheckpointError, check_resumable, load_rank_state,
                                                    rank_state_file)
from hapt_hf.pipeline.zero import LOCAL_KEY
from hapt_hf.planner.plan import Plan, Replica, Stage


def _plan(tp: bool) -> Plan:
    first = Stage.even(0, (0, 4), "cpu", "cpu", (0,), 2, micro_batch_size=2)
    reps = ((Replica("cpu", "cpu", 2, (1, 2)),) if tp
            else (Replica("cpu", "cpu", 1, (1,)), Replica("cpu", "cpu", 1, (2,))))
    return Plan("llama-tiny", 8, 16, 8, 2, 4, "1f1b", (first, Stage(1, (4, 8), reps, 1))).validate(3)


def test_a_checkpoint_of_other_replicas_on_the_same_ranks_is_refused(tmp_path):
    for name in ("trainer_state.json", "model.safetensors", "hapt_rank0.pt", "hapt_rank1.pt",
                 "hapt_rank2.pt"):
        (tmp_path / name).write_text("")
    _plan(tp=False).save(tmp_path / "plan.json")
    check_resumable(tmp_path, _plan(tp=False), 3)  # the same plan: fine
    assert _plan(True).stages[1].ranks == _plan(False).stages[1].ranks
    with pytest.raises(CheckpointError, match=r"layers \[4, 8\] on \[\[1\], \[2\]\]\) than this "
                                              r"run's \(.*layers \[4, 8\] on \[\[1, 2\]\]\)"):
        check_resumable(tmp_path, _plan(tp=True), 3)


def test_a_tensor_parallel_shard_of_optimizer_state_is_refused_by_a_whole_parameter(tmp_path):
    p = torch.nn.Parameter(torch.zeros(4, 2))
    shard = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 2),
                           "exp_avg_sq": torch.zeros(2, 2)}},
             "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.0, "amsgrad": False}],
             LOCAL_KEY: [[0, "exp_avg"], [0, "exp_avg_sq"]]}
    rng = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state()}
    torch.save({"optimizer": shard, "scheduler": None, "rng": rng, "loss_scale": None},
               rank_state_file(tmp_path, 1))
    whole = torch.optim.AdamW([p], lr=1e-3)
    with pytest.raises(CheckpointError, match=r"hapt_rank1\.pt.*one tensor-parallel shard"):
        load_rank_state(tmp_path, 1, whole, None)
    assert not whole.state
