"""Local-first checkpoints: shards on each node's disk, a background copy on the remote, a
recovery that reads what the node holds and fetches only the rest.

One run of the portable-resume harness (LLaMA-tiny, plan A on 4 ranks, two "nodes" of two ranks
each, every node its own local directory) saves after K steps with
:class:`~hapt_hf.pipeline.checkpoint_store.CheckpointStore` to a remote seen through fsspec
(``throttled://``, unthrottled here: it logs every ranged read) and trains on while the copy
runs. Node 1 is then lost and node 0 has lost one file of its own copy (rank 1's). Resumed in
fresh processes:

* plan A on 4 ranks from the remote copy alone: bit for bit the uninterrupted run;
* plan C on 2 ranks (node 0), local first: each rank reads node 0's file it needs locally and
  fetches only the files node 0 lacks; the losses and final parameters those of one process
  resumed from the remote copy alone (rtol 1e-5, as the portable tests compare).

A remote copy without its completion marker is refused and skipped.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from benchmarks import slow_store  # registers throttled:// (in the ranks too: they import this module)
from benchmarks.ranks import run_ranks
from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline.checkpoint_store import COMPLETE_MARKER, CheckpointStore
from tests.pipeline.test_portable_resume import K, _batches, _end, _merged, _start, _train

pytestmark = pytest.mark.multiproc

NAME = f"checkpoint-{K}"


def _store(root: str, node: int) -> CheckpointStore:
    return CheckpointStore(Path(root) / f"node{node}", f"throttled://{root}/remote")


def write(rank: int, world_size: int, root: str) -> dict:
    """Plan A: K steps, the local-first save, the rest of the steps while the copy runs."""
    from hapt_hf.pipeline import portable
    rt, opt, sched = _start("A")
    batches = _batches(rt.stage.config.vocab_size)
    _train(rt, opt, sched, batches[:K])
    upload = _store(root, rank // 2).save(NAME, portable.portable_state_dict(rt.stage, opt))
    if rank == 0:
        torch.save({"scheduler": sched.state_dict(), "groups": portable.group_settings(opt)},
                   Path(root) / "trainer.pt")
    losses, lrs = _train(rt, opt, sched, batches[K:])
    upload.wait()
    return {**_end(rt, opt, losses, lrs), "files": upload.files}


def resume(rank: int, world_size: int, root: str, plan: str, local: bool) -> dict:
    from hapt_hf.pipeline import portable
    rt, opt, sched = _start(plan)
    reader = _store(root, 0).reader(NAME, local=local)
    portable.load_portable(NAME, rt.stage, opt, reader)
    state = torch.load(Path(root) / "trainer.pt", weights_only=False)
    sched.load_state_dict(state["scheduler"])
    portable.apply_group_settings(opt, state["groups"])
    losses, lrs = _train(rt, opt, sched, _batches(rt.stage.config.vocab_size)[K:])
    return {**_end(rt, opt, losses, lrs), "stats": reader.stats,
            "remote_reads": slow_store.fetched_files()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    full = [o.value for o in run_ranks(write, 4, str(root), timeout_s=120)]
    shutil.rmtree(root / "node1")  # the lost node
    (root / "node0" / NAME / "__1_0.distcp").unlink()  # and a file node 0 lost
    out = {"root": root, "full": full}
    for plan, n, local in (("A", 4, False), ("C", 2, True), ("one", 1, False)):
        out[plan] = [o.value for o in run_ranks(resume, n, str(root), plan, local, timeout_s=120)]
    return out


def test_upload_completes_and_the_remote_copy_alone_resumes_bit_for_bit(runs):
    remote = runs["root"] / "remote" / NAME
    assert (remote / COMPLETE_MARKER).is_file()
    assert [o["files"] for o in runs["full"]] == [["__0_0.distcp", ".metadata"]] + [
        [f"__{r}_0.distcp"] for r in (1, 2, 3)]
    for a, b in zip(runs["full"], runs["A"]):
        assert b["stats"].local_bytes == 0 and b["stats"].fetched_bytes > 0
        assert b["losses"] == a["losses"] and b["lrs"] == a["lrs"]
        for n, p in a["params"].items():
            assert torch.equal(torch.from_numpy(b["params"][n]), torch.from_numpy(p)), n


def test_local_first_fetches_only_what_the_node_lacks_and_matches_one_process(runs):
    held = {"__0_0.distcp"}  # node 0's copy after losing rank 1's file
    fetched: set[str] = set()
    for o in runs["C"]:
        stats = o["stats"]
        assert set(stats.fetched_files) == set(o["remote_reads"]) - {".metadata", COMPLETE_MARKER}
        assert not held & set(stats.fetched_files) and set(stats.local_files) <= held
        fetched |= set(stats.fetched_files)
    assert fetched == {"__1_0.distcp", "__2_0.distcp", "__3_0.distcp"}
    assert sum(o["stats"].local_bytes for o in runs["C"]) > 0
    assert all(".metadata" not in o["remote_reads"] for o in runs["C"])  # node 0 holds it
    ref = runs["one"][0]
    for o in runs["C"]:
        assert o["lrs"] == ref["lrs"]
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0)
    got = _merged(runs["C"])
    assert got.keys() == ref["params"].keys()
    for n, p in ref["params"].items():
        torch.testing.assert_close(torch.from_numpy(got[n]), torch.from_numpy(p), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_a_remote_copy_without_its_marker_is_not_complete(runs):
    root = runs["root"]
    partial = root / "remote" / "checkpoint-9"
    shutil.copytree(root / "remote" / NAME, partial)
    (partial / COMPLETE_MARKER).unlink()
    (partial / "__3_0.distcp").unlink()  # rank 3's upload never came
    store = _store(str(root), 0)
    assert not store.is_complete("checkpoint-9") and store.latest_complete() == NAME
    with pytest.raises(CheckpointError, match=rf"no \{COMPLETE_MARKER} marker.*resume from "
                                              f"'{NAME}', the latest complete one"):
        store.reader("checkpoint-9")
