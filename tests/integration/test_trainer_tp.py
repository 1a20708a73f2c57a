"""HaptTrainer and HaptAccelerator as drop-ins on a plan with a tensor-parallel stage: the calls
of transformers' ``run_clm.py`` (test_trainer_dropin's script) and ``run_clm_no_trainer.py``
(test_accelerate_clm's), only the class changed, on 5 and 4 Gloo ranks, against ``Trainer`` /
``Accelerator`` on ONE process with the same global batch.

The Trainer's plan (LLaMA, 4 blocks): stage 0 (the embedding and two blocks) on rank 0;
stage 1 (two blocks and the head) on two replicas each held by two ranks together, their
projections sharded two ways, taking 3 and 2 samples of every micro-batch, their optimizer state
sharded (ZeRO-1) between the ranks holding the same shards. What must hold, as for any plan:
every logged loss and learning rate (the loss counted once per replica, not once per rank), the
eval loss over every row and the accuracy on the gathered logits, the saved model, whole, equal
to the one process's (rtol 1e-5 on the logs; the saved weights as test_trainer_dropin compares
them); and a run resumed from its checkpoint in fresh processes reproduces the uninterrupted
run bit for bit (every rank's optimizer shard of tensor-parallel shards in its own file).
The Accelerate script's plan (6 blocks): the embedding and two blocks on two replicas of one
rank | four blocks and the head on ranks 2 and 3 together; its tolerance on the weights is
stated where it is checked.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.test_trainer_dropin import SEQ, _assert_same_training, _hapt, _load, _one_process

pytestmark = [pytest.mark.multiproc]

RTOL, ATOL = 1e-5, 4e-5


def _tp_plan(path: Path) -> Path:
    """5 ranks, 10 samples a step (1 a device x 2 accumulation x 5): the embedding and two
    blocks on rank 0 | two blocks and the head on two tensor-parallel replicas, ranks (1, 2)
    and (3, 4), taking 3 and 2 samples of every micro-batch, their optimizer state sharded."""
    from hapt_hf.core.precision import SHARDED
    from hapt_hf.planner.plan import Plan, Replica, Stage
    layers = 4 + 2  # embedding + 4 blocks + head
    tp = (Replica("cpu", "cpu", 3, (1, 2)), Replica("cpu", "cpu", 2, (3, 4)))
    plan = Plan("llama-tiny", layers, SEQ, 10, 5, 2, "1f1b", (
        Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=5),
        Stage(1, (3, layers), tp, 1, optimizer=SHARDED))).validate(world_size=5)
    return plan.save(path)


def test_run_clm_on_a_tensor_parallel_plan_trains_as_trainer_and_resumes_exactly(tmp_path):
    hapt = {"plan": _tp_plan(tmp_path / "plan.json"), "schedule": "1f1b"}
    world, per_device, steps = 5, 1, 4
    ref = _one_process("llama", str(tmp_path / "ref"), per_device * world, steps)
    got = _hapt(world, "llama", str(tmp_path / "hapt"), per_device, steps, hapt, save_steps=2)
    _assert_same_training(ref, got[0])
    assert all(g["logs"] == got[0]["logs"] for g in got)  # every rank logs the same losses
    assert [g["world"] for g in got] == [(5, r, r == 0) for r in range(5)]
    assert got[0]["eval_loss"] == pytest.approx(ref["eval_loss"], rel=RTOL, abs=ATOL)
    assert got[0]["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    ref_sd, got_sd = _load(str(tmp_path / "ref")), _load(str(tmp_path / "hapt"))
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:  # whole tensors, as one process holds them
        torch.testing.assert_close(got_sd[k], ref_sd[k], rtol=1e-4, atol=1e-5, msg=k)
    # fresh processes, a fresh output directory holding the checkpoint, as a user resumes
    shutil.copytree(tmp_path / "hapt" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _hapt(world, "llama", str(tmp_path / "resumed"), per_device, steps, hapt,
                    save_steps=2, resume=str(tmp_path / "resumed" / "checkpoint-2"))
    assert resumed[0]["logs"] == got[0]["logs"]  # bit for bit: losses and LRs
    assert resumed[0]["eval_loss"] == got[0]["eval_loss"]
    a, b = _load(str(tmp_path / "hapt")), _load(str(tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


# -- HaptAccelerator: run_clm_no_trainer's calls on the same kind of plan ------------------------

def _accelerate_tp_config(tmp: Path, kind: str, world: int):
    """4 ranks, LLaMA's 6 blocks: the embedding and 2 blocks on two replicas of one rank | 4
    blocks and the head on one replica held by ranks 2 and 3 (tensor parallel)."""
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.planner.plan import Plan, Replica, Stage

    from tests.integration.test_accelerate_clm import GA, PER_DEVICE
    from tests.integration.test_accelerate_clm import SEQ as CLM_SEQ
    g = PER_DEVICE * world * GA
    plan = Plan(f"{kind}-tiny", 8, CLM_SEQ, g, 2, g // 2, "h1f1b", (
        Stage.even(0, (0, 3), "cpu", "cpu", (0, 1), 2, micro_batch_size=2),
        Stage(1, (3, 8), (Replica("cpu", "cpu", 2, (2, 3)),), 1))).validate(world_size=world)
    return HaptConfig(plan=plan.save(tmp / "plan.json"), schedule="h1f1b", seq_len=CLM_SEQ,
                      timeout_s=60)


def clm_tp(rank: int, world: int, tmp: str, procs: int) -> dict:
    """test_accelerate_clm's run_clm_no_trainer script, its hapt runs on the plan above (its
    save_state / load_state write and read the same rank files as the Trainer's checkpoints,
    whose resume the test above checks)."""
    from tests.integration import test_accelerate_clm
    test_accelerate_clm._hapt_config = _accelerate_tp_config  # the one thing changed: the plan
    return test_accelerate_clm.clm(rank, world, tmp, "llama", procs)


def test_run_clm_no_trainer_on_a_tensor_parallel_plan_matches_one_process(tmp_path):
    from benchmarks.ranks import run_ranks
    procs = 4
    for name in ("ref", "run"):
        (tmp_path / name).mkdir()
    ref = run_ranks(clm_tp, 1, str(tmp_path / "ref"), procs, timeout_s=240)[0].value
    outs = [o.value for o in run_ranks(clm_tp, procs, str(tmp_path / "run"), procs, timeout_s=240)]
    got = outs[0]
    assert len(got["updates"]) == len(ref["updates"]) and all(o["updates"] == got["updates"] for o in outs)
    torch.testing.assert_close(torch.tensor(got["updates"]), torch.tensor(ref["updates"]),
                               rtol=RTOL, atol=ATOL)
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    assert [e for e, _ in got["eval"]] == pytest.approx([e for e, _ in ref["eval"]], rel=RTOL)
    # The weights at the usual rtol 1e-5 / atol 4e-5, but for the elements whose gradients
    # stayed at the noise level in the reference (the root of its Adam second moment under
    # eps, so every gradient under eps / sqrt(1 - beta2), 3.2e-7): at the script's lr 1e-2 a
    # few embedding elements' gradients, ~1e-10, are the residue of sums that cancel, which
    # the row-wise all-reduce adds in another order, and Adam's step g / (sqrt(v) + eps) turns
    # that residue's last bits into a step of its own. Such an element may differ by what two
    # runs of Adam can move it apart: a step is at most lr (1 - beta1) / sqrt(1 - beta2)
    # (Kingma & Ba, section 2.1), twice that summed over the run's updates. Measured: one
    # element of the 65k, 1.0e-4 on one CPU and 2.2e-4 on another, every other within
    # 1.1e-6; on the same plan without tensor parallelism every weight is within 1e-6.
    eps, (b1, b2) = ref["adam"]["eps"], ref["adam"]["betas"]
    noise_bound = 2 * ref["lr_sum"] * max(1.0, (1 - b1) / (1 - b2) ** 0.5)
    for k, v in ref["weights"].items():
        a, b = torch.from_numpy(got["weights"][k]), torch.from_numpy(v)
        outside = (a - b).abs() > ATOL + RTOL * b.abs()
        if not outside.any():
            continue
        rms = torch.from_numpy(ref["adam_rms"][k])
        assert bool((rms[outside] < eps).all()), (k, "differs where its gradient was above Adam's eps")
        assert float((a - b).abs()[outside].max()) <= noise_bound, k
    # save_pretrained(save_function=accelerator.save) wrote the gathered, whole weights
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "out")).state_dict()
    for k, v in got["weights"].items():
        assert torch.equal(loaded[k], torch.from_numpy(v)), k
