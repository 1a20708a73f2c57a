"""A recipe given bad input: one clear message, a non-zero exit, the output directory untouched.

The recipe's main() is called in this process (a single-process launch, as `python recipe.py`
would be): every check below happens before any process group or output is needed.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CLUSTER = ROOT / "hapt_hf" / "data" / "clusters" / "cpu_demo_4.yaml"

pytestmark = pytest.mark.e2e  # the recipes' own entry point, as a user runs them


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys, name: str, out: Path, *argv: str) -> str:
    module = _recipe(name)
    code = module.main(module.DEFAULTS, ["--output_dir", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists(), "a refused run must not write into the output directory"
    lines = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "HAPT_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def test_missing_hapt_config(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config",
               str(tmp_path / "nope.yaml"))
    assert "does not exist" in msg and "--hapt_config" in msg


def test_malformed_hapt_config(capsys, tmp_path):
    bad = tmp_path / "hapt.yaml"
    bad.write_text(f"cluster: {CLUSTER}\nschedule: [h1f1b\n")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(bad))
    assert "not valid YAML at line" in msg


def test_plan_and_cluster_disagree(capsys, tmp_path):
    from hapt_hf.planner.plan import Plan, StagePlan

    Plan(model_name="gpt2-tiny", num_layers=8, seq_len=64, global_batch_size=4,
         micro_batch_size=1, num_microbatches=4, schedule="1f1b",
         stages=(StagePlan(0, (0, 4), "fast", "cpu", (0,), 2),
                 StagePlan(1, (4, 8), "slow", "cpu", (1,), 1))).save(tmp_path / "plan.json")
    hapt = tmp_path / "hapt.yaml"
    hapt.write_text(f"cluster: {CLUSTER}\nplan: plan.json\n")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(hapt))
    assert "uses 2 ranks but the cluster" in msg and "has 4" in msg


def test_world_size_differs_from_plan(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config",
               str(RECIPES / "configs" / "hapt_cpu_demo.yaml"))
    assert "needs 4 processes but 1 were started" in msg


def test_unsupported_model_family(capsys, tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path / "bert")
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config",
               str(RECIPES / "configs" / "hapt_cpu_demo.yaml"), "--model_name_or_path",
               str(tmp_path / "bert"))
    assert "'bert'" in msg and "gpt2, llama, mistral, qwen2" in msg


def test_llama_model_given_to_gpt2_recipe(capsys, tmp_path):
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config",
               str(RECIPES / "configs" / "hapt_cpu_demo.yaml"), "--model_name_or_path",
               str(RECIPES / "models" / "llama-tiny"))
    assert "finetune_llama.py" in msg


def test_missing_dataset_column(capsys, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"content": "a b c d e f g " * 20})
                              for _ in range(10)))
    msg = _run(capsys, "finetune_llama", tmp_path / "out", "--hapt_config",
               str(RECIPES / "configs" / "hapt_cpu_demo_llama.yaml"), "--train_file",
               str(data))
    assert "no column 'text'" in msg and "['content']" in msg and "--text_column" in msg


def test_validation_file_smaller_than_a_global_batch(capsys, tmp_path):
    from hapt_hf.planner.plan import Plan, StagePlan

    # a one-rank plan: the recipe runs in this process up to the eval data check
    Plan(model_name="gpt2-tiny", num_layers=8, seq_len=32, global_batch_size=4,
         micro_batch_size=1, num_microbatches=4, schedule="1f1b",
         stages=(StagePlan(0, (0, 8), "cpu", "cpu", (0,), 1),)).save(tmp_path / "plan.json")
    hapt = tmp_path / "hapt.yaml"
    hapt.write_text("plan: plan.json\nseq_len: 32\n")
    small = tmp_path / "valid.txt"
    small.write_text("the quick brown fox jumps over the lazy dog. " * 4 + "\n")  # 2 rows of 32
    msg = _run(capsys, "finetune_gpt2", tmp_path / "out", "--hapt_config", str(hapt),
               "--validation_file", str(small))
    assert "--validation_file needs at least one global batch (4 samples)" in msg


@pytest.mark.parametrize("error", ["ProfileError", "CostModelError", "CheckpointError"])
def test_every_user_error_ends_the_recipe_with_one_message(capsys, tmp_path, monkeypatch, error):
    # the handler catches the root, not a list of areas that misses the ones added later
    from hapt_hf import errors
    from hapt_hf.integration import recipe

    def refuse(args, defaults):
        raise getattr(errors, error)("a refusal naming the field and the fix")

    monkeypatch.setattr(recipe, "_run", refuse)
    module = _recipe("finetune_gpt2")
    assert module.main(module.DEFAULTS, ["--output_dir", str(tmp_path / "out")]) == 2
    assert "error: a refusal naming the field and the fix" in capsys.readouterr().err


def test_a_bug_in_the_recipe_keeps_its_traceback(tmp_path, monkeypatch):
    from hapt_hf.integration import recipe

    def bug(args, defaults):
        raise KeyError("a programming error")

    monkeypatch.setattr(recipe, "_run", bug)
    module = _recipe("finetune_gpt2")
    with pytest.raises(KeyError, match="a programming error"):
        module.main(module.DEFAULTS, ["--output_dir", str(tmp_path / "out")])
