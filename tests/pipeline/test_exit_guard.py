"""The exit guard: what it ends at exit, checked in a fresh interpreter (it acts on the process)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, gc, sys, weakref
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from hapt_hf.pipeline import exit_guard, init_distributed
from hapt_hf.pipeline.comm import FailureChannel

init_distributed(single_process=True)
world = weakref.ref(dist.group.WORLD)
sub = dist.new_group([0])
group = weakref.ref(sub)
channel = FailureChannel("t", 0, 5.0)

class Holder:  # an object alive at exit that holds a group, like a runtime not shut down
    def __init__(self):
        self.group, self.closed = sub, False
    def close(self):
        self.group, self.closed = None, True

holder = Holder()
exit_guard.close_at_exit(holder)
del sub
assert channel._thread.is_alive()
assert world() is not None and group() is not None
exit_guard.end_distributed_workers()
print("closed", holder.closed, "watchdog", channel._thread.is_alive(),
      "initialised", dist.is_initialized(), "world", world() is None, "group", group() is None)
exit_guard.end_distributed_workers()  # a second call (atexit's) finds nothing left to do
"""


@pytest.mark.multiproc
def test_end_closes_holders_joins_the_watchdog_and_frees_every_group(tmp_path):
    script = tmp_path / "guard.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    # every process group object is gone: its destructor ran, which joins its worker threads
    assert run.stdout.split() == ["closed", "True", "watchdog", "False", "initialised", "False",
                                  "world", "True", "group", "True"], run.stdout


def test_setting_up_registers_the_guard_with_atexit(monkeypatch):
    import atexit

    from hapt_hf.pipeline import exit_guard
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(exit_guard, "_installed", False)
    exit_guard.install()
    exit_guard.install()
    assert registered == [exit_guard.end_distributed_workers]
