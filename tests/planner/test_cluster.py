"""Cluster files: parsing, defaults, graph, round trip, and one clear error per mistake."""
from __future__ import annotations

import copy
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapt_hf.planner.catalogue import CATALOGUE, device_names, find_gpu
from hapt_hf.planner.cluster import (DEFAULT_INTER_NODE, DEFAULT_INTRA_NODE, Cluster,
                                     ClusterError, LinkSpec, builtin_cluster_names,
                                     builtin_cluster_path)

from benchmarks.inputs import SAILOR_PROFILES_DIR, scenario_path, scenario_paths

SCENARIOS = [str(p) for p in scenario_paths()]

BASE = {
    "name": "two",
    "groups": [
        {"name": "v100", "gpu": "V100-32", "nodes": 1, "gpus_per_node": 8,
         "intra_node": {"bandwidth_gbps": 200, "latency_us": 10}},
        {"name": "a100", "gpu": "A100-40", "nodes": 2, "gpus_per_node": 2},
    ],
    "links": [{"between": ["v100", "a100"], "bandwidth_gbps": 5, "latency_us": 1000}],
}


_DELETE = object()


def _with(**changes):
    """A copy of BASE with ``a__0__b=value`` set (or deleted with _DELETE)."""
    d = copy.deepcopy(BASE)
    for path, value in changes.items():
        keys = [int(k) if k.isdigit() else k for k in path.split("__")]
        obj = d
        for k in keys[:-1]:
            obj = obj[k]
        if value is _DELETE:
            del obj[keys[-1]]
        else:
            obj[keys[-1]] = value
    return d


def test_example_cluster_fields_defaults_and_ranks():
    c = Cluster.from_dict(BASE)
    assert c.world_size == 12
    assert c.ranks_of("v100") == list(range(8)) and c.ranks_of("a100") == [8, 9, 10, 11]
    v100, a100 = c.group("v100"), c.group("a100")
    assert v100.gpu == find_gpu("V100-32") and a100.size == 4
    assert v100.inter_node == DEFAULT_INTER_NODE
    assert a100.intra_node == DEFAULT_INTRA_NODE and a100.inter_node == DEFAULT_INTER_NODE
    assert c.link("v100", "a100") == c.link("a100", "v100") == LinkSpec(5, 1000)
    assert c.link("v100", "v100") is None
    g = c.graph()
    assert set(g.nodes) == {"v100", "a100"} and g.nodes["a100"]["group"] == a100
    assert g.edges["v100", "a100"]["link"] == LinkSpec(5, 1000)


def test_transfer_time():
    assert LinkSpec(8, 1000).transfer_s(1e9) == pytest.approx(1.0 + 1e-3)


def test_overrides_and_unknown_gpu_with_figures():
    d = _with(groups__0__tflops=88, groups__1__gpu="MyAccel", groups__1__tflops=50)
    d["groups"][1]["memory_gb"] = 12
    c = Cluster.from_dict(d)
    assert c.group("v100").gpu.tflops == 88 and c.group("v100").gpu.memory_gb == 32
    assert (c.group("a100").gpu.name, c.group("a100").gpu.memory_gb) == ("MyAccel", 12)


def test_aliases_and_profile_names():
    assert find_gpu("H100").name == "H100-80"
    assert find_gpu("gh-96").name == "GH200" and find_gpu("rtx 4090").name == "RTX-4090"
    assert "GH-96" in device_names("GH200") and "GH200" in device_names("GH-96")
    assert device_names("nonesuch") == ("nonesuch",)


def test_catalogue_has_required_types_with_figures():
    required = {"V100-16", "V100-32", "A100-40", "A100-80", "H100-80", "H200", "GH200", "L4",
                "L40S", "A10", "T4", "RTX-3090", "RTX-4080", "RTX-4090", "A6000", "Titan-RTX",
                "RTX-2080", "cpu"}
    assert required <= set(CATALOGUE)
    for gpu in CATALOGUE.values():
        assert gpu.tflops > 0 and gpu.memory_gb > 0
    # newer generations are faster: a sanity check on the figures' order, not their values
    assert CATALOGUE["V100-32"].tflops < CATALOGUE["A100-40"].tflops < CATALOGUE["H100-80"].tflops


@pytest.mark.parametrize("path", SCENARIOS + builtin_cluster_names(), ids=os.path.basename)
def test_scenarios_and_builtins_load_and_round_trip(path):
    c = Cluster.load(path)
    assert Cluster.from_dict(c.to_dict()) == c
    assert c.world_size == sum(len(c.ranks_of(g.name)) for g in c.groups)
    assert c.job.seq_len and c.job.global_batch_size and c.job.model


def test_scenario_profiles_name_the_shipped_measurements():
    c = Cluster.load(scenario_path("sailor_a100x8_v100x8_opt350"))
    assert c.profiles == SAILOR_PROFILES_DIR and (c.profiles / "layer_times.json").is_file()
    assert c.group("v100").gpu.name == "V100-16"


def test_scenario_profiles_resolve_relative_to_file(tmp_path):
    # a directory beside the file wins over the built-in name it happens to share
    (tmp_path / "sailor").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text("name: c\nprofiles: sailor\ngroups: [{name: a, gpu: cpu, nodes: 1, gpus_per_node: 1}]\n")
    assert Cluster.load(path).profiles == (tmp_path / "sailor").resolve()
    path.write_text("name: c\nprofiles: nope\ngroups: [{name: a, gpu: cpu, nodes: 1, gpus_per_node: 1}]\n")
    with pytest.raises(ClusterError, match="nope.*built-in set \\(sailor\\)"):
        Cluster.load(path)


def test_builtin_paths():
    assert builtin_cluster_path("cpu_demo_4.yaml") == builtin_cluster_path("cpu_demo_4")
    demo = Cluster.load("cpu_demo_4")
    assert [g.size for g in demo.groups] == [1, 3]
    assert demo.group("fast").gpu.tflops > demo.group("slow").gpu.tflops
    with pytest.raises(ClusterError, match="cpu_demo_4"):
        builtin_cluster_path("nope")


@pytest.mark.parametrize("d, match", [
    (_with(groups__1__gpu="B300"), r"groups?.*'B300'.*V100-32.*tflops: .*memory_gb:"),
    (_with(links__0__bandwidth_gbps=-5), r"links\[0\]\.bandwidth_gbps must be a number > 0"),
    (_with(links__0__bandwidth_gbps=0), r"links\[0\]\.bandwidth_gbps"),
    (_with(links__0__latency_us=-1), r"links\[0\]\.latency_us must be a number >= 0"),
    (_with(groups__0__intra_node={"bandwidth_gbps": -1, "latency_us": 1}),
     r"group 'v100'\.intra_node\.bandwidth_gbps"),
    (_with(groups__1__name="v100"), r"group 'v100': duplicate group name"),
    (_with(links__0__between=["v100", "h100"]), r"links\[0\]\.between.*unknown group 'h100'"),
    (_with(links=[]), r"group 'v100' has no link to any other group.*between: \[v100, a100\]"),
    (_with(groups__0__nodes=0), r"group 'v100'\.nodes must be an integer >= 1"),
    (_with(groups__1__gpus_per_node=0), r"group 'a100'\.gpus_per_node must be an integer"),
    (_with(groups__1__gpus_per_node=_DELETE), r"gpus_per_node is missing"),
    (_with(groups__0__gpus_per_nodes=8), r"groups\[0\]: unknown key.*gpus_per_nodes"),
    (_with(groups=[]), r"groups: must be a non-empty list"),
    (_with(job={"seq_len": -3}), r"job\.seq_len must be an integer >= 1"),
    (_with(job={"dtype": "fp8"}), r"job\.dtype 'fp8'"),
    (_with(profiles="no/such/dir"), r"profiles: directory 'no/such/dir'"),
    ([1, 2], r"must be a mapping"),
])
def test_bad_cluster_names_field_and_fix(d, match):
    with pytest.raises(ClusterError, match=match):
        Cluster.from_dict(d)


def test_bad_files(tmp_path):
    with pytest.raises(ClusterError, match="does not exist.*cpu_demo_4"):
        Cluster.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [unclosed\n")
    with pytest.raises(ClusterError, match="not valid YAML"):
        Cluster.load(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ClusterError, match="must hold a mapping"):
        Cluster.load(bad)


def test_single_group_needs_no_link(tmp_path):
    d = {"groups": [{"name": "solo", "gpu": "cpu", "gpus_per_node": 2}]}
    c = Cluster.from_dict(d)
    assert c.world_size == 2 and c.links == () and c.name == "cluster"


def test_from_config_accepts_builtin_name_via_model_spec():
    # cluster job sections may name a built-in model; ModelSpec resolves the same names
    from hapt_hf.planner.model_spec import ModelSpec

    demo = Cluster.load("cpu_demo_4")
    spec = ModelSpec.from_job_model(demo.job.model, demo.job.seq_len, demo.job.dtype)
    assert spec.name == "gpt2-tiny" and spec.num_layers == spec.num_blocks + 2


_names = st.sampled_from(sorted(CATALOGUE))
_link = st.fixed_dictionaries({"bandwidth_gbps": st.floats(0.01, 1e4),
                               "latency_us": st.floats(0, 1e4)})


@st.composite
def _clusters(draw):
    n = draw(st.integers(1, 5))
    groups = [{"name": f"g{i}", "gpu": draw(_names), "nodes": draw(st.integers(1, 4)),
               "gpus_per_node": draw(st.integers(1, 8)), "intra_node": draw(_link)}
              for i in range(n)]
    if draw(st.booleans()):
        groups[0]["tflops"] = draw(st.floats(0.01, 2000))
    # a chain keeps every group linked; extra links are drawn among the remaining pairs
    links = [{"between": [f"g{i}", f"g{i + 1}"], **draw(_link)} for i in range(n - 1)]
    for i in range(n):
        for j in range(i + 2, n):
            if draw(st.booleans()):
                links.append({"between": [f"g{j}", f"g{i}"], **draw(_link)})
    return {"name": "random", "groups": groups, "links": links}


@settings(max_examples=40, deadline=None)
@given(_clusters())
def test_random_clusters_round_trip_and_number_ranks(d):
    c = Cluster.from_dict(d)
    assert Cluster.from_dict(c.to_dict()) == c
    ranks = [r for g in c.groups for r in c.ranks_of(g.name)]
    assert ranks == list(range(c.world_size))
    g = c.graph()
    assert g.number_of_edges() == len(d["links"])
    for l in d["links"]:
        assert c.link(*l["between"]) == c.link(*reversed(l["between"])) is not None
