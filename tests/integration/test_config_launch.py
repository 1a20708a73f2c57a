"""hapt config, launch environment, plan resolution and data: no processes started."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from hapt_hf.integration import trainer_checkpoint as ckpt_io
from hapt_hf.integration.config import HaptConfigError, HaptPlugin, resolve_hapt_config_path
from hapt_hf.integration.data import (DataError, TextDataConfig, epoch_order, load_text_dataset,
                                      pack_tokens)
from hapt_hf.integration.launch import LaunchEnv, LaunchError, read_launch_env
from hapt_hf.integration.plan_resolution import check_model_family, format_plan, resolve_plan
from hapt_hf.planner.plan import Plan, PlanError, Stage

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CLUSTER = ROOT / "hapt_hf" / "data" / "clusters" / "cpu_demo_4.yaml"
GPT2 = RECIPES / "models" / "gpt2-tiny"
SINGLE = LaunchEnv(rank=0, world_size=1, local_rank=0, launcher="single")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _two_stage_plan(seq_len: int = 32, blocks: int = 6) -> Plan:
    return Plan(model_name="gpt2-tiny", num_layers=blocks + 2, seq_len=seq_len,
                global_batch_size=4, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                stages=(Stage.even(0, (0, 5), "fast", "cpu", (0,), 2, micro_batch_size=1),
                        Stage.even(1, (5, blocks + 2), "slow", "cpu", (1,), 1,
                                   micro_batch_size=1)))


# -- hapt config -------------------------------------------------------------------------------
def test_demo_configs_load_and_resolve_paths():
    for name in ("hapt_cpu_demo.yaml", "hapt_cpu_demo_llama.yaml"):
        plugin = HaptPlugin.from_yaml(RECIPES / "configs" / name)
        assert plugin.cluster is not None and plugin.cluster.resolve() == CLUSTER.resolve()
        assert plugin.plan is None and plugin.schedule == "h1f1b"
        # a schedule the config names is the one the search keeps
        assert plugin.planner.schedule == "h1f1b" and not plugin.planner.weigh_kinds


def test_a_schedule_left_out_is_the_planners_choice_and_a_named_one_is_kept():
    chosen = HaptPlugin(cluster=CLUSTER)
    assert chosen.schedule is None and chosen.planner.weigh_kinds
    named = HaptPlugin(cluster=CLUSTER, schedule="zero_bubble")
    assert named.planner.schedule == "zero_bubble" and not named.planner.weigh_kinds
    asked = HaptPlugin(cluster=CLUSTER, schedule="h1f1b", planner={"weigh_kinds": True})
    assert asked.planner.weigh_kinds


@pytest.mark.parametrize("text, field", [
    ("schedule: h1f1b\n", "'cluster'"),
    (f"cluster: {CLUSTER}\nschedule: zigzag\n", "'schedule'"),
    (f"cluster: {CLUSTER}\nglobal_batch_size: 0\n", "'global_batch_size'"),
    (f"cluster: {CLUSTER}\ndtype: fp64\n", "'dtype'"),
    (f"cluster: {CLUSTER}\nclustre: x\n", "unknown key(s) ['clustre']"),
    ("cluster: nowhere.yaml\n", "'cluster' names"),
    ("- just\n- a list\n", "YAML mapping"),
    ("cluster: [unclosed\n", "not valid YAML at line"),
])
def test_bad_hapt_config_names_the_field(tmp_path, text, field):
    path = _write(tmp_path / "hapt.yaml", text)
    with pytest.raises(HaptConfigError) as err:
        HaptPlugin.from_yaml(path)
    assert field in str(err.value)


def test_a_binary_hapt_config_is_refused_in_one_line(tmp_path):
    path = tmp_path / "hapt.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(HaptConfigError, match="is not a text file"):
        HaptPlugin.from_yaml(path)


@pytest.mark.parametrize("planner, words", [
    ("{max_stage: 4}", ["unknown option 'max_stage'", "'max_stages'", "'memory_headroom'"]),
    ("{memory_headroom: lots}", ["'planner.memory_headroom' is 'lots'", "float"]),
    ("{allow_recompute: 1}", ["'planner.allow_recompute' is 1", "bool"]),
    ("{micro_batch_sizes: [1, two]}", ["'planner.micro_batch_sizes'", "tuple[int, ...]"]),
    ("{memory_headroom: 1.5}", ["'planner': memory_headroom 1.5 must be in (0, 1]"]),
    ("{schedule: gpipe}", ["'planner' sets 'schedule'", "top level"]),
    ("[max_stages]", ["'planner' must be a mapping"]),
])
def test_bad_planner_option_is_refused_when_the_config_is_read(tmp_path, planner, words):
    # read on every rank: no rank gets as far as planning with an option it cannot use
    path = _write(tmp_path / "hapt.yaml", f"cluster: {CLUSTER}\nplanner: {planner}\n")
    with pytest.raises(HaptConfigError) as err:
        HaptPlugin.from_yaml(path)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_planner_options_are_typed_and_carry_the_schedule(tmp_path):
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.planner.search import PlannerOptions

    assert HaptPlugin is HaptConfig
    path = _write(tmp_path / "hapt.yaml", f"cluster: {CLUSTER}\nschedule: 1f1b\n"
                  "planner: {micro_batch_sizes: [1, 2], max_stages: 3}\n")
    config = HaptConfig.from_yaml(path)
    # a schedule the config names is kept: the search weighs no other kind
    assert config.planner == PlannerOptions(schedule="1f1b", micro_batch_sizes=(1, 2),
                                            max_stages=3, weigh_kinds=False)
    assert HaptConfig(cluster=CLUSTER).planner == PlannerOptions()
    made = HaptConfig(cluster=CLUSTER, schedule="gpipe", planner={"max_stages": 2})
    assert made.planner == PlannerOptions(schedule="gpipe", max_stages=2, weigh_kinds=False)


def test_user_errors_share_the_one_root():
    from hapt_hf import errors
    from hapt_hf.cli import UsageError
    from hapt_hf.integration.lora import LoraSetupError
    from hapt_hf.integration.trainer import BatchMappingError, TrainingArgsError

    assert DataError is errors.DataError and LaunchError is errors.LaunchError
    assert TrainingArgsError is errors.TrainingArgsError
    for cls in (HaptConfigError, LoraSetupError, BatchMappingError):
        assert issubclass(cls, errors.ConfigError), cls
    assert issubclass(UsageError, errors.HaptError)


def test_a_bug_while_planning_is_raised_not_reported_as_a_user_error(monkeypatch):
    import hapt_hf.planner.search as search

    def broken(*args, **kwargs):
        raise ValueError("a bug inside the planner")

    monkeypatch.setattr(search, "plan_job", broken)
    plugin = HaptPlugin.from_yaml(RECIPES / "configs" / "hapt_cpu_demo.yaml")
    with pytest.raises(ValueError, match="a bug inside the planner") as err:
        resolve_plan(plugin, AutoConfig.from_pretrained(GPT2), 64, SINGLE)
    assert not isinstance(err.value, PlanError)


def test_hapt_config_path_from_argument_then_env(monkeypatch, tmp_path):
    monkeypatch.delenv("HAPT_CONFIG", raising=False)
    with pytest.raises(HaptConfigError, match="--hapt_config"):
        resolve_hapt_config_path(None)
    monkeypatch.setenv("HAPT_CONFIG", str(tmp_path / "env.yaml"))
    assert resolve_hapt_config_path(None) == tmp_path / "env.yaml"
    assert resolve_hapt_config_path("arg.yaml") == Path("arg.yaml")
    with pytest.raises(HaptConfigError, match="does not exist"):
        HaptPlugin.from_args_or_env(None)


# -- launch environment ------------------------------------------------------------------------
def test_launch_env_from_torchrun_variables():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert env == LaunchEnv(3, 4, 3, "torchrun") and not env.is_main


def test_launch_env_from_mpirun_variables():
    env = read_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "mpirun")


def test_multi_cpu_single_process_launch_is_refused():
    # What accelerate's simple launcher gives a MULTI_CPU run without mpirun: one process,
    # MASTER_ADDR set, no RANK/WORLD_SIZE.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}
    with pytest.raises(LaunchError, match="single process.*accelerate_cpu.yaml"):
        read_launch_env(env)
    assert read_launch_env({}) == SINGLE


def test_accelerate_config_uses_the_multi_process_launcher():
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    cfg = load_config_from_file(str(RECIPES / "configs" / "accelerate_cpu.yaml"))
    # MULTI_GPU is what makes `accelerate launch` go through torchrun; use_cpu keeps it on CPUs.
    assert cfg.distributed_type == DistributedType.MULTI_GPU and cfg.use_cpu
    assert yaml.safe_load((RECIPES / "configs" / "accelerate_cpu.yaml").read_text())["use_cpu"]


# -- plans -------------------------------------------------------------------------------------
def test_rank0_plans_from_cluster_with_uneven_split():
    plugin = HaptPlugin.from_yaml(RECIPES / "configs" / "hapt_cpu_demo.yaml")
    config = AutoConfig.from_pretrained(GPT2)
    with pytest.raises(PlanError, match=r"needs 4 processes but 1 were started"):
        resolve_plan(plugin, config, 64, SINGLE)
    # The same plan, checked for the 4 ranks the cluster has.
    four = LaunchEnv(0, 4, 0, "single")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.distributed.broadcast_object_list", lambda objs, src: None)
        plan = resolve_plan(plugin, config, 64, four)
    # 6 blocks: 8 whole-block layers, or 14 with every block cut in two (the planner's choice)
    assert plan.world_size == 4 and plan.seq_len == 64
    assert plan.num_layers == {"block": 8, "half": 14}[plan.layer_unit]
    sizes = {s.num_layers for s in plan.stages}
    assert len(sizes) > 1, f"expected an uneven plan on the fast/slow cluster: {format_plan(plan)}"
    assert "stage 0: layers [0," in format_plan(plan)


def test_processes_launched_for_a_group_the_best_plan_leaves_idle_are_used(capsys):
    """At launch the processes exist: a plan that leaves a group idle runs only where exactly
    the kept groups' processes were started; otherwise every group is used, and rank 0 says
    what launching only the kept groups would give."""
    from hapt_hf.planner.cluster import Cluster
    from hapt_hf.planner.model_spec import ModelSpec
    from hapt_hf.planner.search import plan_job
    from hapt_hf.planner.model_spec import model_config
    # replicated optimizer state: sharded, the slow ranks' shorter Adam steps (1/d each) earn
    # them their place; H-1F1B only: zero_bubble's deferred weight gradients fill the slow
    # ranks' bubbles well enough to earn them their place too
    plugin = HaptPlugin(cluster=CLUSTER, global_batch_size=8,
                        planner={"allow_sharded_optimizer": False, "weigh_kinds": False})
    config = model_config("gpt2-tiny")  # 4 blocks: the three slow ranks cost more than they give
    spec = ModelSpec.from_config(config, seq_len=64, dtype="fp32", name="gpt2-tiny")
    best = plan_job(spec, Cluster.load(CLUSTER), plugin.global_batch_size,
                    options=plugin.planner).plan
    assert best.idle_groups == ("slow",) and best.world_size == 1, best.idle_groups
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.distributed.broadcast_object_list", lambda objs, src: None)
        four = resolve_plan(plugin, config, 64, LaunchEnv(0, 4, 0, "single"))
    assert four.world_size == 4 and four.idle_groups == ()
    said = capsys.readouterr().out
    assert "leaving group(s) slow idle would be faster" in said, said
    assert "launch only the 1 of group(s) fast" in said, said
    one = resolve_plan(plugin, config, 64, SINGLE)
    assert one.idle_groups == ("slow",) and one.world_size == 1
    assert "idle would be faster" not in capsys.readouterr().out


def test_plan_and_cluster_that_disagree_are_refused(tmp_path):
    plan_path = _two_stage_plan(seq_len=64).save(tmp_path / "plan.json")
    hapt = _write(tmp_path / "hapt.yaml", f"cluster: {CLUSTER}\nplan: plan.json\n")
    plugin = HaptPlugin.from_yaml(hapt)
    assert plugin.plan == plan_path
    with pytest.raises(PlanError, match=r"uses 2 ranks but the cluster .* has 4"):
        resolve_plan(plugin, AutoConfig.from_pretrained(GPT2), 64, SINGLE)


def test_a_replica_in_a_group_the_cluster_lacks_is_refused(tmp_path):
    from hapt_hf.planner.plan import Replica
    replicas = (Replica("slow", "cpu-slow", 2, (1,)), Replica("slow", "cpu-slow", 1, (2,)),
                Replica("elsewhere", "cpu-slow", 1, (3,)))  # not the stage's first replica's group
    plan = Plan(model_name="gpt2-tiny", num_layers=8, seq_len=64, global_batch_size=8,
                micro_batch_size=4, num_microbatches=2, schedule="1f1b",
                stages=(Stage.even(0, (0, 5), "fast", "cpu-fast", (0,), 2, micro_batch_size=4),
                        Stage(1, (5, 8), replicas, 1)))
    plan.save(tmp_path / "plan.json")
    plugin = HaptPlugin.from_yaml(_write(tmp_path / "hapt.yaml",
                                         f"cluster: {CLUSTER}\nplan: plan.json\n"))
    with pytest.raises(PlanError, match=r"groups \['elsewhere'\]"):
        resolve_plan(plugin, AutoConfig.from_pretrained(GPT2), 64, SINGLE)


def test_plan_file_checked_against_model_and_world(tmp_path):
    _two_stage_plan(seq_len=32).save(tmp_path / "plan.json")
    plugin = HaptPlugin.from_yaml(_write(tmp_path / "hapt.yaml", "plan: plan.json\n"
                                         "schedule: 1f1b\n"))
    config = AutoConfig.from_pretrained(GPT2)
    with pytest.raises(PlanError, match="seq_len 32 but the run uses 64"):
        resolve_plan(plugin, config, 64, SINGLE)
    with pytest.raises(PlanError, match="2 processes but 1 were started"):
        resolve_plan(plugin, config, 32, SINGLE)
    config.n_layer = 4
    with pytest.raises(PlanError, match="cuts 8 layers but the model has 4 blocks"):
        resolve_plan(plugin, config, 32, SINGLE)


def test_unsupported_model_family_lists_supported():
    from transformers import BertConfig

    with pytest.raises(LaunchError, match="'bert'.*supported: gpt2, llama, mistral, qwen2"):
        check_model_family(BertConfig())


# -- data --------------------------------------------------------------------------------------
def test_shipped_tokenizer_and_data_pack_to_seq_len():
    tok = AutoTokenizer.from_pretrained(RECIPES / "data" / "tokenizer")
    assert len(tok) <= AutoConfig.from_pretrained(GPT2).vocab_size
    train, held = load_text_dataset(TextDataConfig(RECIPES / "data" / "tiny_corpus.jsonl",
                                                   seq_len=32), tok)
    assert train.shape[1] == held.shape[1] == 32 and len(train) > 8 * len(held) > 0
    text = "The cat sleeps on the windowsill."
    assert tok.decode(tok(text)["input_ids"]) == text


def test_packing_joins_with_eos_and_drops_tail():
    tok = AutoTokenizer.from_pretrained(RECIPES / "data" / "tokenizer")
    texts = ["one two three", "four five six seven"]
    flat = [i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]]
    rows = pack_tokens(texts, tok, 4)
    assert rows.flatten().tolist() == flat[: len(flat) // 4 * 4]
    with pytest.raises(DataError, match="fewer than one sample"):
        pack_tokens(["hi"], tok, 1000)


def test_missing_column_and_bad_file_are_named(tmp_path):
    tok = AutoTokenizer.from_pretrained(RECIPES / "data" / "tokenizer")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"body": f"sample {i} text"}) for i in range(5)))
    with pytest.raises(DataError, match=r"no column 'text'; its columns are \['body'\]"):
        load_text_dataset(TextDataConfig(data), tok)
    with pytest.raises(DataError, match="does not exist"):
        load_text_dataset(TextDataConfig(tmp_path / "none.jsonl"), tok)
    with pytest.raises(DataError, match="suffix '.csv'"):
        load_text_dataset(TextDataConfig(_write(tmp_path / "d.csv", "a,b\n")), tok)


def test_epoch_order_depends_only_on_seed_and_epoch():
    a = epoch_order(50, seed=3, epoch=1)
    assert torch.equal(a, epoch_order(50, seed=3, epoch=1))
    assert sorted(a.tolist()) == list(range(50))
    assert not torch.equal(a, epoch_order(50, seed=3, epoch=2))


# -- checkpoint atomicity ----------------------------------------------------------------------
def test_crash_mid_save_leaves_no_checkpoint_that_looks_complete(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    tmp = ckpt_io.begin_checkpoint(tmp_path, "checkpoint-4", rank=0)
    (tmp / "model.safetensors").write_bytes(b"partial")
    # The process dies here, before commit_checkpoint: nothing named checkpoint-N exists.
    assert get_last_checkpoint(str(tmp_path)) is None
    tmp2 = ckpt_io.begin_checkpoint(tmp_path, "checkpoint-6", rank=0)
    assert not tmp.exists(), "a later save removes the debris of a crashed one"
    (tmp2 / "trainer_state.json").write_text("{}")
    ckpt_io.commit_checkpoint(tmp2, tmp_path / "checkpoint-6", rank=0)
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")
    assert not tmp2.exists() and (tmp_path / "checkpoint-6" / "trainer_state.json").is_file()
    with pytest.raises(ckpt_io.CheckpointError, match="lacks"):
        ckpt_io.check_resumable(tmp_path / "checkpoint-6", _two_stage_plan(), 2)


def test_batch_sizes_must_map_onto_the_plans_micro_batches():
    """One step is per_device_train_batch_size x gradient_accumulation_steps x processes
    samples (Trainer's data parallelism), the plan's global batch however it is split."""
    from transformers import TrainingArguments

    from hapt_hf.integration.trainer import BatchMappingError, check_batch_mapping

    def args(per_device: int, accumulation: int) -> TrainingArguments:
        return TrainingArguments(output_dir="unused", per_device_train_batch_size=per_device,
                                 gradient_accumulation_steps=accumulation, use_cpu=True,
                                 report_to=[])

    plan = _two_stage_plan()  # 4 micro-batches of 1 sample: 4 samples a step
    for per_device, accumulation, world in [(1, 2, 2), (2, 1, 2), (1, 4, 1), (4, 1, 1),
                                            (1, 1, 4)]:
        check_batch_mapping(args(per_device, accumulation), plan, world)
    with pytest.raises(BatchMappingError) as e:
        check_batch_mapping(args(1, 4), plan, 2)
    assert str(e.value) == (
        "per_device_train_batch_size=1 x gradient_accumulation_steps=4 x 2 processes = 8 "
        "samples per step, but the plan runs global batches of 4; set "
        "per_device_train_batch_size=2 with gradient_accumulation_steps=1 or "
        "per_device_train_batch_size=1 with gradient_accumulation_steps=2")
    with pytest.raises(BatchMappingError, match=r"= 3 samples per step, but the plan runs global "
                                                r"batches of 4; re-plan for another global batch"):
        check_batch_mapping(args(1, 1), plan, 3)  # 4 samples cannot split over 3 processes
