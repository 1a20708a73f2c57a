"""Failure signalling for the pipeline runtime: failure records in the rendezvous store.

A failure anywhere must end every rank within a bounded time, with a message that names the rank
that failed and what it was doing; torch.distributed does not give that. The transfers themselves
(:class:`~hapt_hf.pipeline.transfers.Transfer`) are posted and waited for through
:class:`FailureChannel`, so that a failed one becomes a :class:`PipelineFailure`.

What every rank publishes in the rendezvous store, under the runtime's namespace:

* ``failure``: the first failure recorded (``"rank R failed during F (stage S, micro-batch K):
  <error>"`` from a rank that raised, or a finding about a rank that stopped); first one wins.
* ``hb/R``: a heartbeat counter the watchdog thread bumps every interval. A killed or frozen
  (SIGSTOP) process stops beating; a process blocked in a Gloo wait keeps beating.
* ``wait/R``: what rank R's main thread waits for (a peer's transfer, or a collective and its
  ranks), published by the watchdog once per interval: who waits for whom.
* ``culprit``: the rank the first failure names; ``ack/R``: rank R has read the failure. Rank 0
  hosts the store (env:// rendezvous), so it stays until every rank but the culprit has read
  the failure (at most ``_linger_s``): a rank still finding who stopped needs the store.

How a failure is told apart from its echoes. A frozen or killed rank blocks its neighbours, who
block theirs: every survivor ends up blocked, and the first transport error or timeout a survivor
sees usually names a rank that is itself only waiting. So a rank that sees a transfer or a
collective fail (or time out) first reads the record; without one it follows ``wait/`` from the
rank it waited for to the end of the chain, watching every heartbeat for a short window: the
culprit is the first rank on the chain whose heartbeat does not move (killed, frozen), or the
alive rank at its end that waits for nobody (stuck in its own work). A rank next to the culprit
records its finding at once; a rank further down the chain gives the nearer ranks a grace period
to record theirs first, as their evidence is first-hand.

* A rank that raises (during an action, or while building its stage or loading a checkpoint:
  :meth:`FailureChannel.failing`) records its error before its process ends.
* The watchdog thread ends a process whose main thread stays blocked (a blocked Gloo wait cannot
  be interrupted from Python) when a failure is recorded elsewhere, or when the peer it waits for
  has had no heartbeat for ``timeout_s``; it prints the message first.
* The process group's own timeout (set from the same ``timeout_s``) bounds a wait on a peer that
  is alive but never sends; the chain then names what that peer itself waits for.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from hapt_hf.compat.torch_api import default_store
from hapt_hf.pipeline.exit_guard import close_at_exit
from hapt_hf.pipeline.transfers import Transfer

__all__ = ["PipelineFailure", "FailureChannel", "failed_during"]

_FAILURE_KEY = "failure"
_FAILURE_COUNT = "failure_count"
_CULPRIT_KEY = "culprit"
_T = TypeVar("_T")


class PipelineFailure(RuntimeError):
    """A rank of the pipeline failed or stopped answering; the message says which and where."""


@dataclass(frozen=True)
class _Wait:
    """What the main thread is blocked on: one peer's transfer or a collective over ``ranks``."""

    what: str
    ranks: tuple[int, ...]
    collective: bool
    since: float

    def encode(self) -> str:
        return f"{'c' if self.collective else 'p'}|{','.join(map(str, self.ranks))}|{self.what}"


@dataclass(frozen=True)
class _Published:
    """Another rank's ``wait/R`` entry, decoded."""

    what: str
    ranks: tuple[int, ...]
    collective: bool

    @classmethod
    def decode(cls, text: str) -> "_Published | None":
        if not text:
            return None
        kind, ranks, what = text.split("|", 2)
        return cls(what, tuple(int(r) for r in ranks.split(",") if r), kind == "c")

    def doing(self) -> str:
        return f"in {self.what}" if self.collective else f"waiting for {self.what}"


@dataclass(frozen=True)
class _Culprit:
    """Who holds the others up, as found by following the wait-for chain."""

    rank: int
    why: str
    """E.g. "no heartbeat; it was last waiting for ..." (goes in parentheses)."""
    chain: tuple[int, ...]
    """The ranks from the one this rank waited for to the culprit, both included."""


def _short(error: Exception) -> str:
    """The gist of a transport error: Gloo prefixes a source path and appends advice."""
    text = (str(error).splitlines() or [""])[0]
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically")[0][:160] or type(error).__name__


def failed_during(rank: int, what: str, error: BaseException) -> str:
    """The record of a rank that raised: ``rank R failed during <what>: <Type>: <error>``."""
    return f"rank {rank} failed during {what}: {type(error).__name__}: {error}"


class FailureChannel:
    """Failure records, heartbeats and wait records in the rendezvous store, plus the watchdog."""

    def __init__(self, namespace: str, rank: int, timeout_s: float,
                 store: dist.Store | None = None, grace_s: float = 0.5,
                 world_size: int | None = None) -> None:
        self.rank = rank
        self.world_size = world_size if world_size is not None else dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.grace_s = min(grace_s, self.timeout_s / 2)
        self._store = dist.PrefixStore(f"hapt_hf/{namespace}/", store or default_store())
        self._wait: _Wait | None = None
        self._reporting = False  # the main thread is finding and reporting a failure
        self._published = ""  # the wait/R entry as last written
        self._seen: str | None = None  # a record read earlier: the store may be gone later
        self._stop = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (last count, when it changed)
        self._interval = max(0.05, min(1.0, self.timeout_s / 20))
        # Heartbeats are watched this long to tell a stopped rank from a live one: several
        # intervals, and at least a second, so that a live rank starved of CPU for a moment
        # on a loaded machine is not taken for a stopped one.
        self._window_s = min(self.timeout_s / 2, max(3 * self._interval, 1.0))
        # A rank silent over that window is watched as long again before it is named: a live
        # one starved of CPU beats again meanwhile (a stopped one never does).
        self._confirm_s = self._window_s
        # Rank 0 (the store's host) stays this long after it has a record: a rank that began
        # finding who stopped before the record existed needs its windows and one grace wait.
        self._linger_s = self._window_s + self._confirm_s + self.grace_s + 2 * self._interval
        self._thread = threading.Thread(target=self._watch, name="hapt-watchdog", daemon=True)
        self._thread.start()
        close_at_exit(self)  # its watchdog must not be inside a store call as the process ends

    # -- records ---------------------------------------------------------------------------
    def record(self, message: str, culprit: int | None = None) -> str:
        """Record a failure (naming rank ``culprit``) unless one is already recorded; return
        the first one."""
        try:
            if self._store.add(_FAILURE_COUNT, 1) == 1:
                if culprit is not None:
                    self._store.set(_CULPRIT_KEY, str(culprit))
                self._store.set(_FAILURE_KEY, message)
                self._seen = message
                self._ack()
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
                self._ack()
                return self._seen
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    @contextmanager
    def failing(self, what: str) -> Iterator[None]:
        """Record an exception raised in the block, so that every other rank names this one
        (e.g. ``what="building its stage (stage 2)"``); the exception itself goes on."""
        try:
            yield
        except PipelineFailure:
            raise
        except Exception as e:
            self.record(failed_during(self.rank, what, e), culprit=self.rank)
            raise

    # -- transfers and collectives ---------------------------------------------------------
    def start(self, post: Callable[[], dist.Work], peer: int, what: str, buffer: torch.Tensor,
              stage_index: int) -> Transfer:
        """Post a transfer (``post`` calls ``dist.isend``/``dist.irecv``); a peer that is gone
        already makes the post itself fail, which is the peer's failure, not this rank's."""
        try:
            return Transfer(post(), peer, what, buffer)
        except Exception as e:  # noqa: BLE001 - turned into one clear message
            raise self._lost(f"rank {self.rank} (stage {stage_index}) was posting {what}", [peer],
                             e) from None

    def wait(self, transfers: Sequence[Transfer], stage_index: int) -> None:
        """Wait for every transfer; a failure becomes a PipelineFailure naming who stopped."""
        for t in transfers:
            with self._waiting(t.what, (t.peer,), collective=False):
                try:
                    t.work.wait()
                except Exception as e:  # noqa: BLE001 - turned into one clear message
                    raise self._lost(f"rank {self.rank} (stage {stage_index}) was waiting for {t.what}",
                                     [t.peer], e) from None

    @contextmanager
    def collective(self, what: str, stage_index: int, ranks: Sequence[int]) -> Iterator[None]:
        """Run a collective over ``ranks`` so that a failure becomes a PipelineFailure."""
        with self._waiting(what, tuple(ranks), collective=True):
            try:
                yield
            except PipelineFailure:
                raise
            except Exception as e:  # noqa: BLE001 - turned into one clear message
                raise self._lost(f"rank {self.rank} (stage {stage_index}) was in {what}",
                                 [r for r in ranks if r != self.rank], e) from None

    @contextmanager
    def computing_with(self, what: str, stage_index: int, ranks: Sequence[int]) -> Iterator[None]:
        """Run a compute whose modules talk to ``ranks`` on the way (a tensor-parallel
        replica's all-reduces inside its forward and backward).

        Meanwhile this rank is published as waiting for them, so that a rank following who
        waits for whom passes through it to a peer that stopped. A communication failure inside
        (an error of the process group's backend) becomes a PipelineFailure naming the peer
        that stopped, as for a collective; any other exception is the compute's own and goes on
        (the caller records it as this rank's failure)."""
        with self._waiting(what, tuple(ranks), collective=True):
            try:
                yield
            except PipelineFailure:
                raise
            except Exception as e:
                if not _backend_error(e):
                    raise
                raise self._lost(f"rank {self.rank} (stage {stage_index}) was in {what}",
                                 [r for r in ranks if r != self.rank], e) from None

    def agree(self, what: str, stage_index: int, fn: Callable[[], _T],
              refusals: tuple[type[Exception], ...] = (ValueError,)) -> _T:
        """Run ``fn`` on every rank and end them all the same way if it refuses on any.

        A refusal (``refusals``: user errors such as a damaged checkpoint file) on some rank is
        raised on every rank, as the first refusing rank's exception; on the others its message
        starts with ``rank R:``, so that rank 0 can print one message naming the rank. Any other
        exception is recorded (the others name this rank) and goes on. A rank that dies or
        freezes meanwhile is named by the collective's failure path.
        """
        refused: Exception | None = None
        result = None
        with self.failing(f"{what} (stage {stage_index})"):
            try:
                result = fn()
            except refusals as e:
                refused = e
        outcomes: list = [None] * self.world_size
        mine = None if refused is None else (type(refused), str(refused))
        with self.collective(f"the check after {what}", stage_index, range(self.world_size)):
            dist.all_gather_object(outcomes, mine)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            return result
        if refused is not None:
            raise refused
        r, (cls, text) = failed[0]
        try:
            other = cls(f"rank {r}: {text}")
        except Exception:  # noqa: BLE001 - a refusal type that takes more than a message
            other = PipelineFailure(f"rank {r} refused {what}: {cls.__name__}: {text}")
        raise other

    @contextmanager
    def _waiting(self, what: str, ranks: tuple[int, ...], collective: bool) -> Iterator[None]:
        self._wait = _Wait(what, ranks, collective, time.monotonic())
        try:
            yield
        finally:
            self._wait = None

    # -- finding who stopped ---------------------------------------------------------------
    def _lost(self, mine: str, suspects: Sequence[int], error: Exception) -> PipelineFailure:
        """The failure this rank raises after a transfer or collective failed: the first
        recorded one with what this rank was doing or, if none is recorded, this rank's own
        finding about who stopped, recorded as the first."""
        # No longer blocked: the watchdog must not end the process while this thread reports.
        # What it waited for stays published: a rank finding who stopped meanwhile follows it
        # through this rank (an empty entry would make this rank look stuck in its own work).
        self._reporting = True
        first = self.first_failure(wait_s=self.grace_s)
        if first is None:
            culprit = self._who_stopped(suspects)
            if culprit is not None and len(culprit.chain) > 1:
                # a rank nearer to the culprit saw it first-hand: let its record win
                first = self.first_failure(wait_s=self.grace_s)
            if first is None:
                found = self._finding(culprit, suspects, mine, _short(error))
                first = self.record(found, None if culprit is None else culprit.rank)
                if first == found:
                    self._linger_if_store_host()
                    return PipelineFailure(found)
        self._linger_if_store_host()
        return PipelineFailure(f"{first}; {mine}")

    def _finding(self, culprit: _Culprit | None, suspects: Sequence[int], mine: str,
                 detail: str) -> str:
        if culprit is None:
            return f"one of ranks {list(suspects)} stopped answering ({detail}) while {mine}"
        via = "".join(f", which waits for rank {r}" for r in culprit.chain[1:])
        return (f"rank {culprit.rank} stopped answering ({culprit.why}) while {mine}{via} "
                f"[{detail}]")

    def _who_stopped(self, suspects: Sequence[int]) -> _Culprit | None:
        """Follow who-waits-for-whom from ``suspects`` to the rank that holds everyone up.

        Reads every rank's heartbeat, ``_window_s`` apart, then those that did not move for
        ``_confirm_s`` more, and every rank's ``wait/`` entry. The first rank reached whose
        heartbeat never moved has stopped (killed, frozen); failing that, the first live rank
        reached that waits for nobody.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = {r: self._store.add(f"hb/{r}", 0) for r in others}
            time.sleep(self._window_s)
            silent = {r for r in others if self._store.add(f"hb/{r}", 0) == before[r]}
            end = time.monotonic() + self._confirm_s
            while silent and time.monotonic() < end:
                time.sleep(self._interval)
                silent = {r for r in silent if self._store.add(f"hb/{r}", 0) == before[r]}
            waits = {r: self._published_wait(r) for r in others}
        except Exception:  # noqa: BLE001 - with env:// the store lives in rank 0's process
            return _Culprit(0, "the rendezvous store it hosts is gone", (0,))
        parent: dict[int, int | None] = {}
        frontier = [r for r in suspects if r != self.rank]
        for r in frontier:
            parent[r] = None
        idle: list[int] = []
        while frontier:
            nxt = []
            for r in frontier:
                w = waits[r]
                if r in silent:
                    doing = w.doing() if w else "computing, not waiting for any rank"
                    return _Culprit(r, f"no heartbeat; last seen {doing}",
                                    self._chain(parent, r))
                if w is None:
                    idle.append(r)
                    continue
                for b in self._blockers(r, w, waits):
                    if b not in parent and b != self.rank:
                        parent[b] = r
                        nxt.append(b)
            frontier = nxt
        if idle:
            r = idle[0]
            return _Culprit(r, "it is alive but waits for no rank: stuck in its own work",
                            self._chain(parent, r))
        stopped = sorted(silent)  # off the chain: still a better answer than none
        if stopped:
            return _Culprit(stopped[0], "no heartbeat", (stopped[0],))
        return None

    @staticmethod
    def _blockers(r: int, w: _Published, waits: dict[int, "_Published | None"]) -> list[int]:
        """Whom rank r waits for: its peer, or the ranks of its collective not in it yet."""
        if not w.collective:
            return list(w.ranks)
        return [m for m in w.ranks if m != r and waits.get(m) != w]

    @staticmethod
    def _chain(parent: dict[int, int | None], r: int) -> tuple[int, ...]:
        chain = [r]
        while parent.get(chain[-1]) is not None:
            chain.append(parent[chain[-1]])
        return tuple(reversed(chain))

    def _published_wait(self, r: int) -> _Published | None:
        key = f"wait/{r}"
        if not self._store.check([key]):
            return None
        return _Published.decode(self._store.get(key).decode(errors="replace"))

    def _ack(self) -> None:
        try:
            self._store.set(f"ack/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store host may be gone: nobody waits for this
            pass

    def _linger_if_store_host(self) -> None:
        # With env:// rendezvous the store lives in rank 0's process. Raising ends that process
        # soon after, and a rank still working out who failed (``_who_stopped`` watches
        # heartbeats for a window) would then find the store gone and blame rank 0. So rank 0
        # stays until every rank but the culprit has read the record, or ``_linger_s``: a
        # failure path only, so it costs nothing in training.
        if self.rank != 0:
            return
        end = time.monotonic() + self._linger_s
        while time.monotonic() < end:
            try:
                named = (int(self._store.get(_CULPRIT_KEY)) if self._store.check([_CULPRIT_KEY])
                         else None)
                if self._store.check([f"ack/{r}" for r in range(1, self.world_size) if r != named]):
                    return
            except Exception:  # noqa: BLE001 - nothing left to wait for
                return
            time.sleep(0.05)

    # -- watchdog --------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = self._interval
        while not self._stop.wait(interval):
            try:
                self._store.add(f"hb/{self.rank}", 1)
                self._publish_wait()
                fatal = self._check_blocked()
            except Exception:  # noqa: BLE001 - store gone: the main thread's wait will fail
                # (rank 0 leaves once every rank has read the failure: this one may have)
                fatal = self._blocked_after(self._seen) or self._store_lost()
            if fatal:
                print(f"PipelineFailure: {fatal}", file=sys.stderr, flush=True)
                self._linger_if_store_host()  # the others may still need the store
                os._exit(1)

    def _publish_wait(self) -> None:
        # From this thread, once per interval, so that waiting costs the main thread nothing;
        # a wait shorter than an interval may go unpublished, and only long ones matter here.
        wait = self._wait
        text = wait.encode() if wait is not None else ""
        if text != self._published:
            self._store.set(f"wait/{self.rank}", text)
            self._published = text

    def _check_blocked(self) -> str | None:
        wait = self._wait
        if wait is None or self._reporting:
            return None
        now = time.monotonic()
        # a collective has no single peer to watch: the process group's timeout bounds it
        if not wait.collective:
            peer = wait.ranks[0]
            count = self._store.add(f"hb/{peer}", 0)
            last = self._beats.get(peer)
            if last is None or last[0] != count:
                self._beats[peer] = (count, now)
            elif now - last[1] > self.timeout_s and now - wait.since > self.timeout_s:
                w = self._published_wait(peer)
                doing = w.doing() if w else "computing, not waiting for any rank"
                return self.record(culprit=peer, message=f"rank {peer} stopped answering (no heartbeat for "
                                   f"{now - last[1]:.0f} s; last seen {doing}) while rank "
                                   f"{self.rank} was waiting for {wait.what}")
        return self._blocked_after(self._read(0.0))

    def _blocked_after(self, first: str | None) -> str | None:
        """The failure to end this process with: ``first``, once the main thread has been
        blocked for two grace periods after one was recorded."""
        wait = self._wait
        if first is None or wait is None or self._reporting:
            return None
        return first if time.monotonic() - wait.since > self.grace_s * 2 else None

    def _store_lost(self) -> str | None:
        wait = self._wait
        if wait is None or time.monotonic() - wait.since < self.timeout_s:
            return None
        return (f"the rendezvous store stopped answering while rank {self.rank} was waiting "
                f"for {wait.what}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _backend_error(e: Exception) -> bool:
    """Whether ``e`` comes from the process group's backend (a peer gone, a timeout): NCCL's
    are ``DistError``; Gloo's are plain RuntimeErrors raised from its transport."""
    return isinstance(e, dist.DistError) or (type(e) is RuntimeError and "gloo" in str(e).lower())
