"""HaptTrainer with ``checkpoint_local_dir``: each checkpoint's portable part goes to the node's
directory first and is copied into the output directory's checkpoint in the background (the
run waits for the last copy before it returns); a resume on another plan reads the node's copy
first and fetches only what it lacks.

The 3-process run of test_trainer_portable_resume (a sharded last stage) writes checkpoints at
steps 2 and 4 with every rank on one node's directory. One of that node's files of checkpoint-2
(rank 2's) is then lost; 2 processes under another plan resume from checkpoint-2: the rank that
needs rank 2's tensors fetches that one file, the rest is read locally, and the steps after the
resume give the uninterrupted run's losses and final weights (fp32, rtol 1e-5)."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from benchmarks.ranks import run_ranks
from tests.integration.test_trainer_portable_resume import (ACCUMULATION, ATOL, G, RTOL, SAVE_AT, STEPS,
                                                            _config, _merged, _plan, _rows)

pytestmark = pytest.mark.multiproc

RETRIES = {"attempts": 7, "backoff_s": 0.25, "retry_s": 45}
"""The runs' checkpoint_retries: every store of their copies and reads takes them."""


def _train(world: int, root: str, resume: str | None = None) -> dict:
    from transformers import TrainingArguments

    from hapt_hf.integration import trainer_checkpoint
    from hapt_hf.integration.trainer import HaptTrainer
    from hapt_hf.pipeline.runtime import PipelineRuntime, RuntimeConfig
    stores = []  # every store the checkpoints' copy and reads used: their retry settings
    made = trainer_checkpoint.portable_store

    def spied(*a, **k):
        store = made(*a, **k)
        stores.append((store.upload_attempts, store.upload_backoff_s, store.upload_retry_s))
        return store
    trainer_checkpoint.portable_store = spied
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("hapt_hf.checkpoint")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    runtime = PipelineRuntime(_plan(world), _config(), RuntimeConfig(timeout_s=60))
    args = TrainingArguments(output_dir=f"{root}/run", per_device_train_batch_size=G // ACCUMULATION // world,
                             gradient_accumulation_steps=ACCUMULATION, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, max_steps=STEPS, logging_steps=1,
                             learning_rate=1e-3, lr_scheduler_type="linear", max_grad_norm=1.0,
                             save_strategy="steps", save_steps=SAVE_AT)
    trainer = HaptTrainer(args=args, runtime=runtime, train_dataset=_rows(),
                          checkpoint_local_dir=f"{root}/local", checkpoint_retries=RETRIES)
    trainer.train(resume_from_checkpoint=resume)
    history = [h for h in trainer.state.log_history if "loss" in h]
    runtime.shutdown()
    return {"losses": {h["step"]: h["loss"] for h in history}, "lines": lines, "stores": stores,
            "weights": {k: v.detach().numpy().copy() for k, v in runtime.stage.named_parameters()}}


def _written(rank: int, world_size: int, root: str) -> dict:
    return _train(world_size, root)


def _resumed(rank: int, world_size: int, root: str) -> dict:
    return _train(world_size, root, resume=f"{root}/run/checkpoint-{SAVE_AT}")


def test_local_copies_are_read_first_and_only_the_lost_file_is_fetched(tmp_path):
    full = [o.value for o in run_ranks(_written, 3, str(tmp_path), timeout_s=240)]
    for step in (SAVE_AT, STEPS):
        remote = tmp_path / "run" / f"checkpoint-{step}" / "portable"
        assert (remote / ".complete").is_file() and (remote / ".metadata").is_file(), step
        local = tmp_path / "local" / f"checkpoint-{step}" / "portable"
        assert sorted(p.name for p in local.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    (tmp_path / "local" / f"checkpoint-{SAVE_AT}" / "portable" / "__2_0.distcp").unlink()
    resumed = [o.value for o in run_ranks(_resumed, 2, str(tmp_path), timeout_s=240)]
    for o in full + resumed:  # both checkpoints' copies on every rank, the resume's reads
        assert o["stores"] and set(o["stores"]) == {(7, 0.25, 45)}, o["stores"]
    assert all(len(o["stores"]) >= 2 for o in full)
    counts = []
    for o in resumed:
        (line,) = [x for x in o["lines"] if "fetched" in x]
        local_files, fetched_files = map(int, re.search(r"from (\d+) local file\(s\) \(.*\), fetched .* "
                                                        r"from (\d+) remote file", line).groups())
        counts.append((local_files, fetched_files))
    assert all(local_files >= 1 for local_files, _ in counts)
    assert sorted(fetched for _, fetched in counts) == [0, 1]  # rank 2's file, by one rank
    for o in resumed:
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert o["losses"][step] == pytest.approx(full[0]["losses"][step], rel=RTOL), step
    want, got = _merged(full), _merged(resumed)
    assert got.keys() == want.keys()
    for n, w in want.items():
        torch.testing.assert_close(torch.from_numpy(got[n]), torch.from_numpy(w), rtol=RTOL,
                                   atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
