"""A portable checkpoint (model and Adam state keyed by parameter name, written with
torch.distributed.checkpoint) written on 4 ranks resumes on other plans.

LLaMA (the recipes' tiny config, three blocks: layers 0..4 with the embedding and the head) in
fp32, a linear LR schedule that moves the learning rate at every step. The run that writes it:

* plan A, 4 ranks: layers [0, 2) on ranks 0 and 1 with ``optimizer: sharded`` (each holds the
  Adam state of the parameters it owns), [2, 3) on rank 2, [3, 5) on rank 3.

After K steps every rank writes its own tensors, rank 0 the schedule's state, the optimizer's
hyperparameters and the data position; the run goes on to STEPS. Resumed in fresh processes:

* plan A again (4 ranks): bit for bit as the uninterrupted run (``torch.equal``);
* plan B, 3 ranks: [0, 3) on rank 0, [3, 5) on ranks 1 and 2 sharded (another partition of
  the Adam state among other replicas);
* plan C, 2 ranks: [0, 1) on rank 0, [1, 5) on rank 1;
* plan T, 3 ranks: [0, 2) on rank 0, [2, 5) on one tensor-parallel replica of ranks 1 and 2
  (each reads its slice of every sharded projection and of its Adam state);
* one process (the whole model on rank 0): the reference.

B, C and T give the reference's losses (rtol 1e-5) and final parameters (rtol 1e-5, atol 1e-6:
another reduction order moves a parameter by a few 1e-7 where Adam divides a tiny gradient by
its tiny norm, against ~1e-4 for a step of lost or mis-sliced Adam state); every resumed run
takes the batches from the saved position and steps with the saved schedule's LR.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan, Replica, Stage

pytestmark = pytest.mark.multiproc

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "models" / "llama-tiny" / "config.json"
SEQ, MBS, M = 8, 4, 2
G = MBS * M
STEPS, K = 5, 2
LAYERS = 5  # embedding, three blocks, head


def _stage(i: int, n: int, layers: tuple[int, int], ranks: tuple[int, ...], how: str) -> Stage:
    if how == "tp":  # one replica, its blocks' projections sharded among the ranks
        return Stage(i, layers, (Replica("cpu", "cpu", MBS, ranks),), n - i)
    kw = {"optimizer": "sharded"} if how == "sharded" else {}
    return Stage.even(i, layers, "cpu", "cpu", ranks, n - i, micro_batch_size=MBS, **kw)


PLANS = {
    "A": [((0, 2), (0, 1), "sharded"), ((2, 3), (2,), ""), ((3, 5), (3,), "")],
    "B": [((0, 3), (0,), ""), ((3, 5), (1, 2), "sharded")],
    "C": [((0, 1), (0,), ""), ((1, 5), (1,), "")],
    "T": [((0, 2), (0,), ""), ((2, 5), (1, 2), "tp")],
    "one": [((0, 5), (0,), "")],
}


def _plan(name: str) -> Plan:
    stages = tuple(_stage(i, len(PLANS[name]), *s) for i, s in enumerate(PLANS[name]))
    world = 1 + max(r for s in PLANS[name] for r in s[1])
    return Plan("llama-tiny", LAYERS, SEQ, G, MBS, M, "1f1b", stages).validate(world)


def _config():
    from transformers import LlamaConfig
    config = json.loads(CONFIG.read_text())
    config.update(num_hidden_layers=LAYERS - 2, tie_word_embeddings=False)
    return LlamaConfig.from_dict(config)


def _batches(vocab: int) -> list:
    from hapt_hf.pipeline import Batch
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, vocab, (G, SEQ), generator=g) for _ in range(STEPS)]
    return [Batch(i, i.clone(), torch.ones_like(i)) for i in ids]


def _start(plan: str):
    from transformers import get_linear_schedule_with_warmup

    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    torch.manual_seed(0)
    rt = PipelineRuntime(_plan(plan), _config(), RuntimeConfig(timeout_s=60))
    opt = rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    return rt, opt, get_linear_schedule_with_warmup(opt, 0, STEPS)


def _end(rt, opt, losses: list[float], lrs: list[float]) -> dict:
    out = {"losses": losses, "lrs": lrs, "optimizer": type(opt).__name__,
           "params": {n: _whole(p).numpy().copy() for n, p in rt.stage.named_parameters()}}
    rt.shutdown()
    return out


def _whole(p):
    from hapt_hf.pipeline.tensor_parallel import is_sharded
    return (p.full_tensor() if is_sharded(p) else p).detach()


def _train(rt, opt, sched, batches) -> tuple[list[float], list[float]]:
    losses, lrs = [], []
    for b in batches:
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(rt.train_step(b, opt, sched, max_grad_norm=1.0).loss)
    return losses, lrs


def write(rank: int, world_size: int, root: str) -> dict:
    """Plan A: K steps, the checkpoint, then on to STEPS."""
    from hapt_hf.pipeline import portable
    rt, opt, sched = _start("A")
    batches = _batches(rt.stage.config.vocab_size)
    before = _train(rt, opt, sched, batches[:K])
    ckpt = Path(root) / "ckpt"
    portable.save_portable(ckpt, rt.stage, opt)
    if rank == 0:
        torch.save({"scheduler": sched.state_dict(), "groups": portable.group_settings(opt),
                    "step": K}, Path(root) / "trainer.pt")
    losses, lrs = _train(rt, opt, sched, batches[K:])
    return {**_end(rt, opt, losses, lrs), "before": before}


def resume(rank: int, world_size: int, root: str, plan: str) -> dict:
    """Fresh processes on ``plan``: the checkpoint, then the steps from the saved position."""
    from hapt_hf.pipeline import portable
    rt, opt, sched = _start(plan)
    portable.load_portable(Path(root) / "ckpt", rt.stage, opt)
    state = torch.load(Path(root) / "trainer.pt", weights_only=False)
    sched.load_state_dict(state["scheduler"])
    portable.apply_group_settings(opt, state["groups"])
    held = len(getattr(opt, "optim", opt).state)
    losses, lrs = _train(rt, opt, sched, _batches(rt.stage.config.vocab_size)[state["step"]:])
    return {**_end(rt, opt, losses, lrs), "loaded_state": held}


def _merged(outs: list[dict]) -> dict:
    params: dict = {}
    for o in outs:
        params.update(o["params"])
    return params


def test_checkpoint_of_4_ranks_resumes_on_3_2_tensor_parallel_and_1(tmp_path):
    root = str(tmp_path)
    full = [o.value for o in run_ranks(write, 4, root, timeout_s=120)]
    assert [o["optimizer"] for o in full] == ["ShardedOptimizer"] * 2 + ["AdamW"] * 2
    runs = {p: [o.value for o in run_ranks(resume, n, root, p, timeout_s=120)]
            for p, n in (("A", 4), ("B", 3), ("C", 2), ("T", 3), ("one", 1))}
    assert [o["optimizer"] for o in runs["B"]] == ["AdamW"] + ["ShardedOptimizer"] * 2
    # the same plan: bit for bit
    for a, b in zip(full, runs["A"]):
        assert b["losses"] == a["losses"] and b["lrs"] == a["lrs"]
        for n, p in a["params"].items():
            assert torch.equal(torch.from_numpy(b["params"][n]), torch.from_numpy(p)), n
    ref = runs["one"][0]
    assert ref["loaded_state"] == len(ref["params"])  # every parameter's Adam state was read
    # the LR continues from the saved schedule: the uninterrupted run's
    assert ref["lrs"] == full[0]["lrs"]
    assert ref["lrs"][0] < full[0]["before"][1][-1]
    want = ref["params"]
    for plan in ("B", "C", "T"):
        outs = runs[plan]
        assert all(o["loaded_state"] > 0 for o in outs), plan
        for o in outs:
            assert o["lrs"] == ref["lrs"], plan
            torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(ref["losses"]),
                                       rtol=1e-5, atol=0)
        got = _merged(outs)
        assert got.keys() == want.keys(), plan
        for n, p in want.items():
            torch.testing.assert_close(torch.from_numpy(got[n]), torch.from_numpy(p),
                                       rtol=1e-5, atol=1e-6, msg=lambda m, n=n, plan=plan: f"{plan} {n}: {m}")
