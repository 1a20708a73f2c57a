"""The local-first reader's tensors read straight into the tensors they load into (read_direct).

One process: a checkpoint of tensors of several dtypes and shapes (a scalar, an empty tensor, a
transposed tensor, a slice of a larger one) and of non-tensor values, read with DCP's own file
reader and with the local-first reader into tensors of which some take the direct read (whole,
contiguous, the same dtype and shape) and the others not (a non-contiguous tensor, another
dtype): the same bytes in every tensor, and the direct reads exactly the tensors that qualify.
A record whose bytes are in the other byte order is not read directly.

Gloo ranks: a 4-rank checkpoint whose first stage shards its Adam state between two replicas
(the portable-resume harness's plan A, one step), read on 4 ranks of another split: its first
stage's Adam state sharded among its two replicas otherwise than plan A's, its second stage one
tensor-parallel replica (each rank reads its slice of the sharded projections and of their Adam
state, which DCP's own path narrows): each rank's parameters and optimizer state, read by both
readers, are equal byte for byte.
"""
from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks import slow_store  # noqa: F401 - registers throttled:// (in the ranks too)
from benchmarks.ranks import run_ranks
from hapt_hf.compat.torch_api import saved_tensor_layout
from hapt_hf.pipeline.checkpoint_store import CheckpointStore


@pytest.fixture
def _quiet():
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _destinations() -> dict:
    return {"a": torch.full((40, 30), 7.0), "b": torch.zeros(7, dtype=torch.bfloat16),
            "step": torch.tensor(0.0), "ids": torch.zeros(10, dtype=torch.int64),
            "transposed": torch.zeros(30, 40), "part": torch.zeros(4, 30), "empty": torch.zeros(0, 3),
            "into_transposed": torch.zeros(4, 6).t(), "to_double": torch.zeros(3, dtype=torch.float64),
            "extra": {"n": 0, "names": []}}


def test_direct_reads_give_the_bytes_dcps_own_reader_gives(tmp_path, _quiet):
    torch.manual_seed(0)
    big = torch.randn(40, 30)
    state = {"a": torch.randn(40, 30), "b": torch.randn(7).to(torch.bfloat16), "step": torch.tensor(3.0),
             "ids": torch.arange(10), "transposed": big.t(), "part": big[5:9], "empty": torch.empty(0, 3),
             "into_transposed": torch.randn(6, 4),
             "to_double": torch.tensor([float("nan"), -0.0, float("inf")]),
             "extra": {"n": 1, "names": ["x", "y"]}}
    store = CheckpointStore(tmp_path / "local", f"throttled://{tmp_path}/remote")
    store.save("checkpoint-1", state).wait()
    stock = _destinations()
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path / "local" / "checkpoint-1")))
    direct = _destinations()
    reader = store.reader("checkpoint-1")
    dcp.load(direct, storage_reader=reader)
    assert direct["extra"] == stock["extra"] == state["extra"]
    for name, t in stock.items():
        if name != "extra":
            assert direct[name].dtype == t.dtype and torch.equal(_bits(direct[name]), _bits(t)), name
    qualify = ("a", "b", "step", "ids", "part")  # the saved slice is a tensor of its own
    assert reader.stats.direct_bytes == sum(state[n].numel() * state[n].element_size() for n in qualify)
    assert reader.stats.fetched_bytes == 0 and reader.stats.local_bytes > reader.stats.direct_bytes


def test_a_record_in_the_other_byte_order_is_not_read_directly(monkeypatch):
    other = "big" if sys.byteorder == "little" else "little"
    with monkeypatch.context() as m:
        m.setattr(sys, "byteorder", other)  # as torch.save writes it on such a machine
        record = io.BytesIO()
        torch.save(torch.arange(4.0), record)
    record.seek(0)
    assert saved_tensor_layout(record) is None
    ours = io.BytesIO()
    torch.save(torch.arange(4.0), ours)
    ours.seek(0)
    meta, start = saved_tensor_layout(ours)
    assert meta.is_meta and meta.shape == (4,) and meta.dtype == torch.float32
    assert ours.getvalue()[start:start + 16] == torch.arange(4.0).numpy().tobytes()


NAME = "checkpoint-1"


def write(rank: int, world_size: int, root: str) -> None:
    from hapt_hf.pipeline import portable
    from tests.pipeline.test_portable_resume import _batches, _start, _train
    rt, opt, sched = _start("A")
    _train(rt, opt, sched, _batches(rt.stage.config.vocab_size)[:1])
    store = CheckpointStore(Path(root) / "node", f"throttled://{root}/remote")
    store.save(NAME, portable.portable_state_dict(rt.stage, opt)).wait()
    rt.shutdown()


def _held(rt, opt) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state, as bytes."""
    out = {}
    state = getattr(opt, "optim", opt).state
    for name, p in rt.stage.named_parameters():
        out[name] = _bits(p.to_local() if hasattr(p, "to_local") else p).clone()
        for key, value in state.get(p, {}).items():
            out[f"{name}.{key}"] = _bits(value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def _start_resharded():
    """Layers [0, 3) on ranks 0 and 1, their Adam state sharded (other parameters per shard than
    plan A's), [3, 5) on one tensor-parallel replica of ranks 2 and 3."""
    from hapt_hf.pipeline import PipelineRuntime, RuntimeConfig
    from hapt_hf.planner.plan import Plan
    from tests.pipeline.test_portable_resume import G, LAYERS, MBS, SEQ, M, _config, _stage
    stages = (_stage(0, 2, (0, 3), (0, 1), "sharded"), _stage(1, 2, (3, 5), (2, 3), "tp"))
    torch.manual_seed(0)
    rt = PipelineRuntime(Plan("llama-tiny", LAYERS, SEQ, G, MBS, M, "1f1b", stages).validate(4), _config(),
                         RuntimeConfig(timeout_s=60))
    return rt, rt.make_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)


def read_both(rank: int, world_size: int, root: str) -> dict:
    from hapt_hf.pipeline import portable
    rt, opt = _start_resharded()
    portable.load_portable(Path(root) / "node" / NAME, rt.stage, opt)  # DCP's own file reader
    stock = _held(rt, opt)
    with torch.no_grad():
        for p in rt.stage.parameters():
            p.fill_(float("nan"))  # what the second read must overwrite
    reader = CheckpointStore(Path(root) / "node", f"throttled://{root}/remote").reader(NAME)
    portable.load_portable(NAME, rt.stage, opt, reader)
    direct = _held(rt, opt)
    rt.shutdown()
    return {"names": sorted(stock), "differ": sorted(n for n in stock if not torch.equal(stock[n], direct[n])),
            "stats": reader.stats}


@pytest.mark.multiproc
def test_resharded_and_sharded_reads_are_byte_for_byte_dcps_own(tmp_path):
    run_ranks(write, 4, str(tmp_path), timeout_s=120)
    reads = [o.value for o in run_ranks(read_both, 4, str(tmp_path), timeout_s=120)]
    for o in reads:
        assert o["names"] and not o["differ"], o["differ"]
        assert o["stats"].fetched_bytes == 0 and o["stats"].direct_bytes > 0
    # the tensor-parallel ranks' slices are not whole saved tensors: DCP's own path reads them
    assert all(o["stats"].direct_bytes < o["stats"].local_bytes for o in reads[2:])
