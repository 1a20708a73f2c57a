"""Run a function on N local Gloo processes (127.0.0.1, a free port) and collect what each returns.

Multi-process tests need the same few things every time: a free port chosen at run time,
``OMP_NUM_THREADS=1`` so that N ranks do not thrash a small machine, the process group set up
from the environment as ``torchrun``/``accelerate launch`` would set it, every rank's result or
traceback brought back, and a rank that dies (killed, ``os._exit``) reported with its exit code
and the end of its stderr instead of a hang.

    def work(rank: int, world_size: int, n: int) -> int:
        return rank * n

    outcomes = run_ranks(work, 2, 10)          # [RankOutcome(rank=0, value=0), ...]
    values = [o.value for o in outcomes]

``fn`` is found again in the child by its source file and qualified name, so test modules
imported by pytest's ``importlib`` mode can define their workers at module level. Tests and
benchmarks read it from the checkout (``benchmarks.ranks``); it is not part of the installed package.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["RankOutcome", "DistributedRunError", "free_port", "run_ranks"]

# Imported once by the fork server, so that every rank of every run starts with them loaded
# (importing torch and transformers costs seconds per process on a small machine).
PRELOAD = ("torch", "torch.distributed", "transformers",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "hapt_hf.pipeline")
_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(list(PRELOAD))
    return _ctx


@dataclass(frozen=True)
class RankOutcome:
    """What one rank left behind."""

    rank: int
    value: Any = None
    """What ``fn`` returned (None if it raised or the process died)."""
    error: str | None = None
    """Traceback text if ``fn`` raised, or why no result came back."""
    exitcode: int | None = None
    """The process's exit status (negative: killed by that signal)."""
    stderr_tail: str = ""
    """The last lines the process wrote to stderr (useful when it died without a result)."""
    elapsed_s: float = 0.0
    """Seconds from the start of ``fn`` to its result or error (0 if the process died)."""
    ended_at: float | None = None
    """``time.monotonic()`` (one clock for every process of the machine) when the parent saw
    the process end, within 0.2 s; None if it was still running at the deadline."""

    @property
    def ok(self) -> bool:
        return self.error is None


class DistributedRunError(RuntimeError):
    """One or more ranks failed; the message holds every failed rank's error."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _FnRef:
    """A picklable pointer to a module-level function: module name, source file, name."""

    module: str
    path: str
    qualname: str

    @classmethod
    def of(cls, fn: Callable) -> "_FnRef":
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise ValueError(f"run_ranks needs a module-level function, got {fn.__qualname__!r}; "
                             "define the worker at the top level of its module")
        return cls(fn.__module__, inspect.getsourcefile(fn) or "", fn.__qualname__)

    def load(self) -> Callable:
        try:
            if self.module == "__main__":  # a script: its __main__ is not the child's
                raise ImportError(self.module)
            mod = importlib.import_module(self.module)
        except ImportError:
            # pytest's importlib mode gives test modules names that are not importable
            spec = importlib.util.spec_from_file_location(f"_ranks_{Path(self.path).stem}",
                                                          self.path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        obj: Any = mod
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _child(ref: _FnRef, rank: int, world_size: int, port: int, args: tuple, env: dict,
           init_pg: bool, pg_timeout_s: float, stderr_path: str, results: Any,
           peers_done: Any, linger_s: float) -> None:
    # stderr goes to a file so that a rank that dies still leaves its last words
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **env})
    start = time.monotonic()
    ok = False
    try:
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if init_pg:  # from the variables set above, as under torchrun; Gloo even with a GPU
            from hapt_hf.pipeline.process_group import init_distributed
            init_distributed(pg_timeout_s, backend="gloo")
        value = ref.load()(rank, world_size, *args)
        results.put((rank, True, value, time.monotonic() - start))
        ok = True
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc(), time.monotonic() - start))
    results.close()
    results.join_thread()
    if ok and rank == 0 and world_size > 1:
        # rank 0 hosts the rendezvous store (MASTER_PORT), as under a plain env:// start: a
        # rank 0 done first stays until its peers are done with the store, as torchrun's agent
        # store outlives the ranks (a slow peer still polling a barrier would otherwise find
        # the store gone). Only after success: a failed rank 0 ends at once, and a frozen peer
        # is a failure test's business
        peers_done.wait(linger_s)
    sys.stderr.flush()
    # skip interpreter teardown: destroying a process group whose peers are gone can block;
    # a rank whose function raised exits non-zero, as the program it stands for would
    os._exit(0 if ok else 1)


def _note_ended(procs: list, ended: dict[int, float], first: int = 0) -> None:
    """Note when each process (numbered from ``first``) is first seen to have ended."""
    for r, p in enumerate(procs, start=first):
        if r not in ended and not p.is_alive():
            ended[r] = time.monotonic()


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0,
              init_process_group: bool = True, pg_timeout_s: float = 60.0,
              env: dict[str, str] | None = None, check: bool = True) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    The processes come from a fork server that has imported :data:`PRELOAD` once (no CUDA, no
    threads started), so a run costs no repeated imports; every rank still gets its own
    interpreter state, environment and process group.

    Args:
        fn: a module-level function; its return value must be picklable.
        timeout_s: wall-clock bound for the whole run; ranks still running then are killed and
            reported as such.
        init_process_group: set up the default Gloo process group before calling ``fn``.
        pg_timeout_s: the process group's own timeout (bounds any collective that never ends).
        env: extra environment variables for every rank.
        check: raise DistributedRunError if any rank failed; otherwise return the outcomes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    peers_done = ctx.Event()
    port = free_port()
    ref = _FnRef.of(fn)
    tmp = tempfile.mkdtemp(prefix="ranks_")
    paths = [os.path.join(tmp, f"rank{r}.stderr") for r in range(world_size)]
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(ref, r, world_size, port, args, dict(env or {}),
                               init_process_group, pg_timeout_s, paths[r], results,
                               peers_done, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any, float]] = {}
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world_size and time.monotonic() < deadline:
        _note_ended(procs, ended)
        if all(r in got or not p.is_alive() for r, p in enumerate(procs) if r):
            peers_done.set()  # rank 0 may leave: no other rank uses the store any more
        try:
            rank, ok, payload, took = results.get(timeout=0.2)
            got[rank] = (ok, payload, took)
        except queue.Empty:
            # a process that died without a result will never send one
            if all(not p.is_alive() or r in got for r, p in enumerate(procs)):
                try:
                    while True:
                        rank, ok, payload, took = results.get(timeout=0.5)
                        got[rank] = (ok, payload, took)
                except queue.Empty:
                    break
    peers_done.set()  # every rank has answered (or died, or the deadline passed)
    killed: set[int] = set()
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            killed.add(r)
            p.kill()
            p.join(timeout=5)
        else:
            _note_ended([p], ended, first=r)
    outcomes = []
    for r, p in enumerate(procs):
        tail = _tail(paths[r])
        if r in got:
            ok, payload, took = got[r]
            outcomes.append(RankOutcome(r, payload if ok else None, None if ok else payload,
                                        p.exitcode, tail, took, ended.get(r)))
        else:
            why = (f"rank {r} was still running after {timeout_s:.0f} s and was killed"
                   if r in killed else f"rank {r} died with exit code {p.exitcode} "
                   "before returning a result")
            outcomes.append(RankOutcome(r, None, why, p.exitcode, tail,
                                        ended_at=ended.get(r)))
    if check and any(not o.ok for o in outcomes):
        raise DistributedRunError("\n\n".join(
            f"--- rank {o.rank} (exit {o.exitcode}) ---\n{o.error}\n{o.stderr_tail}"
            for o in outcomes if not o.ok))
    return outcomes
