"""An ordinary Accelerate loop on a hapt plan (HaptAccelerator) against plain Accelerate on one
process whose batch is the global one: same losses, same weights, exact resume, a checkpoint
from_pretrained loads; every Accelerate setting honoured or refused by name. (run_clm_no_trainer's
own calls: test_accelerate_clm.py; the loaders and the scheduler against Accelerate's:
test_accelerate_semantics.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

SEQ, VOCAB, GA, G = 8, 97, 2, 8  # G: rows per optimizer step
RTOL, ATOL = 1e-5, 4e-5


def _config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def _plan_file(tmp: Path, world: int = 4, optimizer: str = "replicated") -> Path:
    """Uneven stages under H-1F1B: emb + 2 blocks | 1 block on two replicas | 1 block + head;
    ``optimizer``: how the two replicas keep their optimizer state."""
    if world == 1:
        stages = (Stage.even(0, (0, 6), "cpu", "cpu", (0,), 1, micro_batch_size=2),)
    else:
        stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=2),
                  Stage.even(1, (3, 5), "cpu", "cpu", (1, 2), 2, optimizer=optimizer,
                             micro_batch_size=2),
                  Stage.even(2, (5, 6), "cpu", "cpu", (3,), 1, micro_batch_size=2))
    plan = Plan("tiny-gpt2", 6, SEQ, G, 2, G // 2, "h1f1b", stages).validate(world_size=world)
    return plan.save(tmp / "plan.json")


def _hapt_config(tmp: Path, world: int = 4, optimizer: str = "replicated", **kw):
    from hapt_hf.integration.config import HaptConfig
    return HaptConfig(plan=_plan_file(tmp, world, optimizer), schedule="h1f1b", seq_len=SEQ,
                      timeout_s=60, **kw)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _np(t):
    return t.detach().float().numpy().copy()


def loop(rank: int, world: int, tmp: str, procs: int, steps: int, save_at: int | None = None,
         resume: str | None = None, out: str | None = None,
         optimizer_state: str = "replicated") -> dict:
    """The user's loop; only the Accelerator line and the per-process batch size differ between
    the hapt run on ``procs`` ranks and plain Accelerate on one process (world 1), whose batch
    holds every process's rows."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator

    hapt = world > 1
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    per_device = G // GA // procs * (1 if hapt else procs)
    dl = torch.utils.data.DataLoader(_Rows(7 * G // GA), batch_size=per_device, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if hapt:
        acc = HaptAccelerator(cpu=True, gradient_accumulation_steps=GA,
                              hapt_plugin=_hapt_config(Path(tmp), world, optimizer=optimizer_state))
    else:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=GA)
    scheduler = get_linear_schedule_with_warmup(optimizer, acc.num_processes,
                                                10 * acc.num_processes)
    model, optimizer, dl, scheduler = acc.prepare(model, optimizer, dl, scheduler)
    model.train()
    done = 0
    if resume:
        acc.load_state(resume)
        done = save_at
    losses, micro, norms = [], [], []
    for batch in dl:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            micro.append(loss.item())
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            losses.append(sum(micro) / len(micro))
            micro = []
            done += 1
            if done == save_at and not resume:
                acc.save_state(str(Path(tmp) / "state"))
            if done == steps:
                break
    result = {"losses": losses, "lr": scheduler.get_last_lr(), "norms": norms,
              "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__}
    state = acc.get_state_dict(model)
    if out:
        acc.unwrap_model(model).save_pretrained(out, state_dict=state,
                                                is_main_process=acc.is_main_process)
        acc.wait_for_everyone()
        model.eval()
        with torch.no_grad():
            first = next(iter(dl))
            logits = model(**first).logits  # this process's rows
        result["eval"] = (_np(first["input_ids"]), _np(logits))
    if acc.is_main_process:
        result["weights"] = {k: _np(v) for k, v in state.items()}
    return result


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """Plain Accelerate on one process, 3 steps: the reference both loops below are held to
    (it writes nothing, and the tests only read it)."""
    return run_ranks(loop, 1, str(tmp_path_factory.mktemp("ref")), 4, 3, timeout_s=240)[0].value


@pytest.mark.multiproc
def test_loop_matches_one_process_and_resumes(tmp_path, one_process):
    from transformers import AutoModelForCausalLM

    ref = one_process
    (tmp_path / "run").mkdir()
    out = tmp_path / "model"
    full = run_ranks(loop, 4, str(tmp_path / "run"), 4, 3, 2, None, str(out),
                     timeout_s=240)
    got = full[0].value
    assert len(got["losses"]) == 3 and all(o.value["losses"] == got["losses"] for o in full)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]),
                               rtol=RTOL, atol=ATOL)
    assert got["lr"] == pytest.approx(ref["lr"])
    assert set(got["weights"]) == set(ref["weights"])
    for k, v in ref["weights"].items():
        torch.testing.assert_close(torch.from_numpy(got["weights"][k]), torch.from_numpy(v),
                                   rtol=RTOL, atol=ATOL, msg=k)
    # resumed from the state saved after step 2: ends exactly where the whole run ended
    resumed = run_ranks(loop, 4, str(tmp_path / "run"), 4, 3, 2,
                        str(tmp_path / "run" / "state"), timeout_s=240)[0].value
    assert resumed["losses"] == got["losses"][2:]
    for k, v in got["weights"].items():
        assert (resumed["weights"][k] == v).all(), k
    # the saved model loads on one process and gives the pipeline's logits
    ids, logits = got["eval"]
    loaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="sdpa").eval()
    with torch.no_grad():
        mine = loaded(input_ids=torch.from_numpy(ids).long()).logits
    torch.testing.assert_close(mine, torch.from_numpy(logits), rtol=RTOL, atol=ATOL)


@pytest.mark.multiproc
def test_sharded_optimizer_loop_matches_one_process_and_resumes(tmp_path, one_process):
    """The same loop on a plan whose two-replica stage shards its optimizer state: the user's
    AdamW and the scheduler built on it drive the sharded optimizer; save_state writes each
    replica's shard and load_state takes it back exactly."""
    ref = one_process
    run = tmp_path / "run"
    run.mkdir()
    full = run_ranks(loop, 4, str(run), 4, 3, 2, None, None, "sharded", timeout_s=240)
    assert [o.value["optimizer"] for o in full] == ["AdamW", "ShardedOptimizer",
                                                    "ShardedOptimizer", "AdamW"]
    got = full[0].value
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=RTOL, atol=ATOL)
    assert got["lr"] == pytest.approx(ref["lr"])
    for k, v in ref["weights"].items():
        torch.testing.assert_close(torch.from_numpy(got["weights"][k]), torch.from_numpy(v),
                                   rtol=RTOL, atol=ATOL, msg=k)
    resumed = run_ranks(loop, 4, str(run), 4, 3, 2, str(run / "state"), None, "sharded",
                        timeout_s=240)[0].value
    assert resumed["losses"] == got["losses"][2:]
    for k, v in got["weights"].items():
        assert (resumed["weights"][k] == v).all(), k


# -- every Accelerate setting: honoured or refused by name ------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"rng_types": ["torch"]}, "rng_types"), ({"split_batches": True}, "split_batches"),
    ({"dynamo_backend": "inductor"}, "dynamo_backend"),
    ({"kwargs_handlers": [object()]}, "kwargs_handlers"),
    ({"fsdp_plugin": object()}, "fsdp_plugin"), ({"deepspeed_plugin": object()}, "deepspeed_plugin"),
    ({"megatron_lm_plugin": object()}, "megatron_lm_plugin"),
    ({"device_placement": False}, "device_placement"),
    ({"dataloader_config": "even_batches"}, "even_batches"),
    ({"dataloader_config": "use_seedable_sampler"}, "use_seedable_sampler"),
    ({"gradient_accumulation_plugin": "sync_with_dataloader"}, "sync_with_dataloader"),
    ({"project_config": "save_on_each_node"}, "save_on_each_node"),
])
def test_unhonoured_accelerator_argument_is_refused_by_name(kwargs, name):
    from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin,
                                  ProjectConfiguration)

    from hapt_hf.integration.accelerate_settings import (AccelerateSettingError,
                                                         check_accelerator_arguments)
    made = {"dataloader_config": lambda f: DataLoaderConfiguration(**{f: not getattr(
                DataLoaderConfiguration(), f)}),
            "gradient_accumulation_plugin": lambda f: GradientAccumulationPlugin(num_steps=2,
                                                                                 **{f: False}),
            "project_config": lambda f: ProjectConfiguration(**{f: True})}
    kwargs = {k: made[k](v) if k in made else v for k, v in kwargs.items()}
    with pytest.raises(AccelerateSettingError, match=name):
        check_accelerator_arguments((), kwargs)


def test_honoured_configuration_objects_pass():
    from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin,
                                  ProjectConfiguration)

    from hapt_hf.integration.accelerate_settings import check_accelerator_arguments
    check_accelerator_arguments((), {
        "project_config": ProjectConfiguration(project_dir="x", automatic_checkpoint_naming=True,
                                               total_limit=2, iteration=3),
        "dataloader_config": DataLoaderConfiguration(split_batches=True),
        "mixed_precision": "bf16", "log_with": "tensorboard", "cpu": True,
        "step_scheduler_with_optimizer": False})
    check_accelerator_arguments((), {"gradient_accumulation_plugin": GradientAccumulationPlugin(
        num_steps=4, adjust_scheduler=False, sync_each_batch=True)})


def settings(rank: int, world: int, tmp: str) -> dict:
    """Two-rank checks of what each honoured setting changes, and each refusal's message."""
    from accelerate.utils import AutocastKwargs, ProjectConfiguration
    from transformers import AutoModelForCausalLM

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator

    def attempt(fn):
        try:
            return fn()
        except ValueError as e:
            return f"error: {e}"

    def build(ga=GA, bs=2, **cfg):
        project = ProjectConfiguration(project_dir=str(Path(tmp) / "project"),
                                       automatic_checkpoint_naming=True, total_limit=2)
        acc = HaptAccelerator(cpu=True, gradient_accumulation_steps=ga, project_config=project,
                              hapt_plugin=_two_stage_config(Path(tmp), "fp32", **cfg))
        model = AutoModelForCausalLM.from_config(_config())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dl = torch.utils.data.DataLoader(_Rows(2 * G + 2), batch_size=bs)
        return acc, *acc.prepare(model, opt, dl)

    out = {}
    acc, model, opt, dl = build()
    out["len"] = len(dl), dl.batch_size, dl.total_batch_size
    rows = dl.dataset.rows
    out["rows"] = [[int((rows == r).all(1).nonzero()[0]) for r in b["input_ids"]] for b in dl]
    out["gathered"] = acc.gather(torch.tensor([rank])).tolist(), float(acc.reduce(torch.tensor(3.0)))
    batch = next(iter(dl))
    model.train()
    loss = model(**batch).loss
    out["backward_other"] = attempt(lambda: acc.backward(loss * 2))
    out["clip_subset"] = attempt(lambda: acc.clip_grad_norm_(list(model.parameters())[:1], 1.0))
    out["norm_type"] = attempt(lambda: acc.clip_grad_norm_(model.parameters(), 1.0, 1))
    acc.backward(loss)
    out["twice"] = attempt(lambda: model(**batch))
    out["foreign"] = attempt(lambda: model(input_ids=batch["input_ids"] + 1))
    out["skip"] = len(acc.skip_first_batches(dl, 1)), len(list(acc.skip_first_batches(dl, 1)))
    out["autocast_handler"] = attempt(lambda: acc.autocast(AutocastKwargs(enabled=False)))
    # evaluation over more rows than the plan's global batch: two pipeline passes, one loss
    big, small = (acc.prepare(torch.utils.data.DataLoader(_Rows(2 * G + 2), batch_size=b))
                  for b in (8, 4))
    model.eval()
    with torch.no_grad():
        whole = model(**next(iter(big)))
        halves = [float(model(**b).loss) for b, _ in zip(small, range(2))]
    out["chunks"] = float(whole.loss), sum(halves) / 2, tuple(whole.logits.shape)
    model.train()
    # automatic checkpoint naming: checkpoint_0, _1, _2 saved, total_limit=2 keeps the last two
    opt.zero_grad()
    saved = [acc.save_state() for _ in range(3)]
    kept = sorted(p.name for p in (Path(tmp) / "project" / "checkpoints").iterdir())
    acc.load_state()  # the latest
    out["naming"] = [Path(p).name for p in saved], kept, acc.save_iteration
    # accelerator.save writes on the main process; save_pretrained takes it as save_function
    acc.save({"rank": rank}, str(Path(tmp) / "saved.pt"))
    acc.wait_for_everyone()
    out["save"] = torch.load(str(Path(tmp) / "saved.pt"))
    view = acc.unwrap_model(model)
    view.save_pretrained(str(Path(tmp) / "model"), is_main_process=acc.is_main_process,
                         save_function=acc.save)
    out["save_function"] = attempt(lambda: view.save_pretrained(str(Path(tmp) / "m2"),
                                                                save_function=torch.save))
    out["ga_conflict"] = attempt(lambda: build(ga=1))
    out["config_conflict"] = attempt(lambda: build(global_batch_size=G + 2))
    return out


@pytest.mark.multiproc
def test_settings_honoured_or_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    outs = run_ranks(settings, 2, str(tmp_path), timeout_s=180)
    got = [o.value for o in outs]
    # 18 rows, 2 per process and batch: Accelerate's count (ceil(9 / 2) = 5, its last batch on
    # rank 1 padded with the first rows)
    assert [g["len"] for g in got] == [(5, 2, 4)] * 2
    assert got[0]["rows"] == [[r for r in range(k, k + 2)] for k in (0, 4, 8, 12, 16)]
    assert got[1]["rows"][:4] == [[r for r in range(k, k + 2)] for k in (2, 6, 10, 14)]
    assert got[1]["rows"][4] == [0, 1]  # BatchSamplerShard's duplicated tail
    assert got[0]["gathered"] == ([0, 1], 6.0)  # Accelerate's own gather and reduce
    g = got[0]
    assert "not the .loss" in g["backward_other"]
    assert "subset" in g["clip_subset"] and "norm_type=1" in g["norm_type"]
    assert "twice" in g["twice"] and "not the current batch" in g["foreign"]
    assert g["skip"] == (4, 4)
    assert "autocast_handler" in g["autocast_handler"]
    assert g["chunks"][0] == pytest.approx(g["chunks"][1], rel=RTOL)
    assert g["chunks"][2] == (8, SEQ, VOCAB)  # this process's rows
    assert g["naming"] == (["checkpoint_0", "checkpoint_1", "checkpoint_2"],
                           ["checkpoint_1", "checkpoint_2"], 3)
    assert [x["save"] for x in got] == [{"rank": 0}] * 2  # written by the main process only
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert "accelerator.save" in g["save_function"]
    assert "gradient_accumulation_steps=1" in g["ga_conflict"] and "runs global batches of 8" \
        in g["ga_conflict"]
    assert "global_batch_size is 10" in g["config_conflict"] and "= 8 samples" in \
        g["config_conflict"]


def precision(rank: int, world: int, tmp: str, mp: str, asked: str | None) -> str:
    """The plan's precision under Accelerator(mixed_precision=mp) and hapt precision asked."""
    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig
    from transformers import AutoModelForCausalLM

    cluster = Path(tmp) / "one.yaml"
    cluster.write_text("name: one\ngroups:\n  - {name: a, gpu: cpu-a, tflops: 0.1, memory_gb: 8,"
                       " nodes: 1, gpus_per_node: 1}\n")
    cfg = HaptConfig(cluster=cluster, global_batch_size=4 * G, seq_len=SEQ, precision=asked)
    try:
        acc = HaptAccelerator(cpu=True, mixed_precision=mp, gradient_accumulation_steps=4,
                              hapt_plugin=cfg)
        acc.prepare(AutoModelForCausalLM.from_config(_config()),
                    torch.utils.data.DataLoader(_Rows(4 * G), batch_size=G))
    except ValueError as e:
        return f"error: {e}"
    return acc.plan.dtype


@pytest.mark.multiproc
@pytest.mark.parametrize("mp, asked, expect", [
    ("bf16", None, "bf16"),  # honoured: the plan is made for it
    ("bf16", "fp32", "mixed_precision='bf16' (= bf16) but the hapt config"),
])
def test_mixed_precision_drives_the_plan(tmp_path, mp, asked, expect):
    got = run_ranks(precision, 1, str(tmp_path), mp, asked, timeout_s=120)[0].value
    assert expect in got, got


@pytest.mark.e2e
def test_example_runs_under_accelerate_launch(tmp_path):
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HAPT_CONFIG": str(root / "recipes/configs/hapt_cpu_demo.yaml"),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "recipes/configs/accelerate_cpu.yaml"), "--num_processes", "4",
           str(root / "examples/accelerate_loop.py"), "--output_dir", str(tmp_path),
           "--max_steps", "3"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=root)
    first = run.stderr.find("Traceback")  # the failing rank's own error, before torchrun's summary
    assert run.returncode == 0, run.stderr[max(first, 0):][:3000] + "\n...\n" + run.stderr[-1500:]
    assert "step 3 loss" in run.stdout and "eval loss" in run.stdout
    assert (tmp_path / "state" / "hapt_rank3.pt").is_file()
    assert list((tmp_path / "accelerate_loop").rglob("events.out.tfevents*"))
    AutoModelForCausalLM.from_pretrained(str(tmp_path))


# -- the calls a loop makes around the step, on 2 ranks against one process -----------------

class _FileTracker:
    """A GeneralTracker appending each ``log`` call, with the rank that made it, to a file."""

    @staticmethod
    def make(path: str, rank: int):
        from accelerate.tracking import GeneralTracker

        class Tracker(GeneralTracker):
            name, requires_logging_directory, main_process_only = "file", False, False

            @property
            def tracker(self):
                return path

            def store_init_configuration(self, values):
                pass

            def log(self, values, step=None, **kwargs):
                with open(path, "a") as f:
                    f.write(f"{rank} {step} {values['loss']!r}\n")
        return Tracker()


def _two_stage_config(tmp: Path, dtype: str, **kw):
    from hapt_hf.integration.config import HaptConfig
    stages = (Stage.even(0, (0, 3), "cpu", "cpu", (0,), 2, micro_batch_size=2),
              Stage.even(1, (3, 6), "cpu", "cpu", (1,), 1, micro_batch_size=2))
    plan = Plan("tiny-gpt2", 6, SEQ, G, 2, G // 2, "h1f1b", stages, dtype=dtype).validate(
        world_size=2)
    return HaptConfig(plan=plan.save(tmp / f"plan_{dtype}.json"), schedule="h1f1b", seq_len=SEQ,
                      timeout_s=60, **kw)


def _wrap(acc, model, how: str):
    """The context a loop puts around its step: each must leave the step as it is."""
    import contextlib
    return {"none": contextlib.nullcontext, "autocast": acc.autocast,
            "no_sync": lambda: acc.no_sync(model),
            "accumulate": lambda: acc.accumulate(model)}[how]()


def calls(rank: int, world: int, tmp: str, mp: str, how: str, steps: int = 2) -> dict:
    """Two optimizer steps of a loop that logs, prints, waits, saves with save_model and
    evaluates; with ``how="accumulate"`` two micro-steps of 2 rows per process each, else one
    of 4 rows (gradient_accumulation_steps=1)."""
    import contextlib
    import io
    import time

    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    from hapt_hf.integration.accelerate_plugin import HaptAccelerator

    ga = GA if how == "accumulate" else 1
    bs = G // world // ga
    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    dl = torch.utils.data.DataLoader(_Rows(steps * G), batch_size=bs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = str(Path(tmp) / "log.txt")
    acc = HaptAccelerator(cpu=True, mixed_precision=mp, gradient_accumulation_steps=ga,
                          log_with=[_FileTracker.make(log, rank)],
                          hapt_plugin=_two_stage_config(Path(tmp), MIXED[mp]))
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    acc.init_trackers("calls")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        acc.print("from the main process")
    if rank == 1:  # the other rank is late: wait_for_everyone must hold rank 0 until it is done
        time.sleep(1.0)
        (Path(tmp) / "late").write_text("done")
    acc.wait_for_everyone()
    seen_late = (Path(tmp) / "late").is_file()
    model.train()
    losses = []
    for batch in dl:
        with _wrap(acc, model, how):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            acc.log({"loss": loss.item()}, step=len(losses))
            losses.append(loss.item())
    acc.save_model(model, str(Path(tmp) / "saved"))
    state = acc.get_state_dict(model)
    model.eval()
    with torch.no_grad():
        first = next(iter(dl))
        out = model(**first)  # the loss of both processes' rows, this process's logits
    acc.end_training()  # last: it ends the process group, as with plain Accelerate
    return {"losses": losses, "printed": printed.getvalue(), "late": seen_late,
            "main": (acc.is_main_process, acc.is_local_main_process),
            "eval": (float(out.loss), _np(out.logits)),
            "weights": {k: _np(v) for k, v in state.items()}}


MIXED = {"no": "fp32", "bf16": "bf16"}


def _one_process(mp: str, eval_rows: int, steps: int = 2) -> dict:
    """The same loop as one plain process: global batches, the forward under autocast for bf16
    (fp32 weights, as Accelerate's mixed precision); eval on the first ``eval_rows`` rows."""
    import contextlib

    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    set_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = _Rows(steps * G).rows
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mp == "bf16" \
        else contextlib.nullcontext()
    losses = []
    for b in rows.split(G):
        with amp:
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    first = rows[:eval_rows]
    with torch.no_grad(), amp:
        out = model(input_ids=first, labels=first)
    return {"losses": losses, "eval": (float(out.loss), _np(out.logits)),
            "weights": {k: _np(v) for k, v in model.state_dict().items()}}


def _close(outs, ref: dict, rtol: float, atol: float) -> None:
    got = outs[0].value
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=rtol, atol=atol)
    assert got["eval"][0] == pytest.approx(ref["eval"][0], rel=rtol, abs=atol)
    mine = torch.cat([torch.from_numpy(o.value["eval"][1]) for o in outs])  # process by process
    torch.testing.assert_close(mine, torch.from_numpy(ref["eval"][1]), rtol=rtol, atol=atol)
    for k, v in got["weights"].items():
        torch.testing.assert_close(torch.from_numpy(v), torch.from_numpy(ref["weights"][k]),
                                   rtol=rtol, atol=atol, msg=k)


def _check_calls(outs, tmp: Path, steps: int = 2) -> None:
    """print, is_(local_)main_process, wait_for_everyone, log and save_model, as Accelerate."""
    from transformers import AutoModelForCausalLM

    got = outs[0].value
    assert [o.value["printed"] for o in outs] == ["from the main process\n", ""]
    assert [o.value["main"] for o in outs] == [(True, True), (False, False)]
    assert got["late"]
    lines = (tmp / "log.txt").read_text().split("\n")[:-1]  # one record per step, rank 0's
    assert lines == [f"0 {s} {loss!r}" for s, loss in enumerate(got["losses"])]
    assert outs[1].value["eval"][0] == got["eval"][0]  # the same loss on every process
    assert outs[1].value["weights"] == {}
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp / "saved")).state_dict()
    for k, v in got["weights"].items():
        assert torch.equal(loaded[k], torch.from_numpy(v)), k
    assert len(got["losses"]) == steps


def _eval_rows(how: str) -> int:
    return G // (GA if how == "accumulate" else 1)  # both processes' rows of one micro-step


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["none", "no_sync", "accumulate"])
def test_loop_calls_match_one_process(tmp_path, how):
    outs = run_ranks(calls, 2, str(tmp_path), "no", how, timeout_s=180)
    _check_calls(outs, tmp_path)
    assert outs[0].value["losses"] == outs[1].value["losses"]
    _close(outs, _one_process("no", _eval_rows(how)), RTOL, ATOL)


@pytest.mark.multiproc
def test_bf16_trains_as_one_process_under_autocast(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run_ranks(calls, 2, str(tmp_path / "a"), "bf16", "none", timeout_s=180)
    under = run_ranks(calls, 2, str(tmp_path / "b"), "bf16", "autocast", timeout_s=180)
    _check_calls(plain, tmp_path / "a")
    got = plain[0].value
    assert under[0].value["losses"] == got["losses"]  # autocast: the plan already computes bf16
    # near one process's bf16 autocast (the stage boundary adds one bf16 rounding of the
    # residual stream: a few bf16 ulps on the logits), and not fp32's numbers
    _close(plain, _one_process("bf16", _eval_rows("none")), 4e-2, 4e-2)
    assert got["losses"] != _one_process("no", _eval_rows("none"))["losses"]
