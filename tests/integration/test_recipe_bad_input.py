"""A recipe given bad input: one clear message, a non-zero exit, the output directory untouched.

Most cases call the recipe's main() in this process (a single-process launch, as `python
recipe.py` would be). Where ranks matter (only rank 0 speaks, every rank exits alike, a check
made after the process group is joined) main() runs on 2 ranks through run_ranks, as
`accelerate launch --num_processes 2` would start it, without paying the imports twice.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from hapt_hf.planner.plan import Plan, Stage
from benchmarks.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CLUSTER = ROOT / "hapt_hf" / "data" / "clusters" / "cpu_demo_4.yaml"
DEMO = RECIPES / "configs" / "hapt_cpu_demo.yaml"
DEMO_LLAMA = RECIPES / "configs" / "hapt_cpu_demo_llama.yaml"
SEQ = 32

pytestmark = pytest.mark.e2e  # the recipes' own entry point, as a user runs them


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err and 'File "' not in err, err
    return lines[0]


def _run(capsys, name: str, out: Path, *argv: str) -> str:
    module = _recipe(name)
    code = module.main(module.DEFAULTS, ["--output_dir", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists(), "a refused run must not write into the output directory"
    return _error_line(err)


def recipe_rank(rank: int, world_size: int, name: str, argv: list[str]) -> int:
    module = _recipe(name)
    return module.main(module.DEFAULTS, argv)


def _ranks(name: str, out: Path, *argv: str, nproc: int = 2) -> str:
    """main() on ``nproc`` ranks: each exits with 2, and rank 0 alone writes one error line."""
    outs = run_ranks(recipe_rank, nproc, name, ["--output_dir", str(out), *argv],
                     init_process_group=False, timeout_s=240, check=False)
    assert [o.value for o in outs] == [2] * nproc, [(o.error, o.stderr_tail) for o in outs]
    assert not any(line.startswith("error: ") for o in outs[1:]
                   for line in o.stderr_tail.splitlines()), outs[1].stderr_tail
    return _error_line("\n".join(o.stderr_tail for o in outs))


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, modification time and content hash."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _two_rank_hapt(tmp: Path, cut: int, name: str = "hapt.yaml") -> Path:
    """A hand-written 2-rank plan of gpt2-tiny (6 blocks = 8 layers) cut after ``cut`` layers."""
    Plan(model_name="gpt2-tiny", num_layers=8, seq_len=SEQ, global_batch_size=4,
         micro_batch_size=1, num_microbatches=4, schedule="1f1b",
         stages=(Stage.even(0, (0, cut), "a", "cpu", (0,), 2, micro_batch_size=1),
                 Stage.even(1, (cut, 8), "b", "cpu", (1,), 1, micro_batch_size=1))
         ).save(tmp / f"plan{cut}.json")
    hapt = tmp / name
    hapt.write_text(f"plan: plan{cut}.json\nschedule: 1f1b\nseq_len: {SEQ}\ntimeout_s: 30\n")
    return hapt


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "HAPT_CONFIG"):
        monkeypatch.delenv(var, raising=False)


# -- arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--lr_scheduler_type", "cosin"], ["--lr_scheduler_type", "invalid choice: 'cosin'",
                                        "'cosine'", "--help"]),
    (["--no_such_flag", "1"], ["unrecognized arguments: --no_such_flag 1"]),
    (["--max_steps", "ten"], ["--max_steps", "invalid int value: 'ten'"]),
])
def test_a_flag_argparse_refuses_is_one_line_from_rank_0(tmp_path, argv, words):
    msg = _ranks("finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO), *argv)
    assert all(w in msg for w in words), msg


def test_output_dir_is_required(capsys):
    module = _recipe("finetune_gpt2")
    assert module.main(module.DEFAULTS, ["--hapt_config", str(DEMO)]) == 2
    assert "required: --output_dir" in _error_line(capsys.readouterr().err)


def test_training_arguments_that_do_not_go_together(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--load_best_model_at_end", "--save_strategy", "epoch")
    assert "TrainingArguments refuses the flags given" in msg
    assert "--load_best_model_at_end requires the save and eval strategy to match" in msg


def test_negative_lora_rank(capsys, tmp_path):
    msg = _run(capsys, "finetune_llama", tmp_path / "out", "--hapt_config", str(DEMO_LLAMA),
               "--lora_r", "-1")
    assert "--lora_r is -1" in msg


# -- hapt config, cluster, plan ----------------------------------------------------------------
def test_missing_hapt_config(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config",
               str(tmp_path / "nope.yaml"))
    assert "does not exist" in msg and "--hapt_config" in msg


def test_malformed_hapt_config(capsys, tmp_path):
    bad = tmp_path / "hapt.yaml"
    bad.write_text(f"cluster: {CLUSTER}\nschedule: [h1f1b\n")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(bad))
    assert "not valid YAML at line" in msg


def test_binary_cluster_file(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_bytes(bytes(range(128, 256)) * 8)
    hapt = tmp_path / "hapt.yaml"
    hapt.write_text(f"cluster: cluster.yaml\nseq_len: {SEQ}\n")
    msg = _ranks("finetune_gpt2", tmp_path / "out", "--hapt_config", str(hapt))
    assert f"cluster file {cluster}" in msg and "not a text YAML file" in msg


def test_plan_and_cluster_disagree(capsys, tmp_path):
    Plan(model_name="gpt2-tiny", num_layers=8, seq_len=64, global_batch_size=2,
         micro_batch_size=1, num_microbatches=2, schedule="1f1b",
         stages=(Stage.even(0, (0, 4), "fast", "cpu", (0,), 2, micro_batch_size=1),
                 Stage.even(1, (4, 8), "slow", "cpu", (1,), 1, micro_batch_size=1))
         ).save(tmp_path / "plan.json")
    hapt = tmp_path / "hapt.yaml"
    hapt.write_text(f"cluster: {CLUSTER}\nplan: plan.json\n")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(hapt))
    assert "uses 2 ranks but the cluster" in msg and "has 4" in msg


def test_world_size_differs_from_plan(capsys, tmp_path):
    # 1 process x per-device batch 8 = the demo config's global batch of 8
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--per_device_train_batch_size", "8")
    assert "needs 4 processes but 1 were started" in msg


def test_batch_flags_disagree_with_the_hapt_config(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO))
    assert "global_batch_size is 8" in msg and "= 2 samples per step" in msg


# -- model -------------------------------------------------------------------------------------
def test_unsupported_model_family(capsys, tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path / "bert")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--model_name_or_path", str(tmp_path / "bert"))
    assert "'bert'" in msg and "gpt2, llama, mistral, qwen2" in msg


def test_llama_model_given_to_gpt2_recipe(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--model_name_or_path", str(RECIPES / "models" / "llama-tiny"))
    assert "finetune_llama.py" in msg


def test_model_directory_that_does_not_exist(capsys, tmp_path):
    missing = str(tmp_path / "models" / "gpt2-small")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--model_name_or_path", missing)
    assert f"--model_name_or_path {missing!r} does not exist" in msg and "save_pretrained" in msg


def test_hub_model_that_cannot_be_fetched(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--model_name_or_path", "no-such-org/no-such-model")
    assert "could not be fetched from the Hugging Face Hub" in msg and "save_pretrained" in msg


# -- data --------------------------------------------------------------------------------------
def test_missing_dataset_column(capsys, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"content": "a b c d e f g " * 20})
                              for _ in range(10)))
    msg = _run(capsys, "finetune_llama", tmp_path / "out", "--hapt_config", str(DEMO_LLAMA),
               "--train_file", str(data))
    assert "no column 'text'" in msg and "['content']" in msg and "--text_column" in msg


def test_data_file_with_a_line_that_is_not_json(tmp_path):
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": "a b c d e f g " * 20})] * 5
    data.write_text("\n".join(lines[:3] + ["{'text': 'single quotes'}"] + lines[3:]) + "\n")
    msg = _ranks("finetune_llama", tmp_path / "out", "--hapt_config", str(DEMO_LLAMA),
                 "--train_file", str(data))
    assert f"--train_file {str(data)!r} cannot be read" in msg
    assert "line 4 is not JSON" in msg and "single quotes" in msg


def test_text_file_that_is_binary(capsys, tmp_path):
    data = tmp_path / "train.txt"
    data.write_bytes(b"plain text first\n" + bytes(range(128, 256)))
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--train_file", str(data))
    assert "line 2 is not UTF-8 text" in msg


# -- resuming ----------------------------------------------------------------------------------
def test_resume_from_a_missing_checkpoint(capsys, tmp_path):
    missing = str(tmp_path / "old" / "checkpoint-5")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--resume_from_checkpoint", missing)
    assert f"--resume_from_checkpoint {missing!r} is not a directory" in msg


def test_resume_last_without_a_checkpoint(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(DEMO),
               "--resume_from_checkpoint", "last")
    assert "--resume_from_checkpoint last but" in msg and "holds no checkpoint-N" in msg


def test_resume_under_another_plan_leaves_no_output_directory(tmp_path):
    """The checkpoint exists but another plan wrote it, and it lacks the part another plan
    resumes from (``portable/``, as before that part was written): refused after the trainer
    is built (its Trainer made the output directory), and the directory this run made is gone
    again."""
    first = tmp_path / "first"
    common = ["--seq_len", str(SEQ), "--disable_tqdm"]
    outs = run_ranks(recipe_rank, 2, "finetune_gpt2",
                     ["--output_dir", str(first), "--hapt_config", str(_two_rank_hapt(tmp_path, 4)),
                      "--max_steps", "1", "--save_steps", "1", *common],
                     init_process_group=False, timeout_s=240, check=False)
    assert [o.value for o in outs] == [0, 0], [(o.error, o.stderr_tail) for o in outs]
    shutil.rmtree(first / "checkpoint-1" / "portable")
    before = _snapshot(first)
    other = str(_two_rank_hapt(tmp_path, 5, "other.yaml"))
    msg = _ranks("finetune_gpt2", tmp_path / "second", "--hapt_config", other,
                 "--resume_from_checkpoint", str(first / "checkpoint-1"), *common)
    assert "checkpoint" in msg and "plan" in msg, msg
    # resumed into the directory that holds the checkpoint: nothing in it changes
    _ranks("finetune_gpt2", first, "--hapt_config", other, "--resume_from_checkpoint", "last",
           *common)
    assert _snapshot(first) == before


# -- the handler -------------------------------------------------------------------------------
@pytest.mark.parametrize("error", ["ProfileError", "CostModelError", "CheckpointError"])
def test_every_user_error_ends_the_recipe_with_one_message(capsys, tmp_path, monkeypatch, error):
    # the handler catches the root, not a list of areas that misses the ones added later
    from hapt_hf import errors
    from hapt_hf.integration import recipe

    def refuse(args, training_args, defaults):
        raise getattr(errors, error)("a refusal naming the field and the fix")

    monkeypatch.setattr(recipe, "_run", refuse)
    module = _recipe("finetune_gpt2")
    assert module.main(module.DEFAULTS, ["--output_dir", str(tmp_path / "out")]) == 2
    assert "error: a refusal naming the field and the fix" in capsys.readouterr().err


def test_a_refused_run_removes_only_an_empty_output_directory_it_made(capsys, tmp_path,
                                                                      monkeypatch):
    from hapt_hf import errors
    from hapt_hf.integration import recipe

    def refuse_after(made: list[str]):
        def run(args, training_args, defaults):
            for rel in made:
                (Path(training_args.output_dir) / rel).mkdir(parents=True)
            raise errors.CheckpointError("refused")
        return run

    module = _recipe("finetune_gpt2")
    monkeypatch.setattr(recipe, "_run", refuse_after(["", "runs/x"]))
    assert module.main(module.DEFAULTS, ["--output_dir", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    (kept / "old").mkdir(parents=True)
    monkeypatch.setattr(recipe, "_run", refuse_after(["runs"]))
    assert module.main(module.DEFAULTS, ["--output_dir", str(kept)]) == 2
    assert (kept / "runs").is_dir() and (kept / "old").is_dir()  # it existed: left as it is


def test_a_bug_in_the_recipe_keeps_its_traceback(tmp_path, monkeypatch):
    from hapt_hf.integration import recipe

    def bug(args, training_args, defaults):
        raise KeyError("a programming error")

    monkeypatch.setattr(recipe, "_run", bug)
    module = _recipe("finetune_gpt2")
    with pytest.raises(KeyError, match="a programming error"):
        module.main(module.DEFAULTS, ["--output_dir", str(tmp_path / "out")])
