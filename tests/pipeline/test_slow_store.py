"""benchmarks/slow_store.py's throttle: a ranged GET and an upload take the latency plus their
bytes at the bandwidth, the local read or copy counted in that time, not added to it."""
from __future__ import annotations

import time

import fsspec
import pytest

from benchmarks import slow_store


@pytest.fixture(autouse=True)
def _throttle():
    slow_store.configure(bandwidth_mb_s=10.0, latency_s=0.05)
    slow_store.reset()
    yield
    slow_store.configure()


def test_a_get_and_an_upload_take_latency_plus_bytes_at_the_bandwidth(tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 2_000_000)  # 0.2 s at 10 MB/s
    fs, _ = fsspec.core.url_to_fs(f"throttled://{tmp_path}")
    t0 = time.perf_counter()
    assert len(fs.cat_file(str(src), start=500_000, end=1_500_000)) == 1_000_000
    get_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.put_file(str(src), str(tmp_path / "copy"))
    put_s = time.perf_counter() - t0
    assert 0.15 <= get_s < 0.15 + 0.25 and 0.25 <= put_s < 0.25 + 0.25
    assert slow_store.FETCHES == [(str(src), 500_000, 1_500_000)]


def test_a_read_slower_than_the_bandwidth_is_not_charged_twice(tmp_path, monkeypatch):
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 1_000_000)  # 0.15 s with the latency
    slow = open

    def slow_open(*args, **kwargs):  # a disk that takes 0.3 s to read it
        time.sleep(0.3)
        return slow(*args, **kwargs)
    monkeypatch.setattr(slow_store, "open", slow_open, raising=False)
    fs, _ = fsspec.core.url_to_fs(f"throttled://{tmp_path}")
    t0 = time.perf_counter()
    fs.cat_file(str(src), start=0, end=1_000_000)
    assert 0.3 <= time.perf_counter() - t0 < 0.42  # 0.45 if the read were added
