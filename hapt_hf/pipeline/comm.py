"""Point-to-point transfers and failure signalling for the pipeline runtime.

Transfers are torch.distributed's own ``isend``/``irecv`` on the default process group; what is
written here is what torch.distributed does not give: a failure anywhere must end every rank
within a bounded time, with a message that names the rank that failed and what it was doing.

How a failure travels:

* A rank that raises records ``"rank R failed during F (stage S, micro-batch K): <error>"`` in
  the rendezvous store (first record wins), then its exception ends the process.
* A rank blocked on a transfer from a process that ended sees the transfer fail (Gloo closes
  the pair at once); it then reads the store and raises :class:`PipelineFailure` with the first
  record, or, if there is none, records and raises "rank P stopped answering ...".
* A watchdog thread beats a heartbeat counter in the store and, while the main thread is blocked
  on a transfer, watches the peer it waits for. If a failure is recorded elsewhere while this
  rank stays blocked (the failed rank kept its process alive), or the peer's heartbeat stops for
  ``timeout_s``, the watchdog prints the message and ends the process: a blocked Gloo wait cannot
  be interrupted from Python, and a hang is the one outcome that is not allowed.
* The process group's own timeout (set from the same ``timeout_s``) bounds a peer that is alive
  but never sends.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineFailure", "Transfer", "FailureChannel"]

_FAILURE_KEY = "failure"
_FAILURE_COUNT = "failure_count"


class PipelineFailure(RuntimeError):
    """A rank of the pipeline failed or stopped answering; the message says which and where."""


@dataclass(frozen=True)
class Transfer:
    """One posted send or receive with the peer it involves and what it carries."""

    work: dist.Work
    peer: int
    what: str
    """E.g. "RECV_F of micro-batch 3 from rank 2 (stage 1)": used in failure messages."""
    buffer: torch.Tensor
    """Kept alive until the transfer completes (a send's source, a receive's destination)."""


def _short(error: Exception) -> str:
    """The gist of a transport error: Gloo prefixes a source path and appends advice."""
    text = (str(error).splitlines() or [""])[0]
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically")[0][:160] or type(error).__name__


def _default_store() -> dist.Store:
    # The rendezvous store every launcher (torchrun, accelerate, env://) already set up; torch
    # exposes it only through this private accessor.
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


class FailureChannel:
    """Failure records and heartbeats in the rendezvous store, plus the watchdog thread."""

    def __init__(self, namespace: str, rank: int, timeout_s: float,
                 store: dist.Store | None = None, grace_s: float = 0.5) -> None:
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.grace_s = min(grace_s, self.timeout_s / 2)
        self._store = dist.PrefixStore(f"hapt_hf/{namespace}/", store or _default_store())
        self._wait: tuple[str, int | None, float] | None = None  # (what, peer, since)
        self._seen: str | None = None  # a record read earlier: the store may be gone later
        self._stop = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (last count, when it changed)
        self._interval = max(0.05, min(1.0, self.timeout_s / 20))
        # long enough for another rank's grace wait plus its heartbeat watch in ``_silent``
        self._linger_s = 4 * self._interval + self.grace_s
        self._thread = threading.Thread(target=self._watch, name="hapt-watchdog", daemon=True)
        self._thread.start()

    # -- records ---------------------------------------------------------------------------
    def record(self, message: str) -> str:
        """Record a failure unless one is already recorded; return the first one."""
        try:
            if self._store.add(_FAILURE_COUNT, 1) == 1:
                self._store.set(_FAILURE_KEY, message)
                return message
            return self._read(wait_s=self.grace_s) or message
        except Exception:  # noqa: BLE001 - the store host may be the rank that died
            return message

    def first_failure(self, wait_s: float = 0.0) -> str | None:
        try:
            return self._read(wait_s)
        except Exception:  # noqa: BLE001
            return self._seen

    def _read(self, wait_s: float) -> str | None:
        end = time.monotonic() + wait_s
        while True:
            if self._seen is not None:
                return self._seen
            if self._store.check([_FAILURE_KEY]):
                self._seen = self._store.get(_FAILURE_KEY).decode(errors="replace")
                return self._seen
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, transfers: Sequence[Transfer], stage: int) -> None:
        """Wait for every transfer; any failure becomes a PipelineFailure naming the peer."""
        for t in transfers:
            with self._waiting(t.what, t.peer):
                try:
                    t.work.wait()
                except Exception as e:  # noqa: BLE001 - turned into one clear message
                    raise self._lost_peer(t, stage, e) from None

    @contextmanager
    def collective(self, what: str, stage: int, ranks: Sequence[int]) -> Iterator[None]:
        """Run a collective over ``ranks`` so that a failure becomes a PipelineFailure."""
        with self._waiting(what, None):
            try:
                yield
            except PipelineFailure:
                raise
            except Exception as e:  # noqa: BLE001 - turned into one clear message
                mine = f"rank {self.rank} (stage {stage}) was in {what}"
                # the transport does not say which rank went away: its heartbeat does
                raise self._failure(
                    mine, lambda: f"{self._silent(ranks)} stopped answering ({_short(e)}) "
                                  f"while {mine}") from None

    def _silent(self, ranks: Sequence[int]) -> str:
        """Name the ranks whose heartbeat does not move over a few watchdog intervals."""
        others = [r for r in ranks if r != self.rank]
        try:
            before = {r: self._store.add(f"hb/{r}", 0) for r in others}
            time.sleep(3 * self._interval)
            dead = [r for r in others if self._store.add(f"hb/{r}", 0) == before[r]]
        except Exception:  # noqa: BLE001 - with env:// the store lives in rank 0's process
            return "rank 0 (host of the rendezvous store)"
        if not dead:
            return f"one of ranks {others}"
        return ("rank " if len(dead) == 1 else "ranks ") + ", ".join(map(str, dead))

    @contextmanager
    def _waiting(self, what: str, peer: int | None) -> Iterator[None]:
        self._wait = (what, peer, time.monotonic())
        try:
            yield
        finally:
            self._wait = None

    def _lost_peer(self, t: Transfer, stage: int, error: Exception) -> PipelineFailure:
        # A rank that fails records why before its process ends (and its sockets close), so a
        # record, if any, is already there; otherwise the peer died without a word.
        mine = f"rank {self.rank} (stage {stage}) was waiting for {t.what}"
        return self._failure(
            mine, lambda: f"rank {t.peer} stopped answering ({_short(error)}) while {mine}")

    def _failure(self, mine: str, own: Callable[[], str]) -> PipelineFailure:
        """The failure this rank raises: the first recorded one with what this rank was doing,
        or, if none is recorded yet, this rank's own finding (``own()``, computed only then)
        recorded as the first."""
        first = self.first_failure(wait_s=self.grace_s)
        if first is None:
            found = own()
            first = self.record(found)
            message = found if first == found else f"{first}; {mine}"
        else:
            message = f"{first}; {mine}"
        self._linger_if_store_host()
        return PipelineFailure(message)

    def _linger_if_store_host(self) -> None:
        # With env:// rendezvous the store lives in rank 0's process. Raising ends that process
        # soon after, and a rank still working out who failed (``_silent`` watches heartbeats
        # for a few intervals) would then find the store gone and blame rank 0. Staying a
        # little longer lets every rank read the record: a failure path only, so it costs
        # nothing in training.
        if self.rank == 0:
            time.sleep(self._linger_s)

    # -- watchdog --------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = self._interval
        while not self._stop.wait(interval):
            try:
                self._store.add(f"hb/{self.rank}", 1)
                fatal = self._check_blocked()
            except Exception:  # noqa: BLE001 - store gone: the main thread's wait will fail
                fatal = self._store_lost()
            if fatal:
                print(f"PipelineFailure: {fatal}", file=sys.stderr, flush=True)
                if self.rank == 0:
                    # rank 0 hosts the store (env:// rendezvous): give the others time to read
                    # the record before it goes away with this process
                    time.sleep(self._linger_s)
                os._exit(1)

    def _check_blocked(self) -> str | None:
        wait = self._wait
        if wait is None:
            return None
        what, peer, since = wait
        now = time.monotonic()
        # a collective has no single peer to watch: the process group's timeout bounds it
        count = self._store.add(f"hb/{peer}", 0) if peer is not None else None
        last = self._beats.get(peer) if peer is not None else None
        if peer is None:
            pass
        elif last is None or last[0] != count:
            self._beats[peer] = (count, now)
        elif now - last[1] > self.timeout_s and now - since > self.timeout_s:
            return self.record(f"rank {peer} stopped answering (no heartbeat for "
                               f"{now - last[1]:.0f} s) while rank {self.rank} was waiting "
                               f"for {what}")
        first = self._read(0.0)
        if first is not None and now - since > self.grace_s * 2:
            return first
        return None

    def _store_lost(self) -> str | None:
        wait = self._wait
        if wait is None or time.monotonic() - wait[2] < self.timeout_s:
            return None
        return (f"the rendezvous store stopped answering while rank {self.rank} was waiting "
                f"for {wait[0]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
