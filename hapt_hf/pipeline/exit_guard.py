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

One more holder is torch's own: a few ``torch.distributed`` modules take ``group.WORLD`` as a
default argument (``torch.distributed.nn.functional``'s collectives, the ZeRO optimizer's
``_broadcast_object``), evaluated when the module is imported. Imported after
``init_process_group`` (``torch.distributed.optim`` and ``torch.distributed.pipelining`` import
them, and so does :mod:`hapt_hf.pipeline`), they hold the default group for the life of the
process, so destroying it frees nothing and its worker threads run into finalization: a script
that set up torch.distributed first and then imported hapt_hf aborted this way about once in 40
runs. :func:`end_distributed_workers` therefore also sets such captured defaults back to None
(which means the default group in each of those functions) before collecting.
"""
from __future__ import annotations

import atexit
import gc
import sys
import weakref
from types import FunctionType
from typing import Any

import torch.distributed as dist

__all__ = ["close_at_exit", "install", "end_distributed_workers", "release_captured_groups"]

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
    release_captured_groups()
    gc.collect()


def release_captured_groups() -> int:
    """Set every process group held as a default argument by a function of a loaded
    ``torch.distributed`` module back to None; returns how many were released."""
    released = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        for fn in _functions_of(module):
            released += _release_defaults(fn)
    return released


def _functions_of(module) -> list:
    """The module's own functions and the methods of its own classes."""
    out = []
    for obj in list(vars(module).values()):
        # type() and not isinstance(): a deprecated module attribute warns on any attribute
        # read (torch.distributed.reduce_op), and nothing should be printed at exit
        if type(obj) is FunctionType and obj.__module__ == module.__name__:
            out.append(obj)
        elif issubclass(type(obj), type) and obj.__module__ == module.__name__:
            for member in list(vars(obj).values()):
                if type(member) in (staticmethod, classmethod):
                    member = member.__func__
                if type(member) is FunctionType:
                    out.append(member)
    return out


def _release_defaults(fn) -> int:
    """Set the process groups among ``fn``'s default arguments to None; how many there were."""
    def held(d: Any) -> bool:
        return isinstance(d, dist.ProcessGroup)

    released = 0
    if fn.__defaults__ and any(map(held, fn.__defaults__)):
        released += sum(map(held, fn.__defaults__))
        fn.__defaults__ = tuple(None if held(d) else d for d in fn.__defaults__)
    if fn.__kwdefaults__ and any(map(held, fn.__kwdefaults__.values())):
        released += sum(map(held, fn.__kwdefaults__.values()))
        fn.__kwdefaults__ = {k: None if held(d) else d for k, d in fn.__kwdefaults__.items()}
    return released
