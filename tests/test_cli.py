"""The ``hapt-hf`` command end to end, and the plan table it prints."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.inputs import SCENARIOS_DIR, scenario_path
from hapt_hf.cli import main
from hapt_hf.planner.plan import Plan, PlanPrediction, Stage, StagePrediction
from hapt_hf.planner.report import build_report, format_ranks, format_report, layer_names
from hapt_hf.planner.simulate import SimEvent, SimResult, simulate_plan

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = SCENARIOS_DIR

SMALL_CLUSTER = """\
name: small
groups:
  - {name: v100, gpu: V100-32, nodes: 1, gpus_per_node: 2}
  - {name: a100, gpu: A100-40, nodes: 1, gpus_per_node: 1}
links:
  - {between: [v100, a100], bandwidth_gbps: 5, latency_us: 1000}
job:
  model: {family: gpt2, hidden_size: 256, num_layers: 4, num_heads: 4, vocab_size: 1000}
  seq_len: 128
  global_batch_size: 16
  dtype: fp32
"""


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _run_captured(argv) -> tuple[int, str, str]:
    """As _run, for module-scoped fixtures, which cannot use capsys."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# -- plan ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planned:
    """One `hapt-hf plan` run on the small cluster, shared by the tests that read its outputs
    (planning takes seconds; the tests copy what they edit)."""
    cluster: Path
    plan_json: Path
    png: Path
    code: int
    out: str
    err: str


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Planned:
    d = tmp_path_factory.mktemp("planned")
    cluster = _write(d, SMALL_CLUSTER)
    plan_json, png = d / "out" / "plan.json", d / "plan.png"
    # every group: the tests below edit and replay a plan on all three GPUs
    code, out, err = _run_captured(["plan", "--cluster", cluster, "--schedule", "1f1b",
                                    "--all-groups", "-o", plan_json, "--timeline", png])
    return Planned(cluster, plan_json, png, code, out, err)


def test_plan_writes_a_plan_that_reloads_and_a_timeline(planned):
    assert planned.code == 0, planned.err
    plan = Plan.load(planned.plan_json).validate(world_size=3)
    # 4 blocks with the embedding and the head, in the unit the planner chose
    assert plan.num_layers == (2 * 4 + 2 if plan.layer_unit == "half" else 4 + 2)
    assert plan.seq_len == 128 and plan.global_batch_size == 16
    assert plan.schedule == "1f1b"
    png = planned.png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    lines = planned.out.splitlines()
    for s in plan.stages:  # one table row per stage, starting with its index and group
        assert any(line.split()[:2] == [str(s.index), s.group] for line in lines)
    assert "iteration time" in planned.out and "tokens/s" in planned.out
    assert "physical limit" in planned.out and "speed-up" in planned.out


def test_plan_flags_override_the_job_section(tmp_path, capsys):
    cluster = _write(tmp_path, SMALL_CLUSTER)
    code, out, err = _run(["plan", "--cluster", cluster, "--global-batch", "8", "--seq-len",
                           "64", "--micro-batch", "2", "--schedule", "1f1b", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)  # --json prints JSON only
    assert data["plan"]["global_batch_size"] == 8 and data["plan"]["seq_len"] == 64
    assert data["plan"]["micro_batch_size"] == 2 and data["plan"]["schedule"] == "1f1b"
    assert data["report"]["iteration_s"] > 0
    assert len(data["report"]["stages"]) == len(data["plan"]["stages"])


def test_plan_without_cluster_uses_the_builtin_demo(capsys):
    code, out, err = _run(["plan"], capsys)
    assert code == 0, err
    assert "built-in v100x8_a100x4" in out and "gpt2" in out
    assert "stage" in out and "iteration time" in out


@pytest.mark.parametrize("scenario", ["harp_v100x2_a100x1", "sailor_a100x8_v100x8_opt350"])
def test_plan_on_scenarios(scenario, tmp_path, capsys):
    path = scenario_path(scenario)
    out_json = tmp_path / "plan.json"
    code, out, err = _run(["plan", "--cluster", path, "-o", out_json, "--timeline",
                           tmp_path / "t.png"], capsys)
    assert code == 0, err
    plan = Plan.load(out_json).validate()
    assert plan.stages and (tmp_path / "t.png").stat().st_size > 5_000
    assert all(f"[{s.layers[0]},{s.layers[1]})" in out for s in plan.stages)


# -- simulate -----------------------------------------------------------------------------------

def _planned_copy(planned: Planned, tmp_path: Path) -> tuple[Path, Path]:
    assert planned.code == 0, planned.err
    copy = tmp_path / "plan.json"
    copy.write_text(planned.plan_json.read_text())
    return planned.cluster, copy


def test_simulate_replays_a_hand_edited_plan(planned, tmp_path, capsys):
    cluster, plan_path = _planned_copy(planned, tmp_path)
    d = json.loads(plan_path.read_text())
    # put everything on one stage of one V100 replica: an edit a person could make by hand
    d["stages"] = [{"index": 0, "layers": [0, d["model"]["num_layers"]], "group": "v100",
                    "device_type": "V100-32", "ranks": [0], "warmup": 1}]
    d["micro_batch_size"], d["num_microbatches"] = 4, 4
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    png = tmp_path / "edited.png"
    code, out, err = _run(["simulate", edited, "--cluster", cluster, "--timeline", png, "--json"],
                          capsys)
    assert code == 0, err
    rep = json.loads(out)["report"]
    assert [r["layers"] for r in rep["stages"]] == [[0, d["model"]["num_layers"]]]
    assert rep["stages"][0]["fits"] and rep["feasible"]
    # the figures are the simulator's on the edited plan, not the planner's old predictions
    from hapt_hf.cli import resolve_job
    job = resolve_job(str(cluster))
    plan = Plan.load(edited)
    sim = simulate_plan(plan, job.model.with_layer_unit(plan.layer_unit), job.cluster,
                        job.profile)
    assert rep["iteration_s"] == pytest.approx(sim.iteration_s)
    assert png.stat().st_size > 5_000


def test_simulate_replays_a_plan_that_cuts_inside_blocks(planned, tmp_path, capsys):
    from hapt_hf.cli import resolve_job
    from hapt_hf.planner.search import PlannerOptions, plan_job
    job = resolve_job(str(planned.cluster))
    plan = plan_job(job.model, job.cluster, 16, options=PlannerOptions(layer_unit="half")).plan
    assert plan.layer_unit == "half" and plan.num_layers == 2 * 4 + 2
    path = plan.save(tmp_path / "half.json")
    code, out, err = _run(["simulate", path, "--cluster", planned.cluster, "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)["report"]
    assert [r["layers"] for r in rep["stages"]] == [list(s.layers) for s in plan.stages]
    assert rep["iteration_s"] == pytest.approx(plan.predicted.iteration_s, rel=1e-6)


def test_half_block_ranges_are_named_by_half():
    # 3 blocks cut in halves: [emb, b0.attn, b0.mlp, b1.attn, b1.mlp, b2.attn, b2.mlp, head]
    assert layer_names((0, 2), 8, "half") == "emb,b0.attn"
    assert layer_names((2, 5), 8, "half") == "b0.mlp-b1"
    assert layer_names((3, 5), 8, "half") == "b1"
    assert layer_names((6, 8), 8, "half") == "b2.mlp,head"
    assert layer_names((0, 8), 8, "half") == "emb,b0-b2,head"


def test_simulate_reports_a_plan_that_does_not_fit(tmp_path, capsys):
    tiny_gpu = SMALL_CLUSTER.replace("gpu: A100-40,", "gpu: A100-40, memory_gb: 0.01,")
    cluster = _write(tmp_path, tiny_gpu)
    # named as `hapt-hf plan` names the cluster file's job.model mapping
    plan = Plan("gpt2-h256", 6, 128, 4, 4, 1, "1f1b", (
        Stage.even(0, (0, 3), "v100", "V100-32", (0, 1), 2, micro_batch_size=4),
        Stage.even(1, (3, 6), "a100", "A100-40", (2,), 1, micro_batch_size=4)))
    path = plan.save(tmp_path / "p.json")
    code, out, err = _run(["simulate", path, "--cluster", cluster], capsys)
    assert code == 1, err
    assert "DOES NOT FIT" in out and "stage 1" in out


def _planned_without_job(tmp_path: Path, capsys) -> tuple[Path, Path]:
    """A plan for the built-in gpt2-tiny, and a cluster file with no job section."""
    cluster = _write(tmp_path, SMALL_CLUSTER.split("job:")[0])
    plan_path = tmp_path / "plan.json"
    code, _, err = _run(["plan", "--cluster", cluster, "--model", "gpt2-tiny", "--seq-len", "64",
                         "--global-batch", "8", "--schedule", "1f1b", "-o", plan_path], capsys)
    assert code == 0, err
    return cluster, plan_path


def test_simulate_reads_the_model_from_the_plan(tmp_path, capsys):
    cluster, plan_path = _planned_without_job(tmp_path, capsys)
    assert Plan.load(plan_path).model_name == "gpt2-tiny"
    code, out, err = _run(["simulate", plan_path, "--cluster", cluster, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["report"]["iteration_s"] > 0
    # naming the same model again is fine
    code, _, err = _run(["simulate", plan_path, "--cluster", cluster, "--model", "gpt2-tiny"],
                        capsys)
    assert code == 0, err


def test_simulate_refuses_a_model_other_than_the_plans(tmp_path, capsys):
    cluster, plan_path = _planned_without_job(tmp_path, capsys)
    code, out, err = _run(["simulate", plan_path, "--cluster", cluster, "--model", "llama-tiny"],
                          capsys)
    _assert_user_error(code, out, err, "--model 'llama-tiny'")
    assert "'gpt2-tiny'" in err and out == ""


# -- user errors: exit 2, one line naming the field, nothing written --------------------------

_BAD_CLUSTERS = {
    "unknown_gpu": (SMALL_CLUSTER.replace("gpu: V100-32", "gpu: Z9000"), "'v100'.gpu"),
    "group_without_link": (SMALL_CLUSTER.replace(
        "  - {name: a100,", "  - {name: t4, gpu: T4, nodes: 1, gpus_per_node: 1}\n"
        "  - {name: a100,"), "links"),
    "negative_bandwidth": (SMALL_CLUSTER.replace("bandwidth_gbps: 5", "bandwidth_gbps: -5"),
                           "links[0].bandwidth_gbps"),
    "fits_nowhere": (SMALL_CLUSTER.replace(
        "{family: gpt2, hidden_size: 256, num_layers: 4, num_heads: 4, vocab_size: 1000}",
        "{family: llama, hidden_size: 8192, intermediate_size: 28672, num_layers: 80, "
        "num_heads: 64, num_kv_heads: 8, vocab_size: 128256}"), "GB usable on the largest GPU"),
}


def test_plan_that_fits_nowhere_names_a_remedy_that_plans(tmp_path, capsys):
    tiny = SMALL_CLUSTER.replace("gpu: A100-40,", "gpu: A100-40, memory_gb: 0.02,").replace(
        "gpu: V100-32,", "gpu: V100-32, memory_gb: 0.02,")
    code, out, err = _run(["plan", "--cluster", _write(tmp_path, tiny)], capsys)
    _assert_user_error(code, out, err, "GB usable on the largest GPU")
    # of the two alike-sized groups the first by name is named; it grows
    more = int(re.search(r"(\d+) more A100-40 GPU", err).group(1))
    grown = tiny.replace("gpus_per_node: 1}", f"gpus_per_node: {1 + more}}}")
    code, out, err = _run(["plan", "--cluster", _write(tmp_path, grown, "grown.yaml")], capsys)
    assert code == 0, err


SHARDING_CLUSTER = """\
name: shard
groups:
  - {name: v100, gpu: V100-32, memory_gb: 0.015, nodes: 1, gpus_per_node: 8}
job:
  model: {family: gpt2, hidden_size: 256, num_layers: 2, num_heads: 4, vocab_size: 1000}
  seq_len: 64
  global_batch_size: 8
  dtype: fp32
"""


def test_plan_says_which_stages_shard_and_the_flag_forbids_it(tmp_path, capsys):
    cluster = _write(tmp_path, SHARDING_CLUSTER)
    code, out, err = _run(["plan", "--cluster", cluster, "-o", tmp_path / "p.json"], capsys)
    assert code == 0, err
    sharded = [s for s in Plan.load(tmp_path / "p.json").stages if s.optimizer == "sharded"]
    assert sharded and "optimizer" in out
    assert f"sharded state    stage {sharded[0].index} over {sharded[0].width} replicas: " in out
    code, out, err = _run(["plan", "--cluster", cluster, "--no-sharded-optimizer", "--json"],
                          capsys)
    assert code == 0, err
    assert all(s.get("optimizer", "replicated") == "replicated"
               for s in json.loads(out)["plan"]["stages"])


def test_the_mixed_stages_flag_reaches_the_planner(tmp_path, capsys, monkeypatch):
    import hapt_hf.planner.search as search
    seen = []
    real = search.plan_job

    def spy(*args, options, **kw):
        seen.append(options.allow_mixed_stages)
        return real(*args, options=options, **kw)

    monkeypatch.setattr(search, "plan_job", spy)
    cluster = _write(tmp_path, SHARDING_CLUSTER)
    for flags in ([], ["--no-mixed-stages"]):
        code, out, err = _run(["plan", "--cluster", cluster, "--json", *flags], capsys)
        assert code == 0, err
    assert seen == [True, False]


def _assert_user_error(code, out, err, field):
    assert code == 2
    assert err.startswith("hapt-hf: error: ") and "Traceback" not in err
    assert field.lower() in err.lower(), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", sorted(_BAD_CLUSTERS))
def test_bad_cluster_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    text, field = _BAD_CLUSTERS[case]
    cluster = _write(tmp_path, text)
    outputs = [tmp_path / "plan.json", tmp_path / "plan.png"]
    code, out, err = _run(["plan", "--cluster", cluster, "-o", outputs[0], "--timeline",
                           outputs[1]], capsys)
    _assert_user_error(code, out, err, field)
    assert not any(p.exists() for p in outputs)


def _stop_short(d):
    d["stages"][-1]["layers"][1] -= 1  # the last stage stops short of the head


def _wrong_device(d):
    for r in d["stages"][0]["replicas"]:
        r["device_type"] = "T4"  # the stage's group has no T4


def _unknown_group(d):
    for r in d["stages"][0]["replicas"]:
        r["group"] = "h100"


@pytest.mark.parametrize("edit,field", [(_stop_short, "layers"), (_wrong_device, "device_type"),
                                        (_unknown_group, "'h100'")])
def test_malformed_plan_is_one_line(edit, field, planned, tmp_path, capsys):
    cluster, plan_path = _planned_copy(planned, tmp_path)
    d = json.loads(plan_path.read_text())
    edit(d)
    plan_path.write_text(json.dumps(d))
    png = tmp_path / "t.png"
    code, out, err = _run(["simulate", plan_path, "--cluster", cluster, "--timeline", png],
                          capsys)
    _assert_user_error(code, out, err, field)
    assert not png.exists() and out == ""


@pytest.mark.parametrize("argv,field", [
    (["plan", "--cluster", "no_such_builtin"], "built-in"),
    (["plan", "--cluster", "missing/cluster.yaml"], "does not exist"),
    (["simulate", "missing.json", "--cluster", "v100x8_a100x4"], "does not exist"),
    (["plan", "--cluster", "v100x8_a100x4", "--seq-len", "0"], "--seq-len"),
    (["plan", "--cluster", "v100x8_a100x4", "--micro-batch", "0"], "--micro-batch"),
])
def test_missing_inputs_are_one_line(argv, field, capsys):
    _assert_user_error(*_run(argv, capsys), field)


def test_a_job_field_neither_the_file_nor_a_flag_gives_names_both(tmp_path, capsys):
    cluster = tmp_path / "no_seq.yaml"
    cluster.write_text(SMALL_CLUSTER.replace("  seq_len: 128\n", ""))
    code, out, err = _run(["plan", "--cluster", cluster], capsys)
    _assert_user_error(code, out, err, "pass --seq-len N or set job.seq_len")
    code, out, err = _run(["plan", "--cluster", cluster, "--seq-len", "64"], capsys)
    assert code == 0, err


@pytest.mark.e2e
def test_console_entry_in_a_fresh_process(tmp_path):
    cluster = _write(tmp_path, _BAD_CLUSTERS["negative_bandwidth"][0])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "hapt_hf.cli", "plan", "--cluster", str(cluster)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("hapt-hf: error:") and "bandwidth_gbps" in res.stderr


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("plan", "simulate", "profile"))


def test_profile_forwards_its_arguments(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("hapt_hf.profiling.cli")
    fake.cli_main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "hapt_hf.profiling.cli", fake)
    assert main(["profile", "--device", "cpu", "--help-me"]) == 0
    assert seen == [["--device", "cpu", "--help-me"]]


def test_profile_without_the_profiler_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hapt_hf.profiling.cli", None)  # import fails
    code, out, err = _run(["profile"], capsys)
    assert code == 2 and "profiler is not installed" in err


# -- the table ----------------------------------------------------------------------------------

def test_rank_and_layer_wording():
    assert format_ranks((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    assert layer_names((0, 5), 14) == "emb,b0-b3"
    assert layer_names((5, 14), 14) == "b4-b11,head"
    assert layer_names((13, 14), 14) == "head"
    assert layer_names((0, 1), 14) == "emb"
    assert layer_names((3, 4), 14) == "b2"


class _Baseline(types.SimpleNamespace):
    pass


def test_report_uses_the_simulated_figures_and_baselines():
    plan = Plan("gpt2", 14, 1024, 8, 2, 4, "h1f1b", (
        Stage.even(0, (0, 5), "v100", "V100-32", (0, 1), 3, micro_batch_size=2,
                   predicted=StagePrediction(9, 9, 9)),
        Stage.even(1, (5, 14), "a100", "A100-40", (2, 3), 1, micro_batch_size=2)),
        predicted=PlanPrediction(9.0, 9.0, 0.9))
    ev = (SimEvent(0, "F", 0, 0.0, 0.010), SimEvent(0, "F", 1, 0.010, 0.030),
          SimEvent(0, "B", 0, 0.05, 0.09), SimEvent(1, "F", 0, 0.03, 0.04),
          SimEvent(1, "B", 0, 0.04, 0.05))
    sim = SimResult(0.5, 0.25, (0.1, 0.1), (30e9, 45e9), ev, feasible=False,
                    reason="stage 1 needs 45.00 GB per GPU but 36.00 GB are usable")
    base = {"uniform": _Baseline(plan=plan, sim=SimResult(1.0, 0.1, (), (), (), True), reason=""),
            "speed": _Baseline(plan=None, sim=None, reason="stage 0 does not fit")}
    rep = build_report(plan, sim, capacity_gb={"v100": 32.0, "a100": 40.0},
                       physical_limit_s=0.4, baselines=base)
    s0, s1 = rep.stages
    assert s0.forward_ms == pytest.approx(15.0) and s0.backward_ms == pytest.approx(40.0)
    assert s0.peak_memory_gb == pytest.approx(30.0) and s0.fits and not s1.fits
    assert rep.tokens_per_s == pytest.approx(8 * 1024 / 0.5)
    assert rep.limit_distance == pytest.approx(0.25)
    assert rep.baselines[0].speedup == pytest.approx(2.0)
    assert rep.baselines[1].iteration_s is None
    text = format_report(rep)
    assert "45.0 / 40 OVER" in text and "DOES NOT FIT: stage 1 needs 45.00 GB" in text
    assert "2.00x" in text and "infeasible: stage 0 does not fit" in text
    assert "25.0% above it" in text and "2 (0-1)" in text and "emb,b0-b3" in text


# -- the benchmark's report into docs/benchmarks.md ---------------------------------------------

def test_benchmark_rewrites_only_its_own_section(tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_planner",
                                                  REPO / "benchmarks" / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_planner", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Runtime\n\nkeep me\n\n## Planner\n\nold figures\n\n"
                   "## Race\n\nkeep me too\n")
    bench.update_doc(doc, "## Planner\n\nnew figures\n")
    text = doc.read_text()
    assert "old figures" not in text and "new figures" in text
    assert text.index("## Runtime") < text.index("## Planner") < text.index("## Race")
    assert text.count("keep me") == 2
    fresh = tmp_path / "new.md"
    bench.update_doc(fresh, "## Planner\n\nx\n")
    assert fresh.read_text() == "# Benchmarks\n\n## Planner\n\nx\n"


def _store(path: Path, fast_s: float, slow_s: float) -> Path:
    """A profile store as `hapt-hf profile` writes it, for the cpu_demo_4 job's layers."""
    from hapt_hf.planner.cluster import Cluster
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.profile import LayerTiming, Profile, ProfileKey
    job = Cluster.load("cpu_demo_4").job
    spec = ModelSpec.from_job_model(job.model, job.seq_len, job.dtype)
    timings = {}
    for device, t in (("cpu-fast", fast_s), ("cpu-slow", slow_s)):
        for layer in spec.layers:
            for mb in (1, 2, 4):
                key = ProfileKey(device, layer.signature, mb, spec.seq_len, spec.dtype)
                timings[key] = LayerTiming(t * mb, 2 * t * mb)
    Profile(timings=timings, source="test").save(path)
    return path


def _layers_per_group(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in plan.stages:
        out[s.group] = out.get(s.group, 0) + s.num_layers * s.width
    return out


def test_plan_follows_a_measured_profile_store(tmp_path, capsys):
    # The catalogue calls group "fast" 4x faster; a store that measured it 4x SLOWER must turn
    # the split around, and the plan must say so in its layer counts.
    code, _, _ = _run(["plan", "--cluster", "cpu_demo_4", "-o", str(tmp_path / "a.json")], capsys)
    assert code == 0
    store = _store(tmp_path / "store.json", fast_s=0.004, slow_s=0.001)
    code, _, _ = _run(["plan", "--cluster", "cpu_demo_4", "--profile", str(store),
                       "-o", str(tmp_path / "b.json")], capsys)
    assert code == 0
    by_catalogue = _layers_per_group(Plan.load(tmp_path / "a.json"))
    by_store = _layers_per_group(Plan.load(tmp_path / "b.json"))
    assert by_catalogue.get("fast", 0) > by_store.get("fast", 0)
    code, out, _ = _run(["simulate", str(tmp_path / "b.json"), "--cluster", "cpu_demo_4",
                         "--profile", str(store)], capsys)
    assert code == 0 and "iteration time" in out


def test_missing_profile_store_is_one_line(tmp_path, capsys):
    code, out, err = _run(["plan", "--cluster", "cpu_demo_4", "--profile",
                           str(tmp_path / "none.json"), "-o", str(tmp_path / "p.json")], capsys)
    _assert_user_error(code, out, err, "--profile")
    assert not (tmp_path / "p.json").exists()


def test_plan_a_model_type_without_a_hand_formula(tmp_path, capsys):
    # qwen3 is planned from figures read off the model (hapt_hf.profiling.model_reader)
    from benchmarks.chain_check import tiny_config
    model = tmp_path / "qwen3"
    model.mkdir()
    tiny_config("qwen3", blocks=4).to_json_file(model / "config.json")
    cluster = _write(tmp_path, SMALL_CLUSTER)
    code, out, err = _run(["plan", "--cluster", cluster, "--model", model, "--global-batch", "8",
                           "--seq-len", "64", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["model"] == {"name": str(model), "num_layers": 6}
    assert data["report"]["iteration_s"] > 0
