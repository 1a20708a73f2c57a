"""The testbed's torch patches (see sitecustomize.py for what they emulate and why).

Slow-down: a slowed rank needs ``factor`` times the CPU time for the same work. A pacer charges
the CPU time the main thread used since the last point and then keeps the core busy for
``factor - 1`` times that much more CPU time. Every op counts (modules, functional attention, the
loss, the optimizer, Python overhead), whatever framework issued it; waits use no CPU and so are
never stretched. Points: the end of every outermost module's forward, the end of every ``backward`` /
``autograd.grad`` call, every optimizer step, and before every send and wait (so a slowed rank's
activation leaves only after its slowed compute).

Why CPU time and a busy core rather than wall time and a sleep: on a machine whose cores are
shared, a process that sleeps loses its core and caches and wakes up slower (measured here: an
18 ms block took 28 ms after a 10 ms sleep), and wall time counts the time a rank waited for a
core; both stretched the slow-down well past its factor. A rank that needs more CPU time for the
same work competes for the cores as a slow device's host process would, and the gap between
groups stays at the factor whatever the machine's load.

Link shim: a send to another group is handed to a background thread per peer that issues the
real send once the emulated link would have delivered it; the caller gets a work object at once
and its compute overlaps the transfer, as on a real link.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["Pacer", "install_slowdown", "install_shim"]


class Pacer:
    """Makes the main thread spend ``factor`` times the CPU time of its work, charged at points."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.thread = threading.get_ident()
        self.debt = 0.0
        self.charged = 0.0  # CPU seconds of work seen, for tests and diagnostics
        self.paid = 0.0  # CPU seconds added
        self.enabled = True
        self.restart()

    def restart(self) -> None:
        """Start a new interval now (after a wait or a payment, which are not work)."""
        self.cpu = time.thread_time()

    def point(self) -> None:
        """Charge the work since the last point and pay the debt at once.

        Points are few (a forward, a backward, an optimizer step, a send, a wait): every
        payment costs the next op a cold start (measured: paying within each module's forward
        made a block's forward 3.4x slower at factor 2.5), so the debt is paid in few, long runs.
        """
        if not self.enabled or threading.get_ident() != self.thread:
            return
        work = time.thread_time() - self.cpu
        self.charged += work
        self.debt += (self.factor - 1.0) * work
        if self.debt > 0:
            paid = _spin(self.debt)
            self.paid += paid
            self.debt -= paid  # an overshoot is taken off the next intervals
        self.restart()


def _spin(cpu_s: float) -> float:
    """Keep this thread busy for ``cpu_s`` seconds of its own CPU time; returns what it used."""
    t0 = now = time.thread_time()
    while now - t0 < cpu_s:
        # the thread's CPU clock is a system call: read it every half millisecond and spin on
        # the wall clock in between (a pause spun on the CPU clock slowed the next small
        # forward+backward more: 3.1 ms of CPU against 2.8 ms, 2.2 ms without a pause)
        end = time.perf_counter() + min(cpu_s - (now - t0), 0.0005)
        while time.perf_counter() < end:
            pass
        now = time.thread_time()
    return now - t0


_PACER: Pacer | None = None


def _before_wait() -> None:
    if _PACER is not None:
        _PACER.point()


def _after_wait() -> None:
    if _PACER is not None and threading.get_ident() == _PACER.thread:
        _PACER.restart()


class _Handle:
    """What install_slowdown returns: ``remove()`` undoes it."""

    def __init__(self, undo) -> None:
        self._undo = undo

    def remove(self) -> None:
        self._undo()


def install_slowdown(factor: float) -> list[_Handle]:
    """Slow every compute of this process's main thread down by ``factor``."""
    global _PACER
    pacer = _PACER = Pacer(factor)
    depth = [0]  # module nesting: the outermost forward's end is a point

    def pre(module, args):
        depth[0] += 1

    def post(module, args, out):
        depth[0] = max(0, depth[0] - 1)
        if depth[0] == 0:
            pacer.point()

    def opt_post(optimizer, args, kwargs):
        pacer.point()

    from torch.optim.optimizer import register_optimizer_step_post_hook
    ag = torch.autograd
    orig_run_backward = ag._engine_run_backward

    def run_backward(*args, **kwargs):
        try:
            return orig_run_backward(*args, **kwargs)
        finally:
            pacer.point()

    work_cls = torch._C._distributed_c10d.Work
    orig_wait = work_cls.wait

    def wait(self, *args, **kwargs):
        _before_wait()
        try:
            return orig_wait(self, *args, **kwargs)
        finally:
            _after_wait()

    ag._engine_run_backward = run_backward
    work_cls.wait = wait
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
               register_optimizer_step_post_hook(opt_post)]

    def undo() -> None:
        global _PACER
        for h in handles:
            h.remove()
        ag._engine_run_backward = orig_run_backward
        work_cls.wait = orig_wait
        pacer.enabled = False
        _PACER = None
    return [_Handle(undo)]


class _DelayedWork:
    """The caller's handle on a send that a link thread issues later."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._work = None
        self._error: BaseException | None = None

    def _set(self, work, error: BaseException | None = None) -> None:
        self._work, self._error = work, error
        self._issued.set()

    def _real(self):
        if not self._issued.is_set():
            _before_wait()
            try:
                self._issued.wait()
            finally:
                _after_wait()
        if self._error is not None:
            raise self._error
        return self._work

    def wait(self, *args, **kwargs):
        return self._real().wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._issued.is_set() and (self._error is not None or self._work.is_completed())

    def __getattr__(self, name):
        return getattr(self._real(), name)


class _Link:
    """One direction of an emulated link: transfers queue behind each other at its rate."""

    def __init__(self, mbps: float, latency_ms: float) -> None:
        self.mbps, self.latency_s = mbps, latency_ms * 1e-3
        self.free_at = 0.0

    def arrival(self, nbytes: int) -> float:
        """When a send of ``nbytes`` handed over now has fully arrived at the peer."""
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + (nbytes * 8 / (self.mbps * 1e6) if self.mbps else 0.0)
        return self.free_at + self.latency_s


def _sender(jobs: "queue.Queue") -> None:
    """A peer's link thread: issues sends in order, each once its emulated arrival time comes."""
    while True:
        job = jobs.get()
        if job is None:
            return
        at, send, args, handle = job
        time.sleep(max(0.0, at - time.perf_counter()))
        try:
            handle._set(send(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's wait()
            handle._set(None, e)
        # hold no process group between jobs: one still referenced here when the interpreter
        # exits is destroyed during its tear-down, which aborts the process
        del job, send, args, handle


def install_shim(cfg: dict) -> None:
    """Deliver each send to another group after latency + bytes / bandwidth, off the caller's thread.

    Patched on ProcessGroup.send, which dist.send, dist.isend and batch_isend_irecv all reach,
    so every framework's p2p goes through it.
    """
    group_of = cfg["group_of_rank"]
    shapes = {tuple(k.split("|")): v for k, v in cfg["links"].items()}
    pg_cls = torch._C._distributed_c10d.ProcessGroup
    orig_send = pg_cls.send
    links: dict[tuple[str, str], _Link] = {}
    queues: dict[int, queue.Queue] = {}
    threads: list[threading.Thread] = []
    lock = threading.Lock()

    def stop() -> None:  # at exit: let queued sends go out, then end the link threads
        for q in queues.values():
            q.put(None)
        for t in threads:
            t.join(timeout=30)
    atexit.register(stop)

    def send(self, tensors, dst, tag=0):
        try:
            peer = dist.get_global_rank(self, dst)
        except (RuntimeError, ValueError):
            peer = dst  # the default group: local and global ranks agree
        a, b = group_of[dist.get_rank()], group_of[peer]
        shape = shapes.get((a, b)) or shapes.get((b, a)) if a != b else None
        if not shape:
            return orig_send(self, tensors, dst, tag)
        _before_wait()  # the data leaves after the compute that made it
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with lock:
            link = links.setdefault((a, b), _Link(*shape))
            at = link.arrival(nbytes)
            if peer not in queues:
                queues[peer] = queue.Queue()
                thread = threading.Thread(target=_sender, args=(queues[peer],), daemon=True,
                                          name=f"testbed-link-{peer}")
                thread.start()
                threads.append(thread)
        handle = _DelayedWork()
        queues[peer].put((at, orig_send, (self, tensors, dst, tag), handle))
        _after_wait()
        return handle

    pg_cls.send = send


if os.environ.get("HAPT_TESTBED_SLOWDOWN"):
    _f = float(os.environ["HAPT_TESTBED_SLOWDOWN"])
    if _f > 1.0:
        install_slowdown(_f)
if os.environ.get("HAPT_TESTBED_SHIM"):
    install_shim(json.loads(os.environ["HAPT_TESTBED_SHIM"]))
