"""A model's figures come one explicit way, and are the same whatever ran before in the process;
the attention is the model's best where none is asked for, stated in the plan's report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import hapt_hf
from benchmarks.chain_check import tiny_config
from hapt_hf.cli import main
from hapt_hf.errors import ModelSpecError, UnsupportedModel
from hapt_hf.planner.cluster import Cluster, builtin_cluster_path
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.planner.report import build_report, format_report
from hapt_hf.planner.search import plan_job
from hapt_hf.profiling.model_figures import MeasuringReader, choose_attention

ROOT = Path(__file__).resolve().parent.parent
SEQ = 32


def _qwen3():
    return transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    vocab_size=256, max_position_embeddings=128)


# Run in a fresh interpreter: the figures first, before anything else of hapt_hf ran, then
# after `hapt-hf plan`, the launch path's planning and ModelSpecs of other models.
_SAME_WHATEVER_RAN = r"""
import contextlib, io, json, sys
import transformers
import hapt_hf
from hapt_hf.errors import UnsupportedModel
from hapt_hf.planner.model_spec import ModelSpec
from hapt_hf.profiling.model_figures import MeasuringReader

cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=256, max_position_embeddings=128)

def figures():
    try:
        ModelSpec.from_config(cfg, 32)
        refusal = ""
    except UnsupportedModel as e:
        refusal = str(e)
    return (hapt_hf.model_spec(cfg, 32), ModelSpec.from_config(cfg, 32, reader=MeasuringReader()),
            refusal)

first = figures()

from hapt_hf.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main(["plan", "--cluster", "cpu_demo_4", "--model", "gpt2-tiny", "--seq-len", "32",
                 "--global-batch", "8", "--json"]) == 0
import torch.distributed
torch.distributed.broadcast_object_list = lambda objs, src: None  # one process stands for 4
from hapt_hf.integration.config import HaptConfig
from hapt_hf.integration.launch import LaunchEnv
from hapt_hf.integration.plan_resolution import resolve_plan
from hapt_hf.planner.cluster import builtin_cluster_path
from hapt_hf.planner.model_spec import model_config
with contextlib.redirect_stdout(io.StringIO()):
    resolve_plan(HaptConfig(cluster=builtin_cluster_path("cpu_demo_4"), global_batch_size=8),
                 model_config("llama-tiny"), 32, LaunchEnv(0, 4, 0, "single"))
ModelSpec.from_config("gpt2-tiny", 32)
hapt_hf.model_spec("opt-tiny", 32, "bf16", layer_unit="half")

after = figures()
print(json.dumps({"first_equal": first[0] == first[1], "after_equal": after[0] == after[1],
                  "same": first[:2] == after[:2], "refusals": [first[2], after[2]],
                  "attention": [first[0].attn_implementation, first[0].attn_reason],
                  "family": first[0].family}))
"""


@pytest.mark.e2e  # runs `hapt-hf plan`'s main in the fresh interpreter
def test_qwen3_figures_are_the_same_whatever_ran_before():
    done = subprocess.run([sys.executable, "-c", _SAME_WHATEVER_RAN], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["family"] == "qwen3" and got["first_equal"] and got["after_equal"]
    assert got["same"], "the figures changed after other hapt_hf calls"
    for refusal in got["refusals"]:  # without a reader, whatever ran before
        assert "hapt_hf.model_spec" in refusal and "'qwen3'" in refusal
    assert got["attention"] == ["sdpa", "the model's best"]


def test_from_config_without_a_reader_is_the_hand_formula_whatever_ran():
    cfg = tiny_config("llama", blocks=2)
    formula = ModelSpec.from_formula(cfg, SEQ)
    assert ModelSpec.from_config(cfg, SEQ).layers == formula.layers
    hapt_hf.model_spec(cfg, SEQ)  # reading with the reader installs nothing
    assert ModelSpec.from_config(cfg, SEQ).layers == formula.layers
    with pytest.raises(UnsupportedModel, match=r"'qwen3' has no hand formula.*hapt_hf\.model_spec"):
        ModelSpec.from_config(_qwen3(), SEQ)


def test_model_spec_takes_a_config_a_name_or_a_job_mapping():
    reader = MeasuringReader()
    by_name = hapt_hf.model_spec("gpt2-tiny", SEQ, "bf16")
    assert by_name == ModelSpec.from_name_or_path("gpt2-tiny", SEQ, "bf16", reader=reader)
    job = dict(family="llama", hidden_size=64, num_layers=2, num_heads=4, vocab_size=128)
    assert hapt_hf.model_spec(job, SEQ) == ModelSpec.from_job_dict(job, SEQ, "fp32", reader=reader)
    halves = hapt_hf.model_spec(_qwen3(), SEQ, layer_unit="half")
    assert halves == ModelSpec.from_config(_qwen3(), SEQ, reader=reader).split_blocks()
    with pytest.raises(ModelSpecError, match="layer_unit 'layers'"):
        hapt_hf.model_spec(_qwen3(), SEQ, layer_unit="layers")


def test_the_formula_families_default_to_the_attention_the_model_supports():
    """Without a reader the hand-formula families get sdpa: what the models' classes support."""
    for model_type in ("gpt2", "llama", "mistral", "qwen2", "opt"):
        cfg = tiny_config(model_type, blocks=2)
        spec = ModelSpec.from_config(cfg, SEQ)
        assert (spec.attn_implementation, spec.attn_reason) == choose_attention(cfg)
        assert choose_attention(cfg) == ("sdpa", "the model's best")
    asked = ModelSpec.from_config(tiny_config("gpt2", blocks=2), SEQ, attn_implementation="eager")
    assert (asked.attn_implementation, asked.attn_reason) == ("eager", "as asked")


@pytest.mark.parametrize("model_type", ["gemma2", "bloom"])
def test_a_model_without_sdpa_plans_with_eager(model_type):
    cfg = tiny_config(model_type, blocks=2)
    spec = hapt_hf.model_spec(cfg, SEQ)
    assert spec.attn_implementation == "eager"
    assert spec.attn_reason == f"{model_type} does not support sdpa; the model's best"
    result = plan_job(spec, Cluster.load(builtin_cluster_path("cpu_demo_4")), 8)
    assert result.plan.attn_implementation == "eager"
    text = format_report(build_report(result.plan, result.sim, attention_reason=spec.attn_reason))
    assert f"attention        eager ({model_type} does not support sdpa; the model's best)" in text
    # an explicit choice the model cannot run is an error naming it
    with pytest.raises(ModelSpecError, match=f"'sdpa': model type '{model_type}' does not support it"):
        hapt_hf.model_spec(cfg, SEQ, attn_implementation="sdpa")


def test_the_plan_command_states_the_attention_and_why(tmp_path, capsys):
    model = tmp_path / "gemma2"
    tiny_config("gemma2", blocks=2).save_pretrained(model)
    args = ["plan", "--cluster", "cpu_demo_4", "--model", str(model), "--seq-len", "32",
            "--global-batch", "8", "-o", str(tmp_path / "plan.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "attention        eager (gemma2 does not support sdpa; the model's best)" in out
    assert json.loads((tmp_path / "plan.json").read_text())["attn_implementation"] == "eager"
    assert main([*args, "--attn-implementation", "sdpa"]) == 2
    assert "'sdpa': model type 'gemma2' does not support it" in capsys.readouterr().err


def test_the_launch_path_plans_with_the_models_best_attention(monkeypatch):
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.integration.launch import LaunchEnv
    from hapt_hf.integration.plan_resolution import resolve_plan
    from hapt_hf.planner.plan import PlanError

    monkeypatch.setattr("torch.distributed.broadcast_object_list", lambda objs, src: None)
    cluster = builtin_cluster_path("cpu_demo_4")
    plan = resolve_plan(HaptConfig(cluster=cluster, global_batch_size=8),
                        tiny_config("gemma2", blocks=2), SEQ, LaunchEnv(0, 4, 0, "single"))
    assert plan.attn_implementation == "eager"
    with pytest.raises(PlanError, match="'sdpa': model type 'gemma2' does not support it"):
        resolve_plan(HaptConfig(cluster=cluster, global_batch_size=8, attn_implementation="sdpa"),
                     tiny_config("gemma2", blocks=2), SEQ, LaunchEnv(0, 4, 0, "single"))
