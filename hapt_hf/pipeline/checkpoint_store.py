"""Local-first checkpoints: each rank's shards on its node's disk, a copy on shared or remote storage.

A :class:`CheckpointStore` names two places for a run's checkpoints: ``local_dir``, a directory
on the node's own disk (every rank of a node may share it), and ``remote``, any fsspec URL every
node can reach (a shared directory, ``s3://bucket/run`` where s3fs is installed, ...).

:meth:`CheckpointStore.save` writes with ``torch.distributed.checkpoint`` (DCP): each rank's
``FileSystemWriter`` puts the rank's own files (``__{rank}_{i}.distcp``) into
``local_dir/<name>`` and rank 0 the ``.metadata`` that names every tensor's file, offset and
length. The call returns once the local write is done; a thread per rank then copies the
rank's files to ``remote/<name>`` (:class:`Upload`) while training goes on, and writes
``.uploaded-{rank}`` when they are all there. Rank 0's thread, after its own files, waits for
every rank's ``.uploaded-{rank}``, then copies the metadata and writes ``.complete`` last: a
remote checkpoint without it (a rank died mid-upload, the job was killed) is never taken as
complete (:meth:`CheckpointStore.require_complete`, :meth:`CheckpointStore.latest_complete`),
and one with DCP's ``.metadata`` holds every file it names.

On recovery, :meth:`CheckpointStore.reader` gives a DCP ``StorageReader``
(:class:`LocalFirstReader`): the remote copy's layout, each file opened from ``local_dir`` where
this node holds it whole, else from the remote through fsspec, reading only the byte ranges of
the items this rank asks for: one thread fetches them (ranged GETs of at most
:data:`FETCH_PIECE` bytes, at most :data:`FETCH_AHEAD` bytes ahead of the reads) while the
local files, then the pieces already fetched, are read. A local file's tensor whose record
holds the whole of the tensor it loads into (contiguous, of its dtype and shape) is read straight
into that tensor's memory (:func:`~hapt_hf.pipeline.direct_read.read_direct`: one read of its
bytes, where DCP's own path deserialises a copy of them and copies that); the rest goes through
DCP's own path. After a load, :attr:`LocalFirstReader.stats` says what came from
where; the reader logs one line of it.

Every request of a copy (rank 0's looks for and removals of the markers an earlier save of the
same name left, each file's upload, each marker's write, rank 0's look for the other ranks'
markers), and every request of a recovery to the remote (the look for the newest whole
copy, the marker's and the metadata's reads, each ranged fetch: :class:`_RemoteReads`), goes
through one rule (:func:`retried`): it is retried where its error is plausibly transient
(:func:`transient`: a timeout, a reset or refused connection, an object store's "slow down" or
5xx) after a wait of ``upload_backoff_s`` doubling each time, times a random factor in
[0.5, 1], at most ``upload_attempts`` attempts and ``upload_retry_s`` seconds per request (the
store's settings, the copy's and the recovery's alike); an error no retry can mend (permission
denied, no such bucket or path, a local file missing) fails the copy, or the recovery, at once,
and a read whose retries give up raises a :class:`~hapt_hf.errors.CheckpointError` naming it.
fsspec's generic layer does not retry; s3fs and gcsfs retry some errors inside each request,
and these retries come on top of theirs. A request retried overwrites what its failed attempt
may have left, and the rule that says a copy is whole (:func:`copy_whole`) reads the markers
alone, each written only after every file before it is up; a ranged fetch keeps only an
attempt that brought every byte it asked for.
"""
from __future__ import annotations

import bisect
import dataclasses
import errno
import io
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase

from hapt_hf.errors import CheckpointError
from hapt_hf.pipeline.direct_read import read_direct

__all__ = ["CheckpointStore", "Upload", "LocalFirstReader", "ReadStats", "METADATA_FILE",
           "COMPLETE_MARKER", "copy_whole", "copy_unfinished", "transient", "retried",
           "retry_setting_problem"]

logger = logging.getLogger("hapt_hf.checkpoint")

METADATA_FILE = ".metadata"
"""DCP's file naming every tensor of a checkpoint (written by rank 0)."""
COMPLETE_MARKER = ".complete"
"""Written last into the remote copy, once every rank's files and the metadata are there."""
UPLOADED = ".uploaded-{rank}"
"""Written into the remote copy by each rank once its own files are there."""
SAVE_ID_SUFFIX = ".save-id"
"""Beside each local file: the id of the save that wrote it (the remote's marker names it)."""
FAILED = ".failed-{rank}"
"""Written (if it can be) by a rank whose copy failed, so that rank 0 stops waiting for it."""


MAX_BACKOFF_S = 60.0
"""The longest wait between two attempts of one request, however many attempts are allowed."""
TRANSIENT_ERRNOS = frozenset({errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.EBUSY,
                              errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                              errno.ECONNREFUSED, errno.EPIPE, errno.ENETDOWN, errno.ENETUNREACH,
                              errno.ENETRESET, errno.EHOSTUNREACH})
"""An ``OSError``'s codes that a retry may mend (s3fs raises EBUSY for a 503 or "SlowDown",
EREMOTEIO for a 500, EIO for an error it does not know)."""
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses that a retry may mend (an error of another class that carries one)."""
_JITTER = random.Random()  # not the global generator: training's Python RNG state is checkpointed


def transient(error: BaseException) -> bool:
    """Whether a request that raised ``error`` may succeed if tried again: a timeout, a
    connection error, an ``OSError`` whose code is in :data:`TRANSIENT_ERRNOS`, or an error
    carrying an HTTP status in :data:`TRANSIENT_STATUS`; never a permission error or a path
    that is not there (nor is, or is not, a directory)."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, OSError):
        return not isinstance(error, (PermissionError, FileNotFoundError, FileExistsError,
                                      NotADirectoryError, IsADirectoryError)) \
            and error.errno in TRANSIENT_ERRNOS
    status = next((s for s in (getattr(error, a, None) for a in ("status", "status_code", "code"))
                   if isinstance(s, int)), None)
    return status in TRANSIENT_STATUS


def retried(request: Callable[[], Any], store: CheckpointStore, doing: str, what: str,
            gave_up: Callable[[str], None] | None = None) -> Any:
    """``request()``, one request to ``store``'s remote about ``what`` (a file, a marker, a
    byte range), tried again after an error :func:`transient` says a retry may mend: after
    ``store.upload_backoff_s`` doubled at each attempt (at most :data:`MAX_BACKOFF_S`) times a
    random factor in [0.5, 1], for at most ``store.upload_attempts`` attempts and
    ``store.upload_retry_s`` seconds. Each retry is logged once (WARNING): ``doing`` (who does
    what: ``rank 1: copying X of 'checkpoint-5' to s3://...``), then ``failed (attempt 1 of 5:
    error); retrying in 0.71 s``. Any other error, or the last attempt's, is raised as it came;
    the last after ``gave_up`` is told where the retries stopped (``X: gave up after 5
    attempt(s) of 5 in 9.3 s``). The copy (:class:`Upload`) and a recovery's reads
    (:meth:`CheckpointStore.reader`) both send their requests through it."""
    attempts, start = store.upload_attempts, time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            return request()
        except Exception as e:
            if not transient(e):
                raise
            spent = time.monotonic() - start
            wait = min(store.upload_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S) \
                * _JITTER.uniform(0.5, 1.0)
            if attempt == attempts or spent + wait > store.upload_retry_s:
                if gave_up is not None:
                    gave_up(f"{what}: gave up after {attempt} attempt(s) of {attempts} in {spent:.1f} s")
                raise
            logger.warning("%s failed (attempt %d of %d: %s: %s); retrying in %.2f s",
                           doing, attempt, attempts, type(e).__name__, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")


def copy_whole(directory: str | os.PathLike, fs: Any = None) -> bool:
    """The one rule for "this checkpoint's copy is whole", wherever it is asked: a copy that
    :class:`Upload` filled (a rank's ``.uploaded-N`` is there) is whole once its
    ``.complete`` marker is; a directory DCP wrote itself, once DCP's ``.metadata`` (written
    last) is. ``fs``: the fsspec filesystem ``directory`` is on (a remote copy); None: a path
    on this machine."""
    if fs is None:
        fs, directory = fsspec.filesystem("file"), str(Path(directory).absolute())
    path = str(directory)
    if fs.exists(_join(path, COMPLETE_MARKER)):
        return True
    return fs.exists(_join(path, METADATA_FILE)) and not fs.glob(_join(path, UPLOADED.format(rank="*")))


def copy_unfinished(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` (a remote copy on a mounted path) is one a copy began to fill and
    did not complete: a rank's files are there, and by :func:`copy_whole` it is not whole."""
    return any(Path(directory).glob(UPLOADED.format(rank="*"))) and not copy_whole(directory)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's own file writer that remembers the files this rank wrote (and, on the
    coordinator, the metadata), so that exactly those are copied."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, overwrite=True)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in fut.wait()})
        return fut

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.append(METADATA_FILE)


class Upload:
    """The background copy of one rank's files of one checkpoint to the remote.

    Made by :meth:`CheckpointStore.save` (and started there, unless ``start=False``: then by
    :meth:`start`); :meth:`wait` joins it and raises what went wrong as a
    :class:`~hapt_hf.errors.CheckpointError`. On rank 0 it ends after writing the checkpoint's
    ``.complete`` marker, having waited for every rank's upload (or seen one's ``.failed-N``)."""

    def __init__(self, store: CheckpointStore, name: str, files: list[str], rank: int,
                 world_size: int, save_id: str = "") -> None:
        self.store, self.name, self.files = store, name, files
        self.rank, self.world_size, self.save_id = rank, world_size, save_id
        self.error: BaseException | None = None
        self.gave_up = ""
        """Where the copy stopped retrying a transient error: the file, attempts and time."""
        self.seconds = 0.0
        """How long the copy took (set when it ends)."""
        self._thread = threading.Thread(target=self._run, name=f"hapt-upload-{name}", daemon=True)

    def start(self) -> Upload:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until this rank's part is uploaded (on rank 0: until the marker is written)."""
        if self._thread.ident is None:
            raise CheckpointError(f"the upload of {self.name!r} was never started (Upload.start)")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise CheckpointError(f"the upload of {self.name!r} to {self.store.remote!r} did not "
                                  f"finish within {timeout_s} s; check that the remote is reachable")
        if self.error is not None:
            raise CheckpointError(f"the upload of {self.name!r} to {self.store.remote!r} failed "
                                  f"on rank {self.rank} ({type(self.error).__name__}: "
                                  f"{self.error}{'; ' + self.gave_up if self.gave_up else ''}); "
                                  f"the local copy in {str(self.store.local_dir)!r} "
                                  "is intact, the remote copy is incomplete") from None

    def _run(self) -> None:
        start = time.monotonic()
        try:
            fs, root = self.store.remote_fs()
            remote = _join(root, self.name)
            self._retried(remote, fs.makedirs, remote, exist_ok=True)
            local = self.store.local_path(self.name)
            sizes = {}
            for f in self.files:
                if f != METADATA_FILE:
                    self._retried(f, fs.put_file, str(local / f), _join(remote, f))
                    sizes[f] = (local / f).stat().st_size
            self._write_marker(fs, _join(remote, UPLOADED.format(rank=self.rank)),
                               json.dumps(sizes).encode())
            if self.rank == 0:
                self._mark_complete(fs, remote, local)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self.error = e
            if self.rank != 0:
                self._report_failure(e)
        self.seconds = time.monotonic() - start

    def _retried(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, a request of this copy about ``what`` (a file, a marker),
        through :func:`retried` with the store's settings; where it gives up, :attr:`gave_up`
        says so."""
        return retried(lambda: call(*args, **kwargs), self.store,
                       f"rank {self.rank}: copying {what} of {self.name!r} to {self.store.remote}",
                       what, self._gave_up)

    def _gave_up(self, note: str) -> None:
        self.gave_up = note

    def _write_marker(self, fs, path: str, data: bytes) -> None:
        """Write a marker (retried); one its last attempt may have left in part is removed,
        so that the marker is there only if it was written."""
        try:
            self._retried(path.rsplit("/", 1)[-1], fs.pipe_file, path, data)
        except Exception:
            try:
                if fs.exists(path):
                    fs.rm_file(path)
            except Exception:  # noqa: BLE001 - the remote itself may be what failed
                pass
            raise

    def _report_failure(self, error: BaseException) -> None:
        note = self.gave_up  # the copy's own, not this report's
        try:
            fs, root = self.store.remote_fs()
            self._retried(FAILED.format(rank=self.rank), fs.pipe_file,
                          _join(_join(root, self.name), FAILED.format(rank=self.rank)),
                          f"{type(error).__name__}: {error}".encode())
        except Exception:  # noqa: BLE001 - the remote itself may be what failed
            pass
        self.gave_up = note

    def _mark_complete(self, fs, remote: str, local: Path) -> None:
        """Once every rank's files are there: the metadata, then the marker (so that a remote
        copy with DCP's ``.metadata`` holds every file it names, as one DCP wrote does)."""
        deadline = time.monotonic() + self.store.upload_timeout_s
        wanted = [_join(remote, UPLOADED.format(rank=r)) for r in range(self.world_size)]
        def there(path: str) -> bool:
            return self._retried(path.rsplit("/", 1)[-1], fs.exists, path)

        while missing := [w for w in wanted if not there(w)]:
            failed = [r for r in range(1, self.world_size)
                      if there(_join(remote, FAILED.format(rank=r)))]
            if failed:
                raise RuntimeError(f"the copy of rank(s) {failed} failed (see their "
                                   f"{FAILED.format(rank='N')} in the remote copy)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} rank(s) never finished uploading "
                                   f"(no {', '.join(m.rsplit('/', 1)[1] for m in missing)})")
            time.sleep(self.store.poll_s)
        self._retried(METADATA_FILE, fs.put_file, str(local / METADATA_FILE),
                      _join(remote, METADATA_FILE))
        self._write_marker(fs, _join(remote, COMPLETE_MARKER), json.dumps(
            {"world_size": self.world_size, "save_id": self.save_id}).encode())


class _RemoteReads:
    """The remote's fsspec filesystem as a recovery reads it: each request (a marker's or the
    metadata's read, a look for a file, a ranged fetch) through :func:`retried` with the store's
    settings (``store`` None: tried once); one whose retries give up raises a
    :class:`~hapt_hf.errors.CheckpointError` naming the file, the attempts and the last error.
    A permanent error (no such file, permission denied) is raised as it came."""

    def __init__(self, fs: Any, root: str, store: CheckpointStore | None) -> None:
        self.fs, self.root, self.store = fs, root.rstrip("/"), store
        self.rank = _rank_world()[0]

    def _request(self, path: str, call: Callable[[], Any], part: str = "") -> Any:
        if self.store is None:
            return call()
        what = ((path[len(self.root):].lstrip("/") if path.startswith(self.root) else "") or path) + part
        notes: list[str] = []
        try:
            return retried(call, self.store, f"rank {self.rank}: reading {what} from {self.store.remote}",
                           what, notes.append)
        except Exception as e:
            if not notes:
                raise
            raise CheckpointError(f"the remote copy {self.store.remote!r} did not answer a read "
                                  f"({notes[0]}; last error {type(e).__name__}: {e}); resume again "
                                  "once it answers, or allow more retries (CheckpointStore's "
                                  "upload_attempts, upload_retry_s)") from e

    def exists(self, path: str) -> bool:
        return self._request(path, lambda: self.fs.exists(path))

    def glob(self, pattern: str) -> list[str]:
        return self._request(pattern, lambda: self.fs.glob(pattern))

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        return self._request(path, lambda: self.fs.ls(path, detail=detail))

    def cat_file(self, path: str) -> bytes:
        return self._request(path, lambda: self.fs.cat_file(path))

    def cat_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path``, exactly: an attempt that brings other than
        ``end - start`` bytes is an error (the file is shorter than asked), and nothing of a
        failed attempt is kept."""
        def request() -> bytes:
            data = self.fs.cat_file(path, start=start, end=end)
            if len(data) != end - start:
                raise OSError(f"{path}: bytes {start}..{end} asked, {len(data)} came: the remote "
                              "file is shorter than the checkpoint's metadata says")
            return data
        return self._request(path, request, f" bytes {start}..{end}")


@dataclass
class ReadStats:
    """What one rank's load read, and from where (bytes of the items it asked for)."""

    local_bytes: int = 0
    direct_bytes: int = 0
    """Of ``local_bytes``: the tensor bytes read straight into the tensors they load into
    (:func:`~hapt_hf.pipeline.direct_read.read_direct`), the rest through DCP's own path."""
    direct_s: float = 0.0
    """Seconds the direct reads took (the local files' tensors read straight in)."""
    fetched_bytes: int = 0
    local_files: list[str] = field(default_factory=list)
    fetched_files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        mb = 1 << 20
        return (f"read {self.local_bytes / mb:.1f} MiB from {len(self.local_files)} local "
                f"file(s) ({self.direct_bytes / mb:.1f} MiB straight into the tensors in "
                f"{self.direct_s:.2f} s), fetched "
                f"{self.fetched_bytes / mb:.1f} MiB from "
                f"{len(self.fetched_files)} remote file(s)")


MERGE_GAP = 1 << 20
"""Byte ranges of a remote file closer than this are fetched in one request."""
FETCH_PIECE = 64 << 20
"""Most bytes one ranged GET asks for: a long run of tensors is fetched in pieces, so that
the tensors of one piece are read while the next piece arrives."""
FETCH_AHEAD = 256 << 20
"""Most fetched bytes held that the reads have not gone past; the fetch waits beyond it
(unless a read waits for the next piece: a tensor longer than this is still read)."""


class _NotFetched(OSError):
    """A read of a byte no range of the load covers."""


class _Prefetch:
    """One thread fetching the remote files' byte ranges of one load, in the order the reads
    take them (file by file, by offset), in pieces of at most :data:`FETCH_PIECE` bytes (one
    ranged GET each), at most :data:`FETCH_AHEAD` bytes ahead of the reads: the transfer goes on
    while the local files and the pieces already fetched are read."""

    def __init__(self, remote_fs: _RemoteReads, root: str, files: dict[str, list[tuple[int, int]]]) -> None:
        self.remote_fs, self.root = remote_fs, root
        self.pieces = {rel: [(a, min(a + FETCH_PIECE, end)) for start, end in _coalesce(spans)
                             for a in range(start, end, FETCH_PIECE)] for rel, spans in files.items()}
        self.item_starts = {rel: sorted(o for o, _ in spans) for rel, spans in files.items()}
        self.data: dict[tuple[str, int], bytes] = {}
        self.held = 0
        self.waiting = False
        self.closed = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hapt-checkpoint-fetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for rel, pieces in self.pieces.items():
                for a, b in pieces:
                    with self.cond:
                        while not (self.closed or self.waiting or self.held == 0
                                   or self.held + (b - a) <= FETCH_AHEAD):
                            self.cond.wait()
                        if self.closed:
                            return
                    data = self.remote_fs.cat_range(_join(self.root, rel), a, b)  # exact, retried
                    with self.cond:
                        self.data[(rel, a)] = data
                        self.held += len(data)
                        self.waiting = False
                        self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised again by the read that needs it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def piece(self, rel: str, pos: int) -> tuple[int, bytes]:
        """The fetched piece of ``rel`` holding byte ``pos`` (waiting for it); pieces wholly
        before the item that ``pos`` is in are dropped (the items are read in order)."""
        pieces = self.pieces.get(rel, [])
        i = bisect.bisect_right(pieces, (pos, float("inf"))) - 1
        if i < 0 or pos >= pieces[i][1]:
            raise _NotFetched(f"{_join(self.root, rel)}: byte {pos} was not fetched")
        starts = self.item_starts[rel]
        item = starts[max(bisect.bisect_right(starts, pos) - 1, 0)]
        with self.cond:
            for a, b in pieces[:i]:
                if b <= item and (rel, a) in self.data:
                    self.held -= len(self.data.pop((rel, a)))
            while (rel, pieces[i][0]) not in self.data:
                if self.error is not None:
                    raise self.error  # the fetch's own error, as a read in this thread would raise it
                self.waiting = True
                self.cond.notify_all()
                self.cond.wait()
            self.cond.notify_all()
            return pieces[i][0], self.data[(rel, pieces[i][0])]

    def release(self, rel: str) -> None:
        """The reads of ``rel`` are done: drop what is held of it."""
        with self.cond:
            for a, _ in self.pieces.get(rel, []):
                if (rel, a) in self.data:
                    self.held -= len(self.data.pop((rel, a)))
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.data.clear()
            self.held = 0
            self.cond.notify_all()


class _RangeFile(io.RawIOBase):
    """A remote file of which only some byte ranges are fetched (:class:`_Prefetch`), read as
    a seekable stream; a read outside them is an error, not a silent fetch."""

    def __init__(self, name: str, rel: str, prefetch: _Prefetch) -> None:
        super().__init__()
        self.name, self.rel, self.prefetch, self.pos = name, rel, prefetch, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self.pos = offset
        elif whence == os.SEEK_CUR:
            self.pos += offset
        else:
            raise ValueError("a fetched range has no known end")
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        """As many bytes as ``b`` holds, across pieces (a reader of zip records wants them all)."""
        out, done = memoryview(b).cast("B"), 0
        while done < len(out):
            try:
                start, data = self.prefetch.piece(self.rel, self.pos)
            except _NotFetched:
                if done:  # the rest lies beyond the ranges fetched (a fetch's error is raised)
                    break
                raise
            n = min(len(out) - done, start + len(data) - self.pos)
            out[done:done + n] = memoryview(data)[self.pos - start:self.pos - start + n]
            self.pos += n
            done += n
        return done


def _coalesce(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) ranges covering every (offset, length) span, near ones merged."""
    out: list[list[int]] = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][1] + MERGE_GAP:
            out[-1][1] = max(out[-1][1], offset + length)
        else:
            out.append([offset, offset + length])
    return [(a, b) for a, b in out]


class _LocalFirstFileSystem(FileSystemBase):
    """The remote copy's paths, each opened from the local directory where it holds the file
    (at least as long as the reads need), else fetched from the remote through fsspec: the byte
    ranges the reads need, one ranged request each (``cat_file``), or the whole file; each
    request retried (:class:`_RemoteReads`)."""

    def __init__(self, local: Path | None, remote_fs: _RemoteReads, remote_root: str, save_id: str) -> None:
        self.local, self.remote_fs, self.root, self.save_id = local, remote_fs, remote_root, save_id
        self.spans: dict[str, list[tuple[int, int]]] = {}
        """Relative path to the (offset, length) of every item a read of it asks for."""
        self.whole: dict[str, bytes] = {}
        """Files fetched whole (the metadata, read before and again during a load)."""
        self.prefetch: _Prefetch | None = None
        """The fetch of the remote files' ranges of the load under way."""

    def relative(self, path: str | os.PathLike) -> str:
        path = os.fspath(path)
        return path[len(self.root):].lstrip("/") if path.startswith(self.root) else path

    def is_local(self, rel: str) -> bool:
        if self.local is None:
            return False
        candidate = self.local / rel
        needed = max((o + n for o, n in self.spans.get(rel, ())), default=1)
        if not candidate.is_file() or candidate.stat().st_size < needed:
            return False
        try:  # a file of another save of the same name (a node back after a later save) is not it
            return (self.local / (rel + SAVE_ID_SUFFIX)).read_text() == self.save_id
        except OSError:
            return False

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise ValueError(f"a local-first reader only reads (mode {mode!r})")
        rel = self.relative(path)
        if self.is_local(rel):
            with open(self.local / rel, "rb") as f:  # type: ignore[operator]
                yield f
            return
        remote = _join(self.root, rel)
        if rel not in self.spans:  # the metadata: read whole, once
            if rel not in self.whole:
                self.whole[rel] = self.remote_fs.cat_file(remote)
            yield io.BytesIO(self.whole[rel])
            return
        if self.prefetch is None:
            raise OSError(f"{remote}: read outside a load")
        try:
            yield _RangeFile(remote, rel, self.prefetch)
        finally:
            self.prefetch.release(rel)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return _join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path, new_path) -> None:
        raise ValueError("a local-first reader does not write")

    def mkdir(self, path) -> None:
        raise ValueError("a local-first reader does not write")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        rel = self.relative(path)
        return self.is_local(rel) or self.remote_fs.exists(_join(self.root, rel))

    def rm_file(self, path) -> None:
        raise ValueError("a local-first reader does not write")


class LocalFirstReader(dcp.FileSystemReader):
    """DCP's file reader over the remote copy of a checkpoint, each file taken from this node's
    local copy where it holds it (:class:`ReadStats` in :attr:`stats`). ``store``: whose retry
    settings the requests to the remote take (:func:`retried`); None: each is tried once."""

    def __init__(self, remote_fs, remote_path: str, local: Path | None, save_id: str = "",
                 store: CheckpointStore | None = None) -> None:
        super().__init__(remote_path)
        reads = remote_fs if isinstance(remote_fs, _RemoteReads) else _RemoteReads(remote_fs, remote_path, store)
        self.fs = _LocalFirstFileSystem(local, reads, remote_path, save_id)
        self.path = remote_path
        self.stats = ReadStats()

    def _position(self, item) -> tuple[str, int]:
        info = self.storage_data[item.storage_index]
        return info.relative_path, info.offset

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            raise ValueError("a LocalFirstReader reads the checkpoint it was made for")
        super().reset()

    def read_data(self, plan, planner):
        per_file: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        remote: dict[str, list[tuple[int, int]]] = {}
        for rel, spans in sorted(per_file.items()):
            self.fs.spans[rel] = spans
            size = sum(n for _, n in spans)
            if self.fs.is_local(rel):
                self.stats.local_bytes += size
                self.stats.local_files.append(rel)
            else:
                self.stats.fetched_bytes += size
                self.stats.fetched_files.append(rel)
                remote[rel] = spans
        self.fs.prefetch = _Prefetch(self.fs.remote_fs, self.fs.root, remote)
        try:
            # the local files first (while the remote ranges arrive), each tensor that can be
            # read straight into the tensor it loads into (read_direct); then DCP's own path for
            # the rest: what is left of the local files, then each remote file's items in the
            # order they lie in it, the order its pieces arrive in
            left = [item for item in plan.items if self._position(item)[0] in remote]
            t0 = time.perf_counter()
            for rel in self.stats.local_files:
                items = [item for item in plan.items if self._position(item)[0] == rel]
                rest, direct = read_direct(self.fs.local / rel, items, self.storage_data, planner)
                self.stats.direct_bytes += direct
                left.extend(rest)
            self.stats.direct_s += time.perf_counter() - t0
            plan = dataclasses.replace(plan, items=sorted(
                left, key=lambda item: (self._position(item)[0] in remote, *self._position(item))))
            fut = super().read_data(plan, planner)
        finally:
            self.fs.prefetch.close()
            self.fs.prefetch = None
        rank = f"rank {self.rank}: " if self.rank is not None else ""
        logger.info("%s%s of %s", rank, self.stats.describe(), self.path)
        return fut



def retry_setting_problem(name: str, value: object) -> str | None:
    """What a retry setting of :class:`CheckpointStore` (``upload_attempts``,
    ``upload_backoff_s``, ``upload_retry_s``) must be where ``value`` is not it, else None."""
    if name == "upload_attempts":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else "a whole number of attempts >= 1 (1: no retries)"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return None if ok else "a number of seconds >= 0"

@dataclass(frozen=True)
class CheckpointStore:
    """Where a run's checkpoints go: ``local_dir`` (this node's disk) and ``remote`` (an fsspec
    URL every node reaches). A checkpoint is a subdirectory ``<name>`` of each."""

    local_dir: Path
    remote: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec for the remote (credentials, endpoint, ...)."""
    upload_timeout_s: float = 3600.0
    """How long rank 0's upload waits for the other ranks' before giving up on the marker."""
    poll_s: float = 0.05
    upload_attempts: int = 5
    """Most attempts of each request to the remote whose error may be transient
    (:func:`transient`): a copy's (a stale marker's removal, a file's upload, a marker's write)
    and a recovery's (a marker's or the metadata's read, a ranged fetch); 1: none retried."""
    upload_backoff_s: float = 1.0
    """The wait before a request's second attempt, doubled before each next one (at most
    :data:`MAX_BACKOFF_S`), each wait times a random factor in [0.5, 1]."""
    upload_retry_s: float = 600.0
    """Most seconds one request's attempts and waits may take: no retry begins whose wait
    would end past it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_dir", Path(self.local_dir))
        for name in ("upload_attempts", "upload_backoff_s", "upload_retry_s"):
            value = getattr(self, name)
            need = retry_setting_problem(name, value)
            if need:
                raise CheckpointError(f"{name} is {value!r}; give {need}")
        if not isinstance(self.remote, str) or not self.remote:
            raise CheckpointError(f"the remote copy's location must be a path or fsspec URL "
                                  f"(e.g. /shared/run or s3://bucket/run), not {self.remote!r}")
        if "://" not in self.remote and Path(self.remote).resolve() == self.local_dir.resolve():
            raise CheckpointError(f"the remote copy {self.remote!r} is the local directory "
                                  "itself; give a directory on shared storage or a remote URL")

    def remote_fs(self) -> tuple[Any, str]:
        """The remote's fsspec filesystem and root path (its protocol-specific form)."""
        try:
            fs, root = fsspec.core.url_to_fs(self.remote, **self.storage_options)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"the remote copy {self.remote!r} cannot be opened ({e}); "
                                  "install the fsspec backend its protocol needs (s3fs for s3://, "
                                  "gcsfs for gs://, ...) or give a shared directory") from None
        return fs, root

    def local_path(self, name: str) -> Path:
        return self.local_dir / name

    def remote_url(self, name: str) -> str:
        return _join(self.remote, name)

    def save(self, name: str, state_dict: dict[str, Any], start: bool = True) -> Upload:
        """Write this rank's tensors of ``state_dict`` into ``local_dir/<name>`` (collective:
        every rank of the default process group calls it) and start copying them to the remote
        in the background (``start=False``: once :meth:`Upload.start` is called, e.g. after
        the rest of the checkpoint is committed); returns the copy (wait on it before the
        process exits)."""
        rank, world = _rank_world()
        if rank == 0:  # a marker left by an earlier save of the same name must not count
            self._remove_stale_markers(name, world)
        token = [uuid.uuid4().hex if rank == 0 else ""]
        if world > 1:  # one id for this save on every rank
            dist.broadcast_object_list(token, src=0)
        writer = _RecordingWriter(self.local_path(name))
        dcp.save(state_dict, storage_writer=writer)
        for f in writer.written:  # which save each local file is of (a node may keep stale ones)
            (self.local_path(name) / (f + SAVE_ID_SUFFIX)).write_text(token[0])
        upload = Upload(self, name, list(writer.written), rank, world, token[0])
        return upload.start() if start else upload

    def _remove_stale_markers(self, name: str, world: int) -> None:
        """Remove from the remote copy of ``name`` the markers an earlier save of that name left
        (rank 0, before this save writes anything): each look and each removal through
        :func:`retried`. A marker not there is skipped, and one gone when its removal is retried
        (an attempt whose answer was lost removed it) is not an error; any other error, or the
        last attempt's, is raised as it came. The earlier save's DCP metadata goes too, right
        after its ``.complete`` and before its ``.uploaded-N``: by :func:`copy_whole` a copy
        with metadata and no rank's marker is whole, and this save is about to overwrite its
        files."""
        fs, root = self.remote_fs()
        remote = _join(root, name)
        for stale in [COMPLETE_MARKER, METADATA_FILE] + [m.format(rank=r) for r in range(world)
                                                         for m in (UPLOADED, FAILED)]:
            path, doing = _join(remote, stale), f"rank 0: removing {stale} of {name!r} from {self.remote}"
            if not retried(lambda p=path: fs.exists(p), self, doing, stale):
                continue
            try:
                retried(lambda p=path: fs.rm_file(p), self, doing, stale)
            except FileNotFoundError:  # removed by an attempt whose answer was lost
                pass

    def _remote_reads(self) -> tuple[_RemoteReads, str]:
        """The remote's filesystem as a recovery reads it (each request retried) and its root."""
        fs, root = self.remote_fs()
        return _RemoteReads(fs, root, self), root

    def is_complete(self, name: str) -> bool:
        """Whether the remote copy of ``name`` holds every rank's files and the metadata."""
        fs, root = self._remote_reads()
        return copy_whole(_join(root, name), fs)

    def require_complete(self, name: str) -> None:
        if not self.is_complete(name):
            latest = self.latest_complete()
            hint = f"resume from {latest!r}, the latest complete one" if latest else \
                "no checkpoint of this store is complete"
            raise CheckpointError(f"the remote copy {self.remote_url(name)!r} has no "
                                  f"{COMPLETE_MARKER} marker: its upload did not finish, so it may "
                                  f"lack a rank's files; {hint}")

    def latest_complete(self, prefix: str = "checkpoint-") -> str | None:
        """The name of the newest complete remote checkpoint ``<prefix>N`` (highest N)."""
        fs, root = self._remote_reads()
        if not fs.exists(root):
            return None
        steps = []
        for entry in fs.ls(root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                steps.append((int(name[len(prefix):]), name))
        for _, name in sorted(steps, reverse=True):
            if copy_whole(_join(root, name), fs):
                return name
        return None

    def reader(self, name: str, local: bool = True) -> LocalFirstReader:
        """A DCP reader of checkpoint ``name`` (refused unless its remote copy is complete):
        each file from this node's local copy where it holds it (``local=False``: every file
        from the remote), the rest fetched. Each request to the remote is retried as a copy's
        are (:func:`retried`)."""
        fs, root = self._remote_reads()
        try:  # a copy Upload filled is whole once its marker is there (copy_whole): one request
            marker = json.loads(fs.cat_file(_join(_join(root, name), COMPLETE_MARKER)))
        except FileNotFoundError:  # a DCP-written copy has none, an unfinished copy none yet
            self.require_complete(name)
            marker = {}
        return LocalFirstReader(fs, _join(root, name), self.local_path(name) if local else None,
                                marker.get("save_id", ""), self)
