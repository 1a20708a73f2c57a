"""CheckpointStore on one process (no process group): a local file shorter than the reads need,
or written by another save of the same name, is fetched instead; a failed upload is reported,
leaving no marker, and rank 0 stops waiting for another rank whose copy failed; a remote
nobody can open and a remote that is the local directory are refused naming them; a copy left
unfinished is named when another plan cannot resume the checkpoint; HaptAccelerator refuses
checkpoint_local_dir."""
from __future__ import annotations

import warnings

import pytest
import torch
import yaml

from benchmarks import slow_store
from hapt_hf.errors import CheckpointError
from hapt_hf.planner.cluster import builtin_cluster_path
from hapt_hf.pipeline import portable
from hapt_hf.pipeline.checkpoint_store import COMPLETE_MARKER, CheckpointStore, Upload


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))


def test_a_truncated_local_file_is_fetched_and_the_load_is_exact(tmp_path):
    store = CheckpointStore(tmp_path / "local", f"throttled://{tmp_path}/remote")
    model = _model()
    store.save("checkpoint-1", portable.portable_state_dict(model, None)).wait()
    shard = tmp_path / "local" / "checkpoint-1" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a crash mid-write left it short
    slow_store.reset()
    again = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
    reader = store.reader("checkpoint-1")
    portable.load_portable("checkpoint-1", again, None, reader)
    assert reader.stats.fetched_files == ["__0_0.distcp"] and reader.stats.local_bytes == 0
    # the marker (naming the save) and the shard from the remote, the metadata from the local copy
    assert slow_store.fetched_files() == [COMPLETE_MARKER, "__0_0.distcp"]
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_a_local_file_of_another_save_of_the_same_name_is_not_read(tmp_path):
    first = CheckpointStore(tmp_path / "local", f"throttled://{tmp_path}/remote")
    model = _model()
    first.save("checkpoint-1", portable.portable_state_dict(model, None)).wait()
    other = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))  # other weights
    # the same name saved again into the same local directory (another run, a node that was
    # away while the run went on): the local files are no longer those of the first copy
    CheckpointStore(tmp_path / "local", str(tmp_path / "elsewhere")).save(
        "checkpoint-1", portable.portable_state_dict(other, None)).wait()
    again = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
    reader = first.reader("checkpoint-1")
    portable.load_portable("checkpoint-1", again, None, reader)
    assert reader.stats.local_bytes == 0 and reader.stats.fetched_files == ["__0_0.distcp"]
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_a_failed_upload_is_reported_and_leaves_no_marker(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "checkpoint-1").write_text("a file where the checkpoint's directory goes")
    store = CheckpointStore(tmp_path / "local", str(remote))
    upload = store.save("checkpoint-1", portable.portable_state_dict(_model(), None))
    with pytest.raises(CheckpointError, match=r"upload of 'checkpoint-1' .* failed on rank 0.*"
                                              r"the local copy in .* is intact"):
        upload.wait()
    assert not store.is_complete("checkpoint-1") and store.latest_complete() is None
    assert not (remote / COMPLETE_MARKER).exists()


def test_rank_0_stops_waiting_for_a_rank_whose_copy_failed(tmp_path):
    store = CheckpointStore(tmp_path / "local", str(tmp_path / "remote"))
    store.save("checkpoint-1", portable.portable_state_dict(_model(), None), start=False)
    (tmp_path / "remote" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "remote" / "checkpoint-1" / ".failed-1").write_text("OSError: disk full")
    upload = Upload(store, "checkpoint-1", ["__0_0.distcp", ".metadata"], 0, 2).start()
    with pytest.raises(CheckpointError, match=r"failed on rank 0 .*rank\(s\) \[1\] failed"):
        upload.wait(timeout_s=30)
    assert not store.is_complete("checkpoint-1")


def test_bad_remotes_are_refused(tmp_path):
    store = CheckpointStore(tmp_path, "nosuchprotocol://bucket/run")
    with pytest.raises(CheckpointError, match="'nosuchprotocol://bucket/run' cannot be opened.*"
                                              "install the fsspec backend"):
        store.is_complete("checkpoint-1")
    with pytest.raises(CheckpointError, match="is the local directory itself"):
        CheckpointStore(tmp_path, str(tmp_path))


def test_a_checkpoint_whose_copy_did_not_finish_names_why_another_plan_cannot_resume_it(tmp_path):
    from hapt_hf.integration.trainer_checkpoint import check_resumable
    from tests.integration.test_trainer_portable_resume import _plan
    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "portable").mkdir(parents=True)
    _plan(3).save(ckpt / "plan.json")
    for name in ["trainer_state.json", "model.safetensors"] + [f"hapt_rank{r}.pt" for r in range(2)]:
        (ckpt / name).write_text("")
    (ckpt / "portable" / ".uploaded-1").write_text("{}")  # rank 1's files are up, no marker
    with pytest.raises(CheckpointError, match="was still being copied .* resume from an earlier "
                                              "checkpoint, or resume with the same plan"):
        check_resumable(ckpt, _plan(2), 2)
    (ckpt / "portable" / COMPLETE_MARKER).write_text("{}")
    with pytest.raises(CheckpointError, match=r"than this run's \(.*\); resume with the same plan"):
        check_resumable(ckpt, _plan(2), 2)


def test_haptaccelerator_refuses_checkpoint_local_dir_it_would_not_honour(tmp_path):
    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig, HaptConfigError
    from hapt_hf.planner.cluster import Cluster
    config = HaptConfig(cluster=Cluster.load("cpu_demo_4"), checkpoint_local_dir=tmp_path)
    with pytest.raises(HaptConfigError, match="'checkpoint_local_dir' is kept by HaptTrainer's "
                                              "checkpoints only"):
        HaptAccelerator(hapt_plugin=config)


def test_haptaccelerator_refuses_checkpoint_retries_it_would_not_honour():
    from hapt_hf.integration.accelerate_plugin import HaptAccelerator
    from hapt_hf.integration.config import HaptConfig, HaptConfigError
    from hapt_hf.planner.cluster import Cluster
    config = HaptConfig(cluster=Cluster.load("cpu_demo_4"), checkpoint_retries={"attempts": 3})
    with pytest.raises(HaptConfigError, match="'checkpoint_retries' is kept by HaptTrainer's "
                                              "checkpoints only"):
        HaptAccelerator(hapt_plugin=config)


@pytest.mark.parametrize("given, match", [
    ([3], r"'checkpoint_retries' is \[3\]; give a mapping"),
    ({"tries": 3}, r"unknown key\(s\) 'tries'; its keys are attempts, backoff_s, retry_s"),
    ({"attempts": 0}, r"'checkpoint_retries.attempts' is 0; give a whole number of attempts >= 1"),
    ({"attempts": 2.5}, r"'checkpoint_retries.attempts' is 2.5; give a whole number"),
    ({"attempts": True}, r"'checkpoint_retries.attempts' is True; give a whole number"),
    ({"backoff_s": -1}, r"'checkpoint_retries.backoff_s' is -1; give a number of seconds >= 0"),
    ({"retry_s": "10"}, r"'checkpoint_retries.retry_s' is '10'; give a number of seconds >= 0"),
])
def test_checkpoint_retries_are_checked_key_by_key(tmp_path, given, match):
    from hapt_hf.integration.config import HaptConfig, HaptConfigError
    path = tmp_path / "hapt.yaml"
    path.write_text(yaml.safe_dump({"cluster": str(builtin_cluster_path("cpu_demo_4")),
                                    "checkpoint_local_dir": str(tmp_path),
                                    "checkpoint_retries": given}))
    with pytest.raises(HaptConfigError, match=match):
        HaptConfig.from_yaml(path)


@pytest.mark.parametrize("field, value, need", [
    ("upload_attempts", 0, "a whole number of attempts >= 1"),
    ("upload_attempts", True, "a whole number of attempts >= 1"),
    ("upload_backoff_s", -0.5, "a number of seconds >= 0"),
    ("upload_retry_s", None, "a number of seconds >= 0"),
])
def test_the_store_refuses_retry_settings_by_the_same_rule(tmp_path, field, value, need):
    with pytest.raises(CheckpointError, match=rf"{field} is {value!r}; give {need}"):
        CheckpointStore(tmp_path, str(tmp_path / "remote"), **{field: value})


def test_checkpoint_retries_reach_the_store_of_the_copy_and_the_reads(tmp_path):
    """What the hapt config's checkpoint_retries set is what the checkpoints' store retries by;
    left out, the store's defaults."""
    from hapt_hf.integration.config import HaptConfig
    from hapt_hf.integration.trainer_checkpoint import portable_store
    from hapt_hf.pipeline.checkpoint_store import CheckpointStore
    path = tmp_path / "hapt.yaml"
    path.write_text(yaml.safe_dump({"cluster": str(builtin_cluster_path("cpu_demo_4")),
                                    "checkpoint_local_dir": str(tmp_path),
                                    "checkpoint_retries": {"attempts": 9, "retry_s": 30}}))
    config = HaptConfig.from_yaml(path)
    store = portable_store(config.checkpoint_local_dir, tmp_path / "run", config.checkpoint_retries)
    default = CheckpointStore(tmp_path, str(tmp_path / "run"))
    assert (store.upload_attempts, store.upload_retry_s) == (9, 30)
    assert store.upload_backoff_s == default.upload_backoff_s
    plain = portable_store(tmp_path, tmp_path / "run")
    assert (plain.upload_attempts, plain.upload_backoff_s, plain.upload_retry_s) == \
        (default.upload_attempts, default.upload_backoff_s, default.upload_retry_s)


def test_one_rule_says_whether_a_copy_is_whole(tmp_path):
    from hapt_hf.pipeline.checkpoint_store import copy_unfinished, copy_whole

    dcp_dir, copied = tmp_path / "dcp", tmp_path / "copied"
    dcp_dir.mkdir()
    copied.mkdir()
    assert not copy_whole(dcp_dir) and not copy_unfinished(dcp_dir)  # nothing written yet
    (dcp_dir / ".metadata").write_text("")  # DCP writes it last
    assert copy_whole(dcp_dir) and not copy_unfinished(dcp_dir)
    (copied / ".uploaded-0").write_text("{}")
    (copied / ".metadata").write_text("")  # an upload puts the metadata just before the marker
    assert not copy_whole(copied) and copy_unfinished(copied)
    (copied / COMPLETE_MARKER).write_text("{}")
    assert copy_whole(copied) and not copy_unfinished(copied)
    store = CheckpointStore(tmp_path / "local", str(tmp_path))
    assert store.is_complete("copied") and store.is_complete("dcp") and not store.is_complete("none")
