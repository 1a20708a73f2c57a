"""Elastic runs on one process: the cluster of the GPUs present (groups shrunk, in rank order,
split where a group's ranks are not consecutive), the refusals naming HAPT_GROUP, the global
batch kept on another world, the restart's checkpoint and line, the one message of a re-plan
that fits nothing, and torchrun restarts refused where the shared store would break them."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hapt_hf.errors import ConfigError, LaunchError, PlanError, TrainingArgsError
from hapt_hf.integration import elastic
from hapt_hf.integration.elastic import Place, present_cluster
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.plan import Plan, Stage

CLUSTER = Cluster.from_dict({"name": "two", "groups": [
    {"name": "small", "gpu": "cpu-small", "tflops": 0.05, "memory_gb": 16, "nodes": 2,
     "gpus_per_node": 2, "intra_node": {"bandwidth_gbps": 100, "latency_us": 5},
     "inter_node": {"bandwidth_gbps": 10, "latency_us": 50}},
    {"name": "big", "gpu": "cpu-big", "tflops": 0.1, "memory_gb": 16, "gpus_per_node": 2}],
    "links": [{"between": ["small", "big"], "bandwidth_gbps": 1, "latency_us": 500}]})


def _places(*groups: str | None, nodes: list[str] | None = None) -> list[Place]:
    return [Place(g, (nodes or ["n"] * len(groups))[i]) for i, g in enumerate(groups)]


def test_the_present_groups_are_listed_in_rank_order_so_the_planner_numbers_ranks_as_torchrun():
    got = present_cluster(CLUSTER, _places("big", "big", "small", "small",
                                           nodes=["b", "b", "s0", "s0"]))
    assert [(g.name, g.nodes, g.gpus_per_node) for g in got.groups] == [("big", 1, 2), ("small", 1, 2)]
    assert got.ranks_of("big") == [0, 1] and got.ranks_of("small") == [2, 3]
    assert got.link("big", "small") == CLUSTER.link("small", "big") and got.name == "two"
    alone = present_cluster(CLUSTER, _places("big", "big"))
    assert [(g.name, g.size) for g in alone.groups] == [("big", 2)] and alone.links == ()


def test_a_group_over_nodes_keeps_its_nodes_or_its_slower_link():
    even = present_cluster(CLUSTER, _places("small", "small", "small", "small",
                                            nodes=["s0", "s0", "s1", "s1"])).group("small")
    assert (even.nodes, even.gpus_per_node, even.intra_node) == (2, 2, CLUSTER.group("small").intra_node)
    uneven = present_cluster(CLUSTER, _places("small", "small", "small",
                                              nodes=["s0", "s0", "s1"])).group("small")
    assert (uneven.nodes, uneven.gpus_per_node) == (1, 3)
    assert uneven.intra_node == CLUSTER.group("small").inter_node  # it spans two nodes


def test_a_group_whose_ranks_are_not_consecutive_is_split_and_linked():
    got = present_cluster(CLUSTER, _places("small", "big", "small", nodes=["s0", "b", "s1"]))
    assert [g.name for g in got.groups] == ["small.1", "big", "small.2"]
    assert got.link("small.1", "small.2") == CLUSTER.group("small").inter_node
    assert got.link("small.2", "big") == CLUSTER.link("small", "big")


def test_groups_not_said_are_the_cluster_file_as_it_is_and_bad_names_are_refused():
    assert present_cluster(CLUSTER, _places(None, None)) is None
    assert present_cluster(CLUSTER, None) is None
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] do not say which group .* set "
                                          r"HAPT_GROUP=<group> \(one of small, big\)"):
        present_cluster(CLUSTER, _places("big", None))
    with pytest.raises(ConfigError, match=r"rank\(s\) \[0\] say HAPT_GROUP='huge', which is no "
                                          r"group of cluster 'two'; use one of small, big"):
        present_cluster(CLUSTER, _places("huge", "big"))
    with pytest.raises(ConfigError, match=r"3 ranks say HAPT_GROUP='big' but cluster 'two' gives "
                                          r"group 'big' 2 GPU\(s\)"):
        present_cluster(CLUSTER, _places("big", "big", "big"))


def test_the_global_batch_is_kept_on_another_world():
    args = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    elastic.keep_global_batch(args, 8, 4)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 2)
    elastic.keep_global_batch(args, 8, 2)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 4)
    args = SimpleNamespace(per_device_train_batch_size=3, gradient_accumulation_steps=1)
    elastic.keep_global_batch(args, 8, 2)  # 3 does not divide 8: the per-device batch moves
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 1)
    with pytest.raises(TrainingArgsError, match=r"global batch of 8 samples cannot be drawn by 3 "
                                                r"processes"):
        elastic.keep_global_batch(args, 8, 3)


def test_restarts_sharing_the_agents_store_are_refused_with_the_fix():
    env = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(LaunchError, match=r"--max-restarts 2 .* --rdzv-backend c10d and "
                                          r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic.check_restartable(elastic.read_elastic_env(env))
    elastic.check_restartable(elastic.read_elastic_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}))
    with pytest.raises(LaunchError, match=r"--max-restarts 2 but no --rdzv-id: a restart because a node "
                                          r"joined .* torchrun --rdzv-id <run>, or PET_RDZV_ID=<run>"):
        elastic.check_restartable(elastic.read_elastic_env({**env, "TORCHELASTIC_RUN_ID": "none"}))
    elastic.check_restartable(elastic.read_elastic_env({**env, "TORCHELASTIC_MAX_RESTARTS": "0"}))
    assert elastic.read_elastic_env({}) is None


def _plan(global_batch: int) -> Plan:
    stage = Stage.even(0, (0, 6), "big", "cpu", (0,), 1, micro_batch_size=global_batch)
    return Plan("tiny", 6, 8, global_batch, global_batch, 1, "1f1b", (stage,)).validate(1)


def test_a_restart_resumes_the_latest_complete_checkpoint_and_says_so(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    given = Path("given")
    (out / "checkpoint-100").mkdir(parents=True)  # an earlier run's, in the same directory
    assert elastic.run_global_batch(None, out) is None  # a first start: nothing to keep yet
    assert elastic.run_global_batch(8, out) == 8  # restartable: the config's is kept
    assert elastic.resume_point(0, 1, given, out, "big x1") == given
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir()
    _plan(12).save(out / "checkpoint-4" / "plan.json")
    (out / ".tmp-checkpoint-6").mkdir()  # a save cut short: never resumed
    (out / "checkpoint-8" / "portable").mkdir(parents=True)  # its background copy cut short
    (out / "checkpoint-8" / "hapt_portable.pt").touch()
    capsys.readouterr()
    # a node joined: the agent restarted the workers without counting a failure
    assert elastic.run_global_batch(None, out) == 12
    assert elastic.resume_point(0, 1, given, out, "big x1") == out / "checkpoint-4"
    assert "hapt_hf: restart 1: world 1 (groups big x1), re-planned, resuming from checkpoint-4 " \
           "(checkpoint-8: portable part incomplete, not resumed)" in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # another run in the same directory
    assert elastic.resume_point(0, 1, None, out, "big x1") is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a failure: whatever the run's id
    # the new run has written nothing yet: the earlier run's checkpoints are not its own
    assert elastic.resume_point(0, 1, given, out, "big x1") == given
    (out / "checkpoint-1").mkdir()
    assert elastic.resume_point(0, 1, given, out, "big x1") == out / "checkpoint-1"


def test_a_re_plan_that_fits_nothing_says_in_one_message_what_would(monkeypatch):
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.integration.launch import LaunchEnv
    from hapt_hf.integration.plan_resolution import resolve_plan
    from hapt_hf.planner.model_spec import model_config

    tight = Cluster.from_dict({**CLUSTER.to_dict(), "groups": [
        {**CLUSTER.to_dict()["groups"][0], "memory_gb": 0.0001}, CLUSTER.to_dict()["groups"][1]]})
    places = _places("small", "small")
    monkeypatch.setattr(elastic, "gather_places", lambda world_size: places)
    monkeypatch.setattr("torch.distributed.broadcast_object_list", lambda objs, src: None)
    config = HaptConfig(cluster=tight, global_batch_size=8)
    with pytest.raises(PlanError) as refused:
        resolve_plan(config, model_config("gpt2-tiny"), 64, LaunchEnv(0, 2, 0, "single"))
    said = str(refused.value)
    assert said.startswith("the 2 GPUs present (groups small x2; of the cluster file's, small "
                           "x2, big x2 not present) cannot hold the job: no plan of model"), said
    assert "What would fit:" in said and said.count("\n") == 0, said


def test_a_ready_plan_of_another_world_under_the_elastic_agent_asks_for_the_cluster(
        tmp_path, monkeypatch):
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.integration.launch import LaunchEnv
    from hapt_hf.integration.plan_resolution import resolve_plan
    from hapt_hf.planner.model_spec import model_config

    stage = Stage.even(0, (0, 6), "big", "cpu", (0, 1), 1, micro_batch_size=4)
    Plan("gpt2", 6, 64, 8, 4, 2, "1f1b", (stage,)).validate(2).save(tmp_path / "plan.json")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    config = HaptConfig(plan=tmp_path / "plan.json")
    with pytest.raises(PlanError, match=r"runs on 2 ranks but the elastic agent started 1; give "
                                        r"'cluster' instead of 'plan'"):
        resolve_plan(config, model_config("gpt2-tiny"), 64, LaunchEnv(0, 1, 0, "single"))


HOSTS = Cluster.from_dict({**CLUSTER.to_dict(), "groups": [
    {**CLUSTER.to_dict()["groups"][0], "hosts": ["cpu-s*", "spare"]},
    {**CLUSTER.to_dict()["groups"][1], "hosts": "cpu-b[0-9]"}]})


def test_the_cluster_files_hosts_map_a_hostname_to_its_group():
    from hapt_hf.errors import ClusterError

    assert HOSTS.group("small").hosts == ("cpu-s*", "spare") and HOSTS.group("big").hosts == ("cpu-b[0-9]",)
    assert Cluster.from_dict(HOSTS.to_dict()) == HOSTS and CLUSTER.group("big").hosts == ()
    assert HOSTS.group_of_host("CPU-S12") == "small" and HOSTS.group_of_host("cpu-b3") == "big"
    assert CLUSTER.group_of_host("anything") is None  # no group lists hosts
    with pytest.raises(ClusterError, match=r"host 'cpu-b10' matches no group's hosts in cluster 'two' "
                                           r"\(small: \['cpu-s\*', 'spare'\]; big: \['cpu-b\[0-9\]'\]\); add a "
                                           r"pattern matching it to its group's hosts, or set HAPT_GROUP"):
        HOSTS.group_of_host("cpu-b10")
    both = Cluster.from_dict({**HOSTS.to_dict(), "groups": [
        {**HOSTS.to_dict()["groups"][0], "hosts": ["cpu-*"]}, HOSTS.to_dict()["groups"][1]]})
    with pytest.raises(ClusterError, match=r"host 'cpu-b1' matches the hosts of groups small, big in "
                                           r"cluster 'two' .*match one group only, or set HAPT_GROUP"):
        both.group_of_host("cpu-b1")
    for bad in ([], [""], [3], {"a": 1}):
        with pytest.raises(ClusterError, match=r"group 'big'.hosts must be a list of hostnames or "
                                               r"fnmatch patterns"):
            Cluster.from_dict({**CLUSTER.to_dict(), "groups": [
                CLUSTER.to_dict()["groups"][0], {**CLUSTER.to_dict()["groups"][1], "hosts": bad}]})


def test_nodes_found_by_hostname_are_planned_in_rank_order_and_hapt_group_wins():
    from hapt_hf.errors import ClusterError

    def at(host: str, node: str, group: str | None = None) -> Place:
        return Place(group, node, host)
    places = [at("cpu-b1", "b/0"), at("cpu-b1", "b/0"), at("cpu-s0", "s/1"), at("cpu-s0", "s/1")]
    got = present_cluster(HOSTS, places)
    assert [(g.name, g.size) for g in got.groups] == [("big", 2), ("small", 2)]
    assert elastic.describe_places(elastic.resolve_groups(HOSTS, places)) == "big x2, small x2"
    # a node that says HAPT_GROUP is that group, whatever its hostname
    said = present_cluster(HOSTS, [at("cpu-b1", "b/0", "small"), at("cpu-b1", "b/0", "small")])
    assert [(g.name, g.size) for g in said.groups] == [("small", 2)]
    with pytest.raises(ClusterError, match=r"host 'login1' matches no group's hosts"):
        present_cluster(HOSTS, [at("cpu-b1", "b/0"), at("login1", "x/1")])
    assert elastic.this_place({"HAPT_HOSTNAME": "cpu-s7", "GROUP_RANK": "3"}) == Place(None, "cpu-s7/3", "cpu-s7")
    assert elastic.this_place({"HAPT_GROUP": "big"}).host  # the machine's own hostname


def test_one_process_left_by_the_elastic_agent_is_planned_on_its_own_group(monkeypatch):
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.integration.launch import LaunchEnv
    from hapt_hf.integration.plan_resolution import resolve_plan
    from hapt_hf.planner.model_spec import model_config

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("HAPT_GROUP", "big")
    plan = resolve_plan(HaptConfig(cluster=CLUSTER, global_batch_size=8), model_config("gpt2-tiny"), 64,
                        LaunchEnv(0, 1, 0, "single"))
    assert plan.world_size == 1 and [s.group for s in plan.stages] == ["big"]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # no agent: one process takes the file as it is
    assert elastic.gather_places(1) is None
