"""A process that used torch.distributed ends cleanly: its collectives' worker threads are joined
before the interpreter finalizes.

Why this is needed: a Gloo worker thread frees a finished collective (an all-reduce, the
all-gather behind ``all_gather_object``) only a moment after the collective has returned to
Python, and freeing the Python objects of its tensors needs the GIL. On a loaded machine that
moment can come after the main thread has begun finalizing the interpreter; CPython then ends
the worker thread (``pthread_exit``) as it asks for the GIL, and that unwinding through the
work's destructor, which must not throw, calls ``std::terminate``: "terminate called without an
active exception", exit 134, after the program had printed its result (seen in a core dump:
``take_gil`` <- ``THPVariable_dealloc`` <- ``~AsyncAllgatherWork`` <- ``ProcessGroupGloo::runLoop``
while the main thread was in ``Py_FinalizeEx``). The same holds for a daemon thread inside a C++
call (the failure channel's watchdog in a store call).

What ends it: a process group's destructor joins its worker threads, and torch runs it with the
GIL released. So :func:`end_distributed_workers`, registered with :mod:`atexit` (which runs
before finalizing begins) the first time this process sets up distributed work, closes every
object registered with :func:`close_at_exit` (a runtime drops its groups and joins its
watchdog), destroys the process groups and collects the cycles that may still hold one: the
last reference goes, the destructors join the workers, and only then does finalizing start.
A normal ``return`` from ``main`` or ``sys.exit(code)`` ends the process, with its exit code.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["close_at_exit", "install", "end_distributed_workers"]

_to_close: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_installed = False


def install() -> None:
    """Register :func:`end_distributed_workers` with :mod:`atexit` (once per process)."""
    global _installed
    if not _installed:
        atexit.register(end_distributed_workers)
        _installed = True


def close_at_exit(obj: Any, method: str = "close") -> None:
    """Call ``obj.<method>()`` before the process groups are destroyed at exit, if ``obj`` is
    still alive then (it is held weakly: an object already gone needs nothing)."""
    _to_close[obj] = method
    install()


def end_distributed_workers() -> None:
    """Close what was registered, destroy the process groups and collect the garbage that may
    still hold one, so that every worker thread is joined. Safe to call more than once."""
    for obj, method in list(_to_close.items()):
        try:
            getattr(obj, method)()
        except Exception:  # noqa: BLE001 - at exit, one object's failure must not stop the rest
            pass
    _to_close.clear()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group already broken by a failed peer: nothing to end
            pass
    gc.collect()
