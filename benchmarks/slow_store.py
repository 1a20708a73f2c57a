"""A local directory seen through fsspec as an object store would serve it: ``throttled://``.

``cat_file(path, start, end)`` is one ranged GET, as s3fs's is; a file opened for reading goes
through fsspec's ``AbstractBufferedFile`` as s3fs's and gcsfs's do (a read outside its read-ahead
buffer is one ranged GET of at least ``block_size`` bytes). A GET takes ``latency_s`` plus its
bytes at ``bandwidth_mb_s`` (per process: each rank reads at that rate, as each node's stream
from an object store does), or the local read if that is slower (the read is not added to it).
An upload (``put_file``) likewise: a latency plus its bytes at the bandwidth; other writes are
the local filesystem's. Every fetch is logged in
:data:`FETCHES` (path, start, end) so tests can count what a rank took from the remote.

    from benchmarks import slow_store  # registers the protocol
    slow_store.configure(bandwidth_mb_s=100, latency_s=0.03)
    fs, root = fsspec.core.url_to_fs("throttled:///tmp/remote")
"""
from __future__ import annotations

import os
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

__all__ = ["ThrottledFileSystem", "FETCHES", "configure", "fetched_files", "reset"]

FETCHES: list[tuple[str, int, int]] = []
"""Every ranged GET of this process: (path, start, end)."""
_SETTINGS = {"bandwidth_mb_s": float("inf"), "latency_s": 0.0, "block_size": 8 << 20}


def configure(bandwidth_mb_s: float = float("inf"), latency_s: float = 0.0,
              block_size: int = 8 << 20) -> None:
    """Set this process's throttle (MB = 10**6 bytes)."""
    _SETTINGS.update(bandwidth_mb_s=bandwidth_mb_s, latency_s=latency_s, block_size=block_size)


def reset() -> None:
    FETCHES.clear()


def fetched_files() -> list[str]:
    """The base names of the files fetched from, each once, in order."""
    seen: dict[str, None] = {}
    for path, _, _ in FETCHES:
        seen.setdefault(path.rsplit("/", 1)[-1], None)
    return list(seen)


def _transfer(t0: float, size: int) -> None:
    """Wait until a request begun at ``t0`` has taken its latency plus ``size`` bytes at the
    bandwidth (the local read or copy already done counts: a transfer is not slower than the disk)."""
    left = _SETTINGS["latency_s"] + size / (_SETTINGS["bandwidth_mb_s"] * 1e6) - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)


def _get(path: str, start: int, end: int | None) -> bytes:
    """One ranged GET: its latency, then its bytes at the bandwidth."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(end - start)
    _transfer(t0, len(data))
    FETCHES.append((path, start, start + len(data)))
    return data


class _ThrottledFile(AbstractBufferedFile):
    def _fetch_range(self, start: int, end: int) -> bytes:
        return _get(self.path, start, end)


class ThrottledFileSystem(LocalFileSystem):
    protocol = "throttled"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("throttled://"):
            path = path[len("throttled://"):]
        return LocalFileSystem._strip_protocol(path)

    def put_file(self, lpath, rpath, callback=None, **kwargs):
        """One upload: a request's latency, then the file's bytes at the bandwidth."""
        t0 = time.perf_counter()
        super().put_file(lpath, rpath, **kwargs)
        _transfer(t0, os.path.getsize(lpath))

    def cat_file(self, path, start=None, end=None, **kwargs):
        """One ranged GET, as s3fs's ``cat_file`` is (no read-ahead)."""
        return _get(self._strip_protocol(path), start or 0, end)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if mode != "rb":
            return super()._open(path, mode=mode, block_size=block_size, **kwargs)
        return _ThrottledFile(self, self._strip_protocol(path), mode,
                              block_size=block_size or _SETTINGS["block_size"], cache_type="readahead")


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)
