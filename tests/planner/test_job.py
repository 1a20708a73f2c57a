"""planner.job.load_job: a cluster file's job: section, with values given in place of its fields."""
from __future__ import annotations

import pytest

from hapt_hf.errors import ClusterError
from hapt_hf.planner.cluster import Cluster
from hapt_hf.planner.job import load_job

JOB_FILE = """\
name: two
groups:
  - {name: v100, gpu: V100-32, nodes: 1, gpus_per_node: 2}
  - {name: a100, gpu: A100-40, nodes: 1, gpus_per_node: 1}
links:
  - {between: [v100, a100], bandwidth_gbps: 5, latency_us: 1000}
job:
  model: {family: gpt2, hidden_size: 256, num_layers: 4, num_heads: 4, vocab_size: 1000}
  global_batch_size: 16
  precision: auto
"""


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_FILE)
    return path


def test_a_missing_field_is_named(job_file):
    with pytest.raises(ClusterError, match=r"job\.seq_len is missing; a job file names"):
        load_job(job_file)


def test_a_missing_field_names_the_flag_that_stands_in_for_it(job_file):
    with pytest.raises(ClusterError, match=r"job\.seq_len is missing; pass --seq-len N or set"):
        load_job(job_file, flags={"seq_len": "--seq-len N"})


def test_given_values_take_precedence_over_the_file(job_file):
    job = load_job(job_file, seq_len=64)
    assert (job.model.seq_len, job.global_batch_size) == (64, 16)
    assert job.precision.compute == "fp16"  # auto on V100s
    job = load_job(Cluster.load(job_file), seq_len=32, global_batch_size=8, precision="fp32",
                   model={"family": "gpt2", "hidden_size": 128, "num_layers": 2,
                          "num_heads": 2, "vocab_size": 500},
                   attn_implementation="eager")
    assert (job.model.seq_len, job.global_batch_size, job.model.dtype) == (32, 8, "fp32")
    assert job.model.num_layers == 2 + 2 and job.model.attn_implementation == "eager"


@pytest.mark.parametrize("kwargs,name", [({"seq_len": 0}, "--seq-len"),
                                         ({"seq_len": 64, "global_batch_size": -1},
                                          "--global-batch")])
def test_a_given_value_below_one_is_refused_naming_its_flag(job_file, kwargs, name):
    flags = {"seq_len": "--seq-len N", "global_batch_size": "--global-batch N"}
    with pytest.raises(ClusterError, match=f"{name} must be a positive integer"):
        load_job(job_file, flags=flags, **kwargs)
