"""HaptAccelerator state any plan loads, and the from_pretrained export written by the stages.

An Accelerate loop on 4 ranks (three stages, the middle one on two replicas with its optimizer
state sharded) saves its state after 2 of 4 optimizer steps and ends with save_model. The state
is loaded on 2 ranks under another split, and on one process (one stage): the next steps'
losses, the learning rate and the final weights of the two equal each other and the 4-rank
run's (fp32, rtol 1e-5), the data order continuing from the saved position and the LR schedule
(built per process, as Accelerate asks) from the saved step. save_state and save_model run with
every gather disabled: each stage writes its own shard file, which holds only that stage's
tensors, and from_pretrained of the export equals the 4-rank model.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.ranks import run_ranks
from hapt_hf.planner.plan import Plan, Stage
from tests.integration.test_accelerate_plugin import GA, G, SEQ, _config, _np, _plan_file, _Rows

RTOL, ATOL = 1e-5, 4e-5
STEPS, SAVE_AT = 4, 2


def _hapt_config(tmp: Path, world: int, dtype: str = "fp32"):
    from hapt_hf.integration.config import HaptConfig

    if world == 2 or dtype != "fp32":  # 2: another split than the 4-rank plan's
        stages = ((Stage.even(0, (0, 2), "cpu", "cpu", (0,), 2, micro_batch_size=2),
                   Stage.even(1, (2, 6), "cpu", "cpu", (1,), 1, micro_batch_size=2)) if world == 2
                  else (Stage.even(0, (0, 6), "cpu", "cpu", (0,), 1, micro_batch_size=2),))
        plan = Plan("tiny-gpt2", 6, SEQ, G, 2, G // 2, "h1f1b", stages, dtype=dtype,
                    loss_scaling="dynamic" if dtype == "fp16" else None).validate(world)
        path = plan.save(tmp / f"plan{world}_{dtype}.json")
    else:
        path = _plan_file(tmp, world, "sharded")
    return HaptConfig(plan=path, schedule="h1f1b", seq_len=SEQ, timeout_s=60)


def _no_gather(runtime):
    """Within: a gather of the model's state dict onto one rank fails."""
    from unittest import mock

    def refuse(*args, **kwargs):
        raise AssertionError("the model was gathered onto one rank")
    return mock.patch.object(runtime, "gather_state_dict", refuse)


def run(rank: int, world: int, tmp: str, resume: bool) -> dict:
    """The loop of test_accelerate_plugin on ``world`` processes: written (4 ranks: saves its
    state at step SAVE_AT and the model at the end) or resumed from that state."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator

    root = Path(tmp)
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    dl = torch.utils.data.DataLoader(_Rows(7 * G // GA), batch_size=G // GA // world, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = HaptAccelerator(cpu=True, gradient_accumulation_steps=GA,
                          hapt_plugin=_hapt_config(root / f"w{world}", world))
    scheduler = get_linear_schedule_with_warmup(optimizer, acc.num_processes,
                                                10 * acc.num_processes)
    model, optimizer, dl, scheduler = acc.prepare(model, optimizer, dl, scheduler)
    runtime = model.runtime
    model.train()
    done, losses, micro = 0, [], []
    if resume:
        acc.load_state(str(root / "state"))
        done = SAVE_AT
    for batch in dl:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            micro.append(loss.item())
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            losses.append(sum(micro) / len(micro))
            micro, done = [], done + 1
            if done == SAVE_AT and not resume:
                with _no_gather(runtime):
                    acc.save_state(str(root / "state"))
            if done == STEPS:
                break
    wrote = None
    if not resume:
        from unittest import mock

        from hapt_hf.integration import model_export
        real, wrote = model_export.write_stage_shards, []

        def recorded(*args):
            wrote.extend(real(*args))
            return wrote
        with _no_gather(runtime), mock.patch.object(model_export, "write_stage_shards", recorded):
            acc.save_model(model, str(root / "model"))
    out = {"losses": losses, "lr": scheduler.get_last_lr(), "wrote": wrote,
           "optimizer": type(optimizer.optimizer).__name__,
           "layers": list(runtime.stage.layer_range)}
    state = acc.get_state_dict(model)  # the test's own look at the whole model
    if acc.is_main_process:
        out["weights"] = {k: _np(v) for k, v in state.items()}
    return out


@pytest.mark.multiproc
def test_state_saved_on_4_ranks_loads_on_2_and_on_1_and_the_export_is_written_by_stages(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    written = [o.value for o in run_ranks(run, 4, str(tmp_path), False, timeout_s=240)]
    assert [o["optimizer"] for o in written] == ["AdamW", "ShardedOptimizer",
                                                 "ShardedOptimizer", "AdamW"]
    on_two = [o.value for o in run_ranks(run, 2, str(tmp_path), True, timeout_s=240)]
    on_one = run_ranks(run, 1, str(tmp_path), True, timeout_s=240)[0].value
    assert len(on_one["losses"]) == STEPS - SAVE_AT
    for got in (on_two[0], written[0]):
        torch.testing.assert_close(torch.tensor(got["losses"][-(STEPS - SAVE_AT):]),
                                   torch.tensor(on_one["losses"]), rtol=RTOL, atol=ATOL)
        assert got["lr"] == pytest.approx(on_one["lr"], rel=1e-12)
        assert got["weights"].keys() == on_one["weights"].keys()
        for k, v in on_one["weights"].items():
            torch.testing.assert_close(torch.from_numpy(got["weights"][k]), torch.from_numpy(v),
                                       rtol=RTOL, atol=ATOL, msg=k)
    # the export: one file per stage, written by it, holding its own tensors only
    model_dir = tmp_path / "model"
    whole = set(written[0]["weights"]) - {"lm_head.weight"}  # tied: stored once
    files = sorted(model_dir.glob("model-*-of-00003.safetensors"))
    assert [f.name for f in files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    held = []
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            held.append(set(h.keys()))
    assert set().union(*held) == whole and sum(map(len, held)) == len(whole)
    assert all(h < whole for h in held)  # no file held the whole model
    # what each rank wrote: its stage's tensors (the second replica of stage 1 nothing)
    assert [set(o["wrote"]) for o in written] == [held[0], held[1], set(), held[2]]
    assert "transformer.h.2.mlp.c_fc.weight" in held[1]  # the middle stage's block
    loaded = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    for k, v in written[0]["weights"].items():
        assert torch.equal(loaded[k], torch.from_numpy(v)), k



def small_run(rank: int, world: int, tmp: str, resume: bool, kind: str) -> dict:
    """A loop (GA 1) of a PEFT LoRA model (``kind`` "lora") or in fp16 with dynamic loss
    scaling ("fp16"): on 2 ranks, 3 steps, its state saved after the first; on one process,
    that state loaded and the last 2 steps run."""
    from accelerate.utils import set_seed
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig

    root = Path(tmp)
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    if kind == "lora":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0,
                                                 fan_in_fan_out=True))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    dl = torch.utils.data.DataLoader(_Rows(3 * G), batch_size=G // world, shuffle=True)
    plan = _hapt_config(root / f"w{world}", world, "fp16" if kind == "fp16" else "fp32").plan
    acc = HaptAccelerator(cpu=True, mixed_precision="fp16" if kind == "fp16" else "no",
                          hapt_plugin=HaptConfig(plan=plan, seq_len=SEQ, timeout_s=60))
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scaler = model.runtime.loss_scaler
    model.train()
    scales = []
    if resume:
        acc.load_state(str(root / f"{kind}_state"))
        scales.append(scaler.state_dict() if scaler else None)
    losses = []
    for batch in dl:
        loss = model(**batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == 1 and not resume:
            acc.save_state(str(root / f"{kind}_state"))
            scales.append(scaler.state_dict() if scaler else None)
    state = acc.get_state_dict(model)
    return {"losses": losses, "weights": {k: _np(v) for k, v in state.items()}, "scales": scales}


@pytest.mark.multiproc
def test_lora_state_saved_on_2_ranks_loads_on_one_process(tmp_path):
    written = run_ranks(small_run, 2, str(tmp_path), False, "lora", timeout_s=240)[0].value
    on_one = run_ranks(small_run, 1, str(tmp_path), True, "lora", timeout_s=240)[0].value
    assert len(written["losses"]) == 3 and len(on_one["losses"]) == 2
    torch.testing.assert_close(torch.tensor(on_one["losses"]), torch.tensor(written["losses"][1:]),
                               rtol=RTOL, atol=ATOL)
    lora = [k for k in written["weights"] if "lora_B" in k]
    assert len(lora) == 4  # every block's adapter, trained (lora_B starts at zero)
    assert all(abs(written["weights"][k]).max() > 0 for k in lora)
    assert on_one["weights"].keys() == written["weights"].keys()
    for k, v in written["weights"].items():
        torch.testing.assert_close(torch.from_numpy(on_one["weights"][k]), torch.from_numpy(v),
                                   rtol=RTOL, atol=ATOL, msg=k)

# -- the counters moved into another run's units, and what is refused (no ranks) ---------------

def _shape(procs: int, rows: int = 4, ga: int = GA, per_process: bool = True):
    from hapt_hf.integration.accelerate_checkpoint import RunShape
    return RunShape(procs, per_process, ga, (rows,))


def _linear(procs: int, steps: int):
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    sched = get_linear_schedule_with_warmup(opt, 2 * procs, 10 * procs)  # as Accelerate asks
    for _ in range(steps * procs):  # AcceleratedScheduler: one step per process per update
        opt.step()
        sched.step()
    return sched


def test_the_scheduler_count_moves_to_another_number_of_processes():
    from hapt_hf.integration.accelerate_checkpoint import CheckpointError, rescaled_scheduler

    saved = _linear(4, 3).state_dict()
    moved = _linear(2, 0)
    moved.load_state_dict(rescaled_scheduler(saved, moved.state_dict(), _shape(4), _shape(2)))
    ref = _linear(2, 3)
    for _ in range(4):  # the same LR now and after each of the next updates
        assert moved.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12)
        for s in (moved, ref):
            s.optimizer.step()
            s.step(), s.step()
    assert rescaled_scheduler(saved, {}, _shape(4), _shape(4)) is saved
    assert rescaled_scheduler(saved, {}, _shape(4, per_process=False),
                              _shape(2, per_process=False)) is saved  # split_batches
    with pytest.raises(CheckpointError, match="not a whole number of optimizer steps of 5"):
        rescaled_scheduler(saved, {}, _shape(5), _shape(2))


WARM, TOTAL = 3, 10  # optimizer steps: the composite schedules' warm-up and length


def _composite(kind: str, procs: int, steps: int):
    """A warm-up + cosine schedule built for ``procs`` processes as Accelerate asks (lengths
    and milestones times ``procs``), stepped ``procs`` times after each of ``steps`` updates.
    "sequential": LinearLR then CosineAnnealingLR; "chained": the two multiplied
    (ChainedScheduler); "restarts": LinearLR then CosineAnnealingWarmRestarts; "unscaled": the
    sequential one with its milestone not times ``procs``."""
    from torch.optim import lr_scheduler as L

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    warm = L.LinearLR(opt, start_factor=0.1, total_iters=WARM * procs)
    if kind == "chained":
        sched = L.ChainedScheduler([warm, L.CosineAnnealingLR(opt, T_max=TOTAL * procs)])
    else:
        cosine = (L.CosineAnnealingWarmRestarts(opt, T_0=2 * procs) if kind == "restarts" else
                  L.CosineAnnealingLR(opt, T_max=(TOTAL - WARM) * procs))
        sched = L.SequentialLR(opt, [warm, cosine],
                               milestones=[WARM * (1 if kind == "unscaled" else procs)])
    for _ in range(steps):
        opt.step()
        for _ in range(procs):
            sched.step()
    return sched


def _moved_lrs(build, saved_on: int, resumed_on: int, at: int, updates: int):
    """A scheduler built by ``build(procs, steps)``, saved on ``saved_on`` processes after ``at``
    updates, moved onto a fresh one for ``resumed_on`` (``rescaled_scheduler``, the groups' LR
    as ``read_portable`` sets it): its LR equals an uninterrupted run's on ``resumed_on`` now and
    after each of ``updates - 1`` more updates. Returns the moved scheduler and its LRs."""
    from hapt_hf.integration.accelerate_checkpoint import rescaled_scheduler
    from hapt_hf.pipeline.portable import apply_group_settings, group_settings

    saved = build(saved_on, at)
    moved = build(resumed_on, 0)
    moved.load_state_dict(rescaled_scheduler(saved.state_dict(), moved.state_dict(),
                                             _shape(saved_on), _shape(resumed_on)))
    apply_group_settings(moved.optimizer, group_settings(saved.optimizer))
    ref = build(resumed_on, at)
    lrs = []
    for _ in range(updates):
        assert moved.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12)
        assert moved.optimizer.param_groups[0]["lr"] == pytest.approx(
            ref.optimizer.param_groups[0]["lr"], rel=1e-12)
        lrs.append(moved.optimizer.param_groups[0]["lr"])
        for s in (moved, ref):
            s.optimizer.step()
            for _ in range(resumed_on):
                s.step()
    return moved, lrs


@pytest.mark.parametrize("kind", ["sequential", "chained"])
@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (2, 4), (3, 1)])
@pytest.mark.parametrize("at", [1, 3, 5])  # in the warm-up, at its end, in the cosine
def test_a_composite_scheduler_moves_to_another_number_of_processes(kind, saved_on, resumed_on, at):
    # the same LR now and after each update to the schedule's end
    moved, lrs = _moved_lrs(lambda procs, steps: _composite(kind, procs, steps),
                            saved_on, resumed_on, at, TOTAL - at + 1)
    assert len(set(lrs)) == len(lrs)  # the schedule moves at every update (warm-up, cosine)
    state = moved.state_dict()
    assert state.get("_milestones", [WARM * resumed_on]) == [WARM * resumed_on]  # this run's
    assert state["_schedulers"][0]["total_iters"] == WARM * resumed_on


T0 = 3  # optimizer steps: the first cycle of the warm restarts' schedules


def _restarts(procs: int, steps: int, t_mult: int, warm: bool | str):
    """CosineAnnealingWarmRestarts with cycles of ``T0``, ``T0 * t_mult``, ... updates (``T_0``
    times ``procs``), after a LinearLR warm-up of ``WARM`` updates in a SequentialLR if ``warm``
    ("chained": in a ChainedScheduler, times an ExponentialLR's factor: the restarts compute
    their LR from the base LR at each step, so a chained warm-up's ramp would not carry over);
    stepped ``procs`` times after each of ``steps`` updates."""
    from torch.optim import lr_scheduler as L

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    sched = L.CosineAnnealingWarmRestarts(opt, T_0=T0 * procs, T_mult=t_mult, eta_min=1e-4)
    if warm:
        sched = L.ChainedScheduler([sched, L.ExponentialLR(opt, gamma=0.9)]) if warm == "chained" \
            else L.SequentialLR(opt, [L.LinearLR(opt, start_factor=0.1, total_iters=WARM * procs),
                                      sched], milestones=[WARM * procs])
    for _ in range(steps):
        opt.step()
        for _ in range(procs):
            sched.step()
    return sched


@pytest.mark.parametrize("t_mult", [1, 2])
@pytest.mark.parametrize("warm", [False, True, "chained"])
@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (2, 4)])
@pytest.mark.parametrize("at", [1, 3, 5, 8])  # updates: in a first cycle, at and after a restart
def test_warm_restarts_move_to_another_number_of_processes(t_mult, warm, saved_on, resumed_on, at):
    # the same LR now and after each update, across restarts after the load
    moved, lrs = _moved_lrs(lambda procs, steps: _restarts(procs, steps, t_mult, warm),
                            saved_on, resumed_on, at, 24)
    top = 1e-2 * (0.9 if warm == "chained" else 1)
    # restarted to the top twice after the load (T_mult 2: cycles of 3, 6, 12 updates)
    assert sum(lr == pytest.approx(top, rel=1e-12) for lr in lrs) >= 2
    cosine = moved.state_dict()["_schedulers"][0 if warm == "chained" else 1] if warm else moved.state_dict()
    assert (cosine["T_0"], cosine["T_mult"]) == (T0 * resumed_on, t_mult)  # this run's cycles


def test_a_composite_scheduler_that_cannot_move_is_refused_naming_the_child():
    from hapt_hf.integration.accelerate_checkpoint import CheckpointError, rescaled_scheduler

    def move(kind: str, saved_kind: str | None = None) -> None:
        rescaled_scheduler(_composite(saved_kind or kind, 4, 3).state_dict(),
                           _composite(kind, 2, 0).state_dict(), _shape(4), _shape(2))

    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2))
    with pytest.raises(CheckpointError, match=r"its state cannot be moved .*patience in steps "
                                              r"\(ReduceLROnPlateau\)"):
        rescaled_scheduler({**plateau.state_dict(), "last_epoch": 8}, plateau.state_dict(),
                           _shape(4), _shape(2))
    explicit = _restarts(4, 0, 2, warm=False)
    for epoch in range(1, 9):  # step(epoch) with fractional epochs: T_cur does not follow the count
        explicit.step(epoch + 0.5)
    with pytest.raises(CheckpointError, match=r"its state cannot be moved .*its T_cur 8.5 and T_i "
                                              r"12 are not those of step 8: stepped with an "
                                              r"explicit epoch"):
        rescaled_scheduler(explicit.state_dict(), _restarts(2, 0, 2, warm=False).state_dict(),
                           _shape(4), _shape(2))
    with pytest.raises(CheckpointError, match=r"the SequentialLR cannot be moved .*its "
                                              r"milestones \[3\] of the saved run fall at other "
                                              r"optimizer steps than this run's \[3\]"):
        move("unscaled")
    with pytest.raises(CheckpointError, match="child 1 of the SequentialLR .* another kind"):
        move("restarts", "sequential")
    with pytest.raises(CheckpointError, match="this run's scheduler is not a SequentialLR"):
        move("chained", "sequential")
    with pytest.raises(CheckpointError, match=r"SequentialLR stands at step 6, not a whole number "
                                              "of optimizer steps of 4"):
        state = _composite("sequential", 4, 3).state_dict()
        rescaled_scheduler({**state, "last_epoch": 6}, _composite("sequential", 2, 0).state_dict(),
                           _shape(4), _shape(2))
    saved = _composite("sequential", 4, 3).state_dict()
    assert rescaled_scheduler(saved, {}, _shape(4), _shape(4)) is saved


def test_loader_positions_move_by_rows_and_an_uneven_one_is_refused(tmp_path):
    from hapt_hf.integration.accelerate_checkpoint import CheckpointError, moved_loop

    loop = {"loaders": [{"epoch": 0, "position": 6, "epoch_rng": None, "finished": False}],
            "custom": [], "step": 6}
    moved = moved_loop(loop, _shape(4, rows=4), _shape(2, rows=8, ga=1), tmp_path)
    assert moved["loaders"][0]["position"] == 3 and moved["step"] == 3
    with pytest.raises(CheckpointError, match=r"handed out 24 rows \(6 micro-steps of 4\), not a "
                                              "whole number of this run's micro-steps of 16"):
        moved_loop(loop, _shape(4, rows=4), _shape(2, rows=16, ga=1), tmp_path)


def test_a_state_of_another_global_batch_is_refused_naming_it(tmp_path):
    from dataclasses import replace

    from hapt_hf.integration.accelerate_checkpoint import CheckpointError, check_state_dir

    plan = Plan.load(_plan_file(tmp_path, 4))
    for r in range(4):
        for name in (f"hapt_rank{r}.pt", f"hapt_accelerate_rank{r}.pt"):
            (tmp_path / name).write_text("")
    (tmp_path / "model.safetensors").write_text("")
    check_state_dir(tmp_path, plan)  # the same plan: fine
    other = replace(plan, global_batch_size=2 * G, num_microbatches=2 * G // 2)
    with pytest.raises(CheckpointError, match=r"global batch 8, this run's plan has 16; .*"
                                              "batch_size x num_processes"):
        check_state_dir(tmp_path, other)



@pytest.mark.multiproc
def test_fp16_state_saved_on_2_ranks_loads_on_one_process_with_its_loss_scale(tmp_path):
    """fp16 rounds at the stage boundary, so the two splits' losses agree to fp16's precision
    only (Adam's steps on near-zero gradients then move single weights apart by about the
    learning rate: the fp32 tests compare the weights); the loss scale and its growth count go
    on exactly."""
    written = run_ranks(small_run, 2, str(tmp_path), False, "fp16", timeout_s=240)[0].value
    on_one = run_ranks(small_run, 1, str(tmp_path), True, "fp16", timeout_s=240)[0].value
    assert on_one["scales"] == written["scales"] and written["scales"][0]["growth_tracker"] == 1
    torch.testing.assert_close(torch.tensor(on_one["losses"]), torch.tensor(written["losses"][1:]),
                               rtol=1e-2, atol=1e-2)
