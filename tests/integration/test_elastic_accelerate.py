"""A HaptAccelerator loop under the elastic agent resumes by itself: ``resume_if_restarted``.

A loop on 2 processes (the plan made by rank 0 from a cluster file, as an elastic run needs)
saves its state with Accelerate's automatic naming after step 2 of 4 and runs on to step 4,
started as torchrun's agent starts a first try (``TORCHELASTIC_RUN_ID``, ``--max-restarts 2``,
no failure counted). The same loop started again with the same run id (a node joined: the agent
restarts the workers without counting a failure, and ``hapt_elastic.json`` names the run)
resumes ``checkpoint_0`` with no hand step: its steps 3 and 4 equal the first start's exactly
(the same plan), its own step counter (registered for checkpointing) comes back, and its next
``save_state()`` writes ``checkpoint_1``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.ranks import run_ranks
from tests.integration.elastic_loop_job import Progress
from tests.integration.test_accelerate_plugin import GA, G, SEQ, _config, _Rows

pytestmark = pytest.mark.multiproc

STEPS, SAVE_AT = 4, 2
CLUSTER = """name: two-cpus
groups:
  - {name: cpu, gpu: cpu-small, tflops: 0.05, memory_gb: 16, nodes: 1, gpus_per_node: 2}
"""
ELASTIC = {"TORCHELASTIC_RUN_ID": "loop-run", "TORCHELASTIC_MAX_RESTARTS": "2",
           "TORCHELASTIC_RESTART_COUNT": "0"}


def loop(rank: int, world: int, root: str) -> dict:
    from accelerate.utils import ProjectConfiguration, set_seed
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig

    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    dl = torch.utils.data.DataLoader(_Rows(STEPS * G), batch_size=G // GA // world, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hapt = HaptConfig(cluster=Path(root) / "cluster.yaml", global_batch_size=G, seq_len=SEQ,
                      timeout_s=60)
    acc = HaptAccelerator(cpu=True, gradient_accumulation_steps=GA, hapt_plugin=hapt,
                          project_config=ProjectConfiguration(project_dir=f"{root}/out",
                                                              automatic_checkpoint_naming=True))
    progress = Progress()
    acc.register_for_checkpointing(progress)
    scheduler = get_linear_schedule_with_warmup(optimizer, acc.num_processes, 10 * acc.num_processes)
    model, optimizer, dl, scheduler = acc.prepare(model, optimizer, dl, scheduler)
    resumed = acc.resume_if_restarted()
    first, losses, micro = progress.step, {}, []
    while progress.step < STEPS:
        for batch in dl:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                micro.append(loss.item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                progress.step += 1
                losses[progress.step], micro = sum(micro) / len(micro), []
                if progress.step == SAVE_AT and resumed is None:
                    acc.save_state()
                if progress.step == STEPS:
                    break
    saved = acc.save_state() if resumed is not None else None
    return {"resumed": resumed, "first": first, "losses": losses, "saved": saved,
            "plan": acc.plan.to_dict()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("elastic_loop")
    (root / "cluster.yaml").write_text(CLUSTER)
    start = run_ranks(loop, 2, str(root), env=ELASTIC, timeout_s=150)
    again = run_ranks(loop, 2, str(root), env=ELASTIC, timeout_s=150)
    return {"root": root, "start": start[0].value, "again": again[0].value,
            "again_ranks": [o.value for o in again]}


def test_a_restart_resumes_the_newest_state_with_no_hand_step(runs):
    start, again, out = runs["start"], runs["again"], runs["root"] / "out"
    assert start["resumed"] is None and start["first"] == 0
    assert sorted(start["losses"]) == [1, 2, 3, 4]
    assert again["resumed"] == str(out / "checkpoints" / "checkpoint_0")
    assert {o["resumed"] for o in runs["again_ranks"]} == {again["resumed"]}  # every rank
    assert again["first"] == SAVE_AT and sorted(again["losses"]) == [3, 4]
    assert again["plan"] == start["plan"]
    assert again["losses"] == {s: start["losses"][s] for s in (3, 4)}  # exactly


def test_the_next_save_after_a_resume_continues_the_numbering(runs):
    out = runs["root"] / "out" / "checkpoints"
    assert runs["again"]["saved"] == str(out / "checkpoint_1")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint_0", "checkpoint_1"]
    assert '"run_id": "loop-run", "starts": 2' in (out / "hapt_elastic.json").read_text()
