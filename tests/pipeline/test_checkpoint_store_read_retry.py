"""A recovery's requests to the remote (the marker's and the metadata's reads, the look for the
newest whole copy, the ranged fetches of the tensors) retried as a copy's are, on one process,
over the copy tests' memory filesystem whose reads also fail as told: a resume whose requests
fail a few times with transient errors restores the state a resume from a clean remote does,
byte for byte; one that keeps failing gives up after its attempts with an error naming the
request; a permanent error, or a file shorter than the metadata says, is not retried; a read
across a piece whose fetch failed raises that error rather than returning the bytes before it.
Rank 0's look for the markers an earlier save of the same name left is retried as well."""
from __future__ import annotations

import errno
import logging
import re
import warnings
from collections import Counter

import pytest
import torch
from fsspec.registry import register_implementation
from torch.distributed.checkpoint import CheckpointException

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline import checkpoint_store, portable
from hapt_hf.pipeline.checkpoint_store import COMPLETE_MARKER, METADATA_FILE, CheckpointStore
from tests.pipeline.test_checkpoint_store_retry import FlakyFileSystem

NAME = "checkpoint-1"
SHARD = "__0_0.distcp"
PIECE = 1000  # bytes per ranged GET here: the shard comes in several pieces


class FlakyReads(FlakyFileSystem):
    """The copy tests' memory filesystem whose reads of the names in :attr:`READ_FAULTS` fail
    too (``cat_file``, whole or a range, ``exists``, ``ls``)."""

    protocol = "flakyreads"
    store: dict = {}
    pseudo_dirs = [""]
    READ_FAULTS: dict[str, list] = {}
    """Base name -> [failures left, a function making the error, the first byte a failing read
    asks for (a ranged read of earlier bytes goes through)]."""
    READS: Counter = Counter()
    """Base name -> reads tried (of those :attr:`READ_FAULTS` names)."""
    RANGES: list = []
    """(base name, start, end, bytes returned) of each ranged read that succeeded."""

    @classmethod
    def reset(cls) -> None:
        super().reset()
        cls.READ_FAULTS.clear()
        cls.READS.clear()
        cls.RANGES.clear()

    def _read(self, path: str, start: int | None = None) -> None:
        name = self._strip_protocol(path).rstrip("/").rsplit("/", 1)[-1]
        fault = self.READ_FAULTS.get(name)
        if fault and (start or 0) >= fault[2]:
            self.READS[name] += 1
            if fault[0] > 0:
                fault[0] -= 1
                raise fault[1]()

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._read(path, start)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if start is not None:
            self.RANGES.append((path.rsplit("/", 1)[-1], start, end, len(data)))
        return data

    def exists(self, path, **kwargs):
        self._read(path)
        return super().exists(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        self._read(path)
        return super().ls(path, detail=detail, **kwargs)


register_implementation("flakyreads", FlakyReads, clobber=True)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(checkpoint_store, "FETCH_PIECE", PIECE)
    FlakyFileSystem.GATE = None
    FlakyReads.reset()
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield
    FlakyReads.READ_FAULTS.clear()


def _fail(name: str, times: int, error, from_byte: int = 0) -> None:
    FlakyReads.READ_FAULTS[name] = [times, error, from_byte]


def _store(tmp_path, **retry) -> CheckpointStore:
    return CheckpointStore(tmp_path / "local", "flakyreads://run", **{"upload_backoff_s": 0.001, **retry})


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 30x40 fp32 weights: 4800 bytes, a tensor over several pieces
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))


def _saved(tmp_path, **retry) -> tuple[CheckpointStore, torch.nn.Module, torch.optim.Optimizer]:
    store = _store(tmp_path, **retry)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 30)).sum().backward()
    opt.step()
    store.save(NAME, portable.portable_state_dict(model, opt)).wait(timeout_s=60)
    return store, model, opt


def _resume(store: CheckpointStore) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A recovery on a node whose disk lacks the checkpoint: find it, then fetch every tensor."""
    assert store.latest_complete() == NAME
    store.require_complete(NAME)
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    portable.load_portable(NAME, model, opt, store.reader(NAME, local=False))
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [opt.state[p][k] for p in model.parameters() for k in sorted(opt.state[p])]
    return [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


def _failure(err) -> BaseException:
    """The error a failed load raised: DCP holds a rank's error (and its traceback) in its own."""
    if isinstance(err.value, CheckpointException):
        failure = err.value.failures[0]
        return failure[0] if isinstance(failure, tuple) else failure
    return err.value


def _retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "hapt_hf.checkpoint" and r.levelno == logging.WARNING]


def test_a_resume_whose_fetches_fail_transiently_restores_the_clean_resumes_state(tmp_path, caplog):
    store, saved, saved_opt = _saved(tmp_path)
    clean = _state(*_resume(store))
    clean_ranges = sorted(FlakyReads.RANGES)
    assert clean == _state(saved, saved_opt)
    FlakyReads.RANGES.clear()
    _fail("run", 1, lambda: TimeoutError("LIST timed out"))  # latest_complete's look at the root
    _fail(COMPLETE_MARKER, 2, lambda: OSError(errno.EBUSY, "SlowDown, HTTP Status code: 503"))
    _fail(METADATA_FILE, 1, lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    # the ranged GETs past the first piece: two fail, then the rest go through
    _fail(SHARD, 2, lambda: OSError(errno.EIO, "We encountered an internal error"), from_byte=PIECE)
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        model, opt = _resume(store)
    assert _state(model, opt) == clean
    # each byte range came whole once, as from the clean remote: no failed attempt's part kept
    assert sorted(FlakyReads.RANGES) == clean_ranges and all(n == e - s for _, s, e, n in clean_ranges)
    failures = {"run": 1, COMPLETE_MARKER: 2, METADATA_FILE: 1, SHARD: 2}
    assert all(FlakyReads.READS[n] > k for n, k in failures.items()), FlakyReads.READS
    retries = _retries(caplog)
    assert len(retries) == sum(failures.values())  # each retry logged once
    assert any(m.startswith(f"rank 0: reading {NAME}/{COMPLETE_MARKER} from flakyreads://run failed "
                            "(attempt 2 of 5: OSError: ") and "SlowDown" in m and "retrying in" in m
               for m in retries), retries
    assert any(re.match(rf"rank 0: reading {NAME}/{SHARD} bytes {PIECE}\.\.\d+ from .* failed \(attempt 1 of 5",
                        m) for m in retries), retries


@pytest.mark.parametrize("name, from_byte", [(COMPLETE_MARKER, 0), (METADATA_FILE, 0), (SHARD, PIECE)],
                         ids=["marker", "metadata", "range"])
def test_a_read_that_keeps_failing_gives_up_after_its_attempts(tmp_path, caplog, name, from_byte):
    store, _, _ = _saved(tmp_path, upload_attempts=3)
    _fail(name, 10**6, lambda: TimeoutError("GET timed out"), from_byte)
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"), \
            pytest.raises((CheckpointError, CheckpointException)) as err:
        _resume(store)
    message = str(_failure(err))
    # the metadata's, too, not wrapped as a damaged checkpoint's
    assert isinstance(_failure(err), CheckpointError)
    assert re.match(rf"the remote copy 'flakyreads://run' did not answer a read \({NAME}/{re.escape(name)}"
                     r"( bytes \d+\.\.\d+)?: gave up after 3 attempt\(s\) of 3 in [\d.]+ s; last error "
                     r"TimeoutError: GET timed out\); resume again once it answers", message), message
    assert FlakyReads.READS[name] == 3 and len(_retries(caplog)) == 2


@pytest.mark.parametrize("error", [lambda: PermissionError(errno.EACCES, "Access Denied"),
                                   lambda: FileNotFoundError(errno.ENOENT, "The specified key does not exist"),
                                   lambda: OSError(errno.EINVAL, "InvalidArgument")],
                         ids=["permission", "missing", "invalid"])
def test_a_permanent_read_error_is_not_retried(tmp_path, caplog, error):
    store, _, _ = _saved(tmp_path, upload_backoff_s=5.0)  # a retry would wait seconds
    _fail(SHARD, 10**6, error, from_byte=PIECE)
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"), \
            pytest.raises(CheckpointException) as err:
        _resume(store)
    failure = _failure(err)
    assert type(failure) is type(error()) and str(failure) == str(error())  # raised as it came
    assert FlakyReads.READS[SHARD] == 1 and _retries(caplog) == []


def test_a_remote_file_shorter_than_the_metadata_says_is_not_retried(tmp_path, caplog):
    store, _, _ = _saved(tmp_path, upload_backoff_s=5.0)
    fs, root = store.remote_fs()
    fs.pipe_file(f"{root}/{NAME}/{SHARD}", fs.cat_file(f"{root}/{NAME}/{SHARD}")[:PIECE + 10])
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"), \
            pytest.raises(CheckpointException) as err:
        _resume(store)
    assert re.search(rf"{SHARD}: bytes {PIECE}\.\.\d+ asked, 10 came: the remote file is shorter",
                     str(_failure(err)))
    assert _retries(caplog) == []


@pytest.mark.parametrize("error, raised, attempts", [
    (lambda: TimeoutError("GET timed out"), rf"{SHARD} bytes {PIECE}\.\.{2 * PIECE}: gave up after 2", 2),
    (lambda: PermissionError(errno.EACCES, "Access Denied"), "Access Denied", 1)], ids=["gave-up", "permanent"])
def test_a_read_across_a_piece_whose_fetch_failed_raises_and_counts_no_part_as_read(tmp_path, error, raised,
                                                                                     attempts):
    store = _store(tmp_path, upload_attempts=2)
    fs, root = store.remote_fs()
    fs.pipe_file(f"{root}/{NAME}/{SHARD}", bytes(range(256)) * 10)
    _fail(SHARD, 10**6, error, from_byte=PIECE)
    reads = checkpoint_store._RemoteReads(fs, root, store)
    prefetch = checkpoint_store._Prefetch(reads, f"{root}/{NAME}", {SHARD: [(0, 2 * PIECE)]})
    try:
        stream = checkpoint_store._RangeFile(f"{root}/{NAME}/{SHARD}", SHARD, prefetch)
        buf = bytearray(PIECE + 10)  # the first piece came, the second never does
        with pytest.raises((CheckpointError, PermissionError), match=raised):
            stream.readinto(buf)
    finally:
        prefetch.close()
    assert FlakyReads.READS[SHARD] == attempts


def test_the_look_for_a_stale_marker_at_a_save_is_retried(tmp_path, caplog):
    store, _, _ = _saved(tmp_path)
    _fail(COMPLETE_MARKER, 2, lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        upload = store.save(NAME, portable.portable_state_dict(_model(2), None), start=False)
    assert FlakyReads.READS[COMPLETE_MARKER] == 3
    retries = _retries(caplog)
    assert len(retries) == 2 and all(
        m.startswith(f"rank 0: removing {COMPLETE_MARKER} of '{NAME}' from flakyreads://run failed (attempt ")
        and "ConnectionResetError" in m for m in retries), retries
    fs, root = store.remote_fs()
    assert not fs.exists(f"{root}/{NAME}/{COMPLETE_MARKER}")  # found, then removed
    upload.start().wait(timeout_s=60)
    assert store.is_complete(NAME)
