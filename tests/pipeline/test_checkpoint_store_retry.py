"""CheckpointStore's copy retries a request whose error may be transient, on one process, over a
remote (fsspec's memory filesystem) whose writes fail as told: a copy whose uploads and markers
fail a few times with transient errors completes and resumes byte-equal; one that keeps failing
gives up after its attempts, names why, leaves no marker and never held up the training that
went on meanwhile; a permanent error is not retried; the time bound stops the retries."""
from __future__ import annotations

import errno
import logging
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import register_implementation

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline import portable
from hapt_hf.pipeline.checkpoint_store import (COMPLETE_MARKER, METADATA_FILE, CheckpointStore,
                                               copy_whole, transient)

NAME = "checkpoint-1"
SHARD = "__0_0.distcp"


class FlakyFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem whose writes of the files named in :attr:`FAULTS` fail: each
    such write first leaves half of its bytes (as a connection lost mid-upload may), then raises."""

    protocol = "flaky"
    store: dict = {}  # its own, not the memory filesystem's
    pseudo_dirs = [""]
    FAULTS: dict[str, list] = {}
    """Base name -> [failures left, a function making the error]."""
    ATTEMPTS: Counter = Counter()
    """Base name -> writes tried."""
    GATE: threading.Event | None = None
    """Set: each failing write waits for it first."""
    REMOVE_FAULTS: dict[str, list] = {}
    """Base name -> [failures left, a function making the error, whether a failing removal
    removes the file before it raises (as one whose answer is lost does)]."""
    REMOVALS: Counter = Counter()
    """Base name -> removals tried."""

    @classmethod
    def reset(cls) -> None:
        """No files, no faults, nothing counted."""
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.FAULTS.clear()
        cls.ATTEMPTS.clear()
        cls.GATE = None
        cls.REMOVE_FAULTS.clear()
        cls.REMOVALS.clear()

    def _attempt(self, path: str, data: bytes) -> None:
        name = path.rsplit("/", 1)[-1]
        self.ATTEMPTS[name] += 1
        fault = self.FAULTS.get(name)
        if fault and fault[0] > 0:
            if self.GATE is not None:
                self.GATE.wait(30)
            fault[0] -= 1
            MemoryFileSystem.pipe_file(self, path, data[:len(data) // 2])
            raise fault[1]()

    def put_file(self, lpath, rpath, *args, **kwargs):
        self._attempt(self._strip_protocol(rpath), Path(lpath).read_bytes() if Path(lpath).exists() else b"")
        return super().put_file(lpath, rpath, *args, **kwargs)

    def pipe_file(self, path, value, *args, **kwargs):
        self._attempt(self._strip_protocol(path), value)
        return super().pipe_file(path, value, *args, **kwargs)

    def rm_file(self, path):
        name = self._strip_protocol(path).rsplit("/", 1)[-1]
        self.REMOVALS[name] += 1
        fault = self.REMOVE_FAULTS.get(name)
        if fault and fault[0] > 0:
            fault[0] -= 1
            if fault[2]:
                super().rm_file(path)
            raise fault[1]()
        return super().rm_file(path)


register_implementation("flaky", FlakyFileSystem, clobber=True)


@pytest.fixture(autouse=True)
def _fresh():
    FlakyFileSystem.reset()
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield
    FlakyFileSystem.REMOVE_FAULTS.clear()


def _fail(name: str, times: int, error) -> None:
    FlakyFileSystem.FAULTS[name] = [times, error]


def _store(tmp_path, **retry) -> CheckpointStore:
    retry = {"upload_backoff_s": 0.001, **retry}
    return CheckpointStore(tmp_path / "local", "flaky://run", **retry)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))


def _retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "hapt_hf.checkpoint" and r.levelno == logging.WARNING]


def test_transient_failures_are_retried_and_the_checkpoint_resumes_byte_equal(tmp_path, caplog):
    _fail(SHARD, 2, lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    _fail(METADATA_FILE, 1, lambda: TimeoutError("PUT timed out"))
    _fail(".uploaded-0", 1, lambda: OSError(errno.EIO, "We encountered an internal error"))
    _fail(COMPLETE_MARKER, 2, lambda: OSError(errno.EBUSY, "SlowDown, HTTP Status code: 503"))
    store = _store(tmp_path)
    model = _model()
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        store.save(NAME, portable.portable_state_dict(model, None)).wait(timeout_s=60)
    assert FlakyFileSystem.ATTEMPTS == {SHARD: 3, METADATA_FILE: 2, ".uploaded-0": 2, COMPLETE_MARKER: 3}
    retries = _retries(caplog)
    assert len(retries) == 6  # each retry logged once
    assert any(SHARD in m and "attempt 1 of 5" in m and "ConnectionResetError" in m
               and "retrying in" in m for m in retries)
    assert any(SHARD in m and "attempt 2 of 5" in m for m in retries)
    assert any(COMPLETE_MARKER in m and "attempt 2 of 5" in m and "SlowDown" in m for m in retries)
    fs, root = store.remote_fs()
    local = tmp_path / "local" / NAME
    for f in (SHARD, METADATA_FILE):  # the half-written attempts were overwritten whole
        assert fs.cat_file(f"{root}/{NAME}/{f}") == (local / f).read_bytes()
    assert store.is_complete(NAME) and store.latest_complete() == NAME
    again = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
    reader = store.reader(NAME, local=False)
    portable.load_portable(NAME, again, None, reader)
    assert reader.stats.fetched_files == [SHARD] and reader.stats.local_bytes == 0
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_a_copy_that_keeps_failing_gives_up_leaves_no_marker_and_training_goes_on(tmp_path, caplog):
    _fail(SHARD, 10**6, lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    FlakyFileSystem.GATE = threading.Event()  # the copy's first attempt waits for the step below
    store = _store(tmp_path, upload_attempts=3)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        upload = store.save(NAME, portable.portable_state_dict(model, None))
        assert not upload.done  # save returned while its copy is under way
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(4, 8)).sum().backward()  # a training step meanwhile
        opt.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        FlakyFileSystem.GATE.set()
        with pytest.raises(CheckpointError, match=rf"upload of '{NAME}' .* failed on rank 0 "
                                                  r"\(ConnectionResetError: .*Connection reset by peer; "
                                                  rf"{SHARD}: gave up after 3 attempt\(s\) of 3 in .* s\); "
                                                  r"the local copy in .* is intact, the remote copy is "
                                                  r"incomplete"):
            upload.wait(timeout_s=60)
    assert FlakyFileSystem.ATTEMPTS[SHARD] == 3
    assert len(_retries(caplog)) == 2  # attempts 1 and 2 retried, the 3rd gives up
    fs, root = store.remote_fs()
    remote = f"{root}/{NAME}"
    # the last attempt left half the file: no marker, so the copy is not whole
    assert 0 < fs.size(f"{remote}/{SHARD}") < (tmp_path / "local" / NAME / SHARD).stat().st_size
    assert not fs.exists(f"{remote}/{COMPLETE_MARKER}") and not fs.exists(f"{remote}/.uploaded-0")
    assert not copy_whole(remote, fs) and not store.is_complete(NAME) and store.latest_complete() is None
    with pytest.raises(CheckpointError, match="has no .complete marker"):
        store.reader(NAME)


def test_a_marker_that_keeps_failing_is_not_left_in_part(tmp_path):
    _fail(COMPLETE_MARKER, 10**6, lambda: TimeoutError("PUT timed out"))
    store = _store(tmp_path, upload_attempts=2)
    upload = store.save(NAME, portable.portable_state_dict(_model(), None))
    with pytest.raises(CheckpointError, match=rf"TimeoutError: PUT timed out; {COMPLETE_MARKER}: gave up "
                                              r"after 2 attempt\(s\) of 2"):
        upload.wait(timeout_s=60)
    assert FlakyFileSystem.ATTEMPTS[COMPLETE_MARKER] == 2
    fs, root = store.remote_fs()
    assert fs.exists(f"{root}/{NAME}/{METADATA_FILE}")  # every file is up, the marker is not
    assert not fs.exists(f"{root}/{NAME}/{COMPLETE_MARKER}") and not store.is_complete(NAME)


def _saved_before(store: CheckpointStore) -> bytes:
    """An earlier save of NAME, whole on the remote; its .complete marker."""
    store.save(NAME, portable.portable_state_dict(_model(), None)).wait(timeout_s=60)
    fs, root = store.remote_fs()
    return fs.cat_file(f"{root}/{NAME}/{COMPLETE_MARKER}")


def test_a_stale_markers_removal_that_fails_transiently_is_retried_and_the_save_goes_on(tmp_path, caplog):
    store = _store(tmp_path)
    before = _saved_before(store)
    fs, root = store.remote_fs()
    FlakyFileSystem.REMOVALS.clear()
    FlakyFileSystem.REMOVE_FAULTS[COMPLETE_MARKER] = [
        2, lambda: OSError(errno.EBUSY, "SlowDown, HTTP Status code: 503"), False]
    # its answer lost: the marker is gone when the removal is retried, which is not an error
    FlakyFileSystem.REMOVE_FAULTS[".uploaded-0"] = [1, lambda: TimeoutError("DELETE timed out"), True]
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        upload = store.save(NAME, portable.portable_state_dict(_model(), None), start=False)
    assert FlakyFileSystem.REMOVALS == {COMPLETE_MARKER: 3, METADATA_FILE: 1, ".uploaded-0": 2}
    for marker in (COMPLETE_MARKER, METADATA_FILE, ".uploaded-0"):  # gone before this save's copy starts
        assert not fs.exists(f"{root}/{NAME}/{marker}")
    retries = _retries(caplog)
    assert len(retries) == 3  # each retry logged once
    assert any(m.startswith(f"rank 0: removing {COMPLETE_MARKER} of '{NAME}' from flaky://run failed "
                            "(attempt 2 of 5: OSError: ") and "SlowDown" in m and "retrying in" in m
               for m in retries), retries
    assert any(".uploaded-0" in m and "attempt 1 of 5: TimeoutError: DELETE timed out" in m for m in retries)
    upload.start().wait(timeout_s=60)
    after = fs.cat_file(f"{root}/{NAME}/{COMPLETE_MARKER}")
    assert store.is_complete(NAME) and after != before  # this save's marker, of its own id
    assert upload.save_id.encode() in after


def test_a_save_over_an_earlier_one_is_not_whole_until_its_own_marker(tmp_path):
    """A save of a name an earlier save left whole: from the moment this one starts overwriting
    its files until its own ``.complete``, the remote copy is not whole, and after a copy that
    failed it stays so (the earlier save's metadata no longer says it is)."""
    store = _store(tmp_path, upload_attempts=2)
    _saved_before(store)
    fs, root = store.remote_fs()
    remote = f"{root}/{NAME}"
    upload = store.save(NAME, portable.portable_state_dict(_model(), None), start=False)
    assert not copy_whole(remote, fs) and not store.is_complete(NAME)  # before any file moves
    _fail(SHARD, 10**6, lambda: PermissionError(errno.EACCES, "Access Denied"))
    with pytest.raises(CheckpointError, match="the remote copy is incomplete"):
        upload.start().wait(timeout_s=60)
    assert not copy_whole(remote, fs) and not store.is_complete(NAME) and store.latest_complete() is None


@pytest.mark.parametrize("error, attempts", [(lambda: PermissionError(errno.EACCES, "Access Denied"), 1),
                                             (lambda: TimeoutError("DELETE timed out"), 3)],
                         ids=["permanent", "gives-up"])
def test_a_stale_markers_removal_that_fails_for_good_fails_the_save(tmp_path, caplog, error, attempts):
    store = _store(tmp_path, upload_attempts=3)
    before = _saved_before(store)
    FlakyFileSystem.REMOVALS.clear()
    FlakyFileSystem.REMOVE_FAULTS[COMPLETE_MARKER] = [10**6, error, False]
    shard = tmp_path / "local" / NAME / SHARD
    shard.unlink()
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"), \
            pytest.raises(type(error())) as err:
        store.save(NAME, portable.portable_state_dict(_model(), None))
    assert str(err.value) == str(error())  # raised as it came
    assert FlakyFileSystem.REMOVALS == {COMPLETE_MARKER: attempts} and len(_retries(caplog)) == attempts - 1
    assert not shard.exists()  # nothing of this save written
    fs, root = store.remote_fs()
    assert fs.cat_file(f"{root}/{NAME}/{COMPLETE_MARKER}") == before and store.is_complete(NAME)


@pytest.mark.parametrize("error", [lambda: PermissionError(errno.EACCES, "Access Denied"),
                                   lambda: FileNotFoundError(errno.ENOENT, "The specified bucket does not exist"),
                                   lambda: OSError(errno.EINVAL, "InvalidArgument")],
                         ids=["permission", "no-bucket", "invalid"])
def test_a_permanent_error_is_not_retried(tmp_path, caplog, error):
    _fail(SHARD, 10**6, error)
    store = _store(tmp_path, upload_backoff_s=5.0)  # a retry would wait seconds
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        upload = store.save(NAME, portable.portable_state_dict(_model(), None))
        with pytest.raises(CheckpointError, match=r"failed on rank 0 \((PermissionError|FileNotFoundError|"
                                                  r"OSError): [^;]*\); the local copy"):
            upload.wait(timeout_s=4)
    assert FlakyFileSystem.ATTEMPTS[SHARD] == 1 and _retries(caplog) == []
    assert upload.gave_up == "" and not store.is_complete(NAME)


def test_a_missing_local_file_is_not_retried(tmp_path, caplog):
    store = _store(tmp_path, upload_backoff_s=5.0)
    upload = store.save(NAME, portable.portable_state_dict(_model(), None), start=False)
    (tmp_path / "local" / NAME / SHARD).unlink()
    with caplog.at_level(logging.WARNING, logger="hapt_hf.checkpoint"):
        upload.start()
        with pytest.raises(CheckpointError, match=rf"FileNotFoundError: .*{SHARD}"):
            upload.wait(timeout_s=4)
    assert FlakyFileSystem.ATTEMPTS[SHARD] == 1 and _retries(caplog) == []


def test_the_time_bound_stops_the_retries(tmp_path):
    _fail(SHARD, 10**6, lambda: TimeoutError("PUT timed out"))
    # waits of at least 10, 20, 40, 80 ms: a 0.1 s bound allows at most 4 attempts of 50
    store = _store(tmp_path, upload_attempts=50, upload_backoff_s=0.02, upload_retry_s=0.1)
    upload = store.save(NAME, portable.portable_state_dict(_model(), None))
    with pytest.raises(CheckpointError, match=rf"{SHARD}: gave up after \d attempt\(s\) of 50"):
        upload.wait(timeout_s=30)
    assert 2 <= FlakyFileSystem.ATTEMPTS[SHARD] <= 4


def test_which_errors_are_transient():
    class HttpError(Exception):
        def __init__(self, code):
            super().__init__(f"HTTP {code}")
            self.code = code

    for error in [TimeoutError(), ConnectionResetError(), BrokenPipeError(), OSError(errno.EBUSY, "SlowDown"),
                  OSError(errno.EIO, "internal error"), OSError(errno.ETIMEDOUT, "timed out"),
                  HttpError(503), HttpError(429)]:
        assert transient(error), error
    for error in [PermissionError(errno.EACCES, "denied"), FileNotFoundError(), NotADirectoryError(),
                  FileExistsError(), OSError(errno.EINVAL, "bad"), OSError("no code"), ValueError(),
                  HttpError(404), HttpError(403), KeyError("code")]:
        assert not transient(error), error


@pytest.mark.parametrize("settings", [{"upload_attempts": 0}, {"upload_attempts": 2.5},
                                      {"upload_backoff_s": -1}, {"upload_retry_s": "10"}])
def test_bad_retry_settings_are_refused(tmp_path, settings):
    with pytest.raises(CheckpointError, match=f"{next(iter(settings))} is"):
        CheckpointStore(tmp_path / "local", "flaky://run", **settings)
