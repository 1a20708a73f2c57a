"""HaptAccelerator's prepared DataLoaders and LR schedulers against Accelerate's own.

Unit tier: the prepared loader's length, each process's batches and GradientState's
end_of_dataloader / remainder equal those of Accelerate's prepare_data_loader for the same
(dataset size, batch_size, num_processes, split_batches, drop_last), built in this process with
explicit num_processes / process_index; every process's rows of a micro-step are, in order, one
process's batch of total_batch_size rows (shuffled too).

Multiproc tier: the same loop under plain Accelerate on 2 Gloo ranks (DDP) and under
HaptAccelerator on 2 ranks: the LR after every micro-step (AcceleratedScheduler's num_processes
steps per update, OneCycleLR's total_steps guard, split_batches, step_scheduler_with_optimizer),
sync points, lengths, gather_for_metrics of each process's rows (the duplicated tail dropped),
per-update losses and final weights agree."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

SEQ, VOCAB, GA = 8, 97, 2
RTOL, ATOL = 1e-5, 4e-5


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 3) -> None:
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _prepared(dl, procs: int, p: int, split: bool):
    from hapt_hf.integration.accelerate_data import PipelineDataLoader
    return PipelineDataLoader(dl, procs, p, split)


def _walk(loader) -> list:
    """Each batch with what GradientState says while it is out."""
    from accelerate.state import GradientState

    state = GradientState()
    return [(b.tolist(), state.end_of_dataloader, state.remainder) for b in loader]


@pytest.mark.parametrize("n", [5, 8, 11, 16])
@pytest.mark.parametrize("bs, procs, split", [(1, 2, False), (2, 3, False), (3, 4, False),
                                              (2, 2, True), (4, 2, True), (6, 3, True)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_length_and_batches_are_accelerates(n, bs, procs, split, drop_last):
    from accelerate.data_loader import prepare_data_loader

    dl = torch.utils.data.DataLoader(list(range(n)), batch_size=bs, drop_last=drop_last)
    for p in range(procs):
        theirs = prepare_data_loader(dl, num_processes=procs, process_index=p, split_batches=split)
        mine = _prepared(dl, procs, p, split)
        assert len(mine) == len(theirs), (p, len(mine), len(theirs))
        assert mine.batch_size == (bs // procs if split else bs)
        assert mine.total_batch_size == theirs.total_batch_size
        assert _walk(mine) == _walk(theirs)
        assert len(mine.skipping(1)) == max(0, len(theirs) - 1)
        assert [b.tolist() for b in mine.skipping(1)] == [b for b, _, _ in _walk(theirs)][1:]


@pytest.mark.parametrize("bs, procs, split", [(2, 3, False), (4, 2, True)])
def test_every_process_rows_are_one_process_batch(bs, procs, split):
    """Shuffled: the rows of every process of micro-step t, in order, are batch t of one process
    iterating the DataLoader with total_batch_size rows from the same RNG state."""
    data = _Rows(12 * procs)
    torch.manual_seed(7)
    dl = torch.utils.data.DataLoader(data, batch_size=bs, shuffle=True)
    mine = _prepared(dl, procs, 0, split)
    got = []
    for t, _ in enumerate(mine):
        got.append(mine.rows(t).batch["input_ids"])
    torch.manual_seed(7)
    one = torch.utils.data.DataLoader(data, batch_size=mine.total_batch_size, shuffle=True)
    want = [b["input_ids"] for b in one]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


# -- the same loop under Accelerate (DDP) and HaptAccelerator, 2 ranks each -------------------

def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def _hapt_config(tmp: Path):
    from hapt_hf.integration.config import HaptConfig

    stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=2),
              Stage.even(1, (3, 6), "cpu", "cpu", (1,), 1, micro_batch_size=2))
    plan = Plan("tiny-gpt2", 6, SEQ, 8, 2, 4, "h1f1b", stages).validate(world_size=2)
    return HaptConfig(plan=plan.save(tmp / "plan.json"), schedule="h1f1b", seq_len=SEQ, timeout_s=60)


def loop(rank: int, world: int, tmp: str, hapt: bool, schedule: str, split: bool,
         with_optimizer: bool) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from hapt_hf import HaptAccelerator

    kwargs = dict(cpu=True, gradient_accumulation_steps=GA, step_scheduler_with_optimizer=with_optimizer,
                  dataloader_config=DataLoaderConfiguration(split_batches=split))
    acc = HaptAccelerator(hapt_plugin=_hapt_config(Path(tmp)), **kwargs) if hapt else Accelerator(**kwargs)
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    bs = 4 if split else 2  # 4 rows of every process per micro-step; 18 rows: 5 micro-steps
    dl = torch.utils.data.DataLoader(_Rows(18), batch_size=bs)
    eval_dl = torch.utils.data.DataLoader(_Rows(7, seed=5), batch_size=bs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if schedule == "onecycle":  # 3 updates an epoch, 2 scheduler steps each: past total_steps
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=7)
    else:
        scheduler = get_linear_schedule_with_warmup(optimizer, 2, 12)
    model, optimizer, dl, eval_dl, scheduler = acc.prepare(model, optimizer, dl, eval_dl, scheduler)
    got = {"len": (len(dl), len(eval_dl)), "micro": [], "updates": [], "gathered": []}
    window = []
    for _epoch in range(2):
        model.train()
        for batch in dl:
            with acc.accumulate(model):
                loss = model(**batch).loss
                window.append(acc.gather(loss.detach()).mean().item())
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            got["micro"].append((acc.sync_gradients, scheduler.get_last_lr()[0],
                                 scheduler.scheduler._step_count))
            if acc.sync_gradients:
                got["updates"].append(sum(window) / len(window))
                window = []
        model.eval()
        for batch in eval_dl:
            with torch.no_grad():
                model(**batch)
            got["gathered"].append(acc.gather_for_metrics(batch["input_ids"]).tolist())
    state = acc.get_state_dict(model)
    if rank == 0:
        got["weights"] = {k: v.detach().float().numpy().copy() for k, v in state.items()}
    return got


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule, split, with_optimizer", [("onecycle", False, True),
                                                             ("linear", True, True),
                                                             ("linear", False, False)])
def test_loop_equals_accelerate_on_two_processes(tmp_path, schedule, split, with_optimizer):
    ref = run_ranks(loop, 2, str(tmp_path), False, schedule, split, with_optimizer, timeout_s=180)
    got = run_ranks(loop, 2, str(tmp_path), True, schedule, split, with_optimizer, timeout_s=180)
    for mine, theirs in zip(got, ref):
        m, t = mine.value, theirs.value
        assert m["len"] == t["len"] == (5, 2)
        assert [(s, c) for s, _, c in m["micro"]] == [(s, c) for s, _, c in t["micro"]]
        assert [lr for _, lr, _ in m["micro"]] == pytest.approx([lr for _, lr, _ in t["micro"]],
                                                                rel=1e-12)
        assert m["gathered"] == t["gathered"]  # 7 rows, the duplicated tail dropped
        assert [len(g) for g in m["gathered"]] == [4, 3] * 2
        torch.testing.assert_close(torch.tensor(m["updates"]), torch.tensor(t["updates"]),
                                   rtol=RTOL, atol=ATOL)
    assert [s for s, _, _ in got[0].value["micro"]] == [False, True, False, True, True] * 2
    for k, v in ref[0].value["weights"].items():
        torch.testing.assert_close(torch.from_numpy(got[0].value["weights"][k]), torch.from_numpy(v),
                                   rtol=RTOL, atol=ATOL, msg=k)
