"""The local-first reader's fetch of remote byte ranges (one process, no process group): in
ranged GETs no longer than FETCH_PIECE, each byte once, a tensor longer than FETCH_AHEAD
included, the load exact; a fetch that fails is raised by the load, not waited on."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

from benchmarks import slow_store
from hapt_hf.pipeline import checkpoint_store, portable
from hapt_hf.pipeline.checkpoint_store import CheckpointStore

PIECE, AHEAD = 1000, 3000


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    monkeypatch.setattr(checkpoint_store, "FETCH_PIECE", PIECE)
    monkeypatch.setattr(checkpoint_store, "FETCH_AHEAD", AHEAD)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 40x30 fp32: 4800 bytes, longer than AHEAD
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5), torch.nn.Linear(5, 3))


def _saved(tmp_path) -> tuple[CheckpointStore, torch.nn.Module, torch.optim.Optimizer]:
    store = CheckpointStore(tmp_path / "local", f"throttled://{tmp_path}/remote")
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 30)).sum().backward()
    opt.step()
    store.save("checkpoint-1", portable.portable_state_dict(model, opt)).wait()
    return store, model, opt


def test_remote_ranges_come_in_pieces_each_byte_once_and_the_load_is_exact(tmp_path):
    store, model, saved = _saved(tmp_path)
    again = _model(1)
    opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    reader = store.reader("checkpoint-1", local=False)
    slow_store.reset()
    portable.load_portable("checkpoint-1", again, opt, reader)
    shard = [(s, e) for path, s, e in slow_store.FETCHES if path.endswith("__0_0.distcp")]
    assert len(shard) > 4 and all(0 < e - s <= PIECE for s, e in shard)
    assert sorted(shard) == shard and all(a[1] <= b[0] for a, b in zip(shard, shard[1:]))
    assert sum(e - s for s, e in shard) >= reader.stats.fetched_bytes > 4800
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(saved.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_a_fetch_that_fails_fails_the_load(tmp_path):
    store, _, _ = _saved(tmp_path)
    reader = store.reader("checkpoint-1", local=False)
    (tmp_path / "remote" / "checkpoint-1" / "__0_0.distcp").write_bytes(b"")  # cut short remotely
    with pytest.raises(CheckpointException) as err:  # DCP's, holding each rank's error
        portable.load_portable("checkpoint-1", _model(1), None, reader)
    assert re.search(r"__0_0.distcp: bytes \d+..\d+ asked, 0 came", str(err.value.failures[0]))
