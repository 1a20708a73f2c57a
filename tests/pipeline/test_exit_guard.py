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
from hapt_hf.pipeline.failure import FailureChannel

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


LATE_IMPORT_SCRIPT = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
# imported after set-up, as a script that sets up torch.distributed itself and then imports
# hapt_hf does: torch.distributed.nn's collectives take group.WORLD as a default argument
sys.path.insert(0, sys.argv[1])
from hapt_hf.pipeline import exit_guard

def gloo_workers():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            n += open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo")
        except OSError:
            pass
    return n

before = gloo_workers()
exit_guard.end_distributed_workers()
print(before, gloo_workers())
"""


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_group_held_by_torchs_default_arguments_is_freed_too(tmp_path):
    # the default group captured by torch.distributed.nn.functional when it is imported after
    # init_process_group kept Gloo's worker threads running into interpreter finalization
    script = tmp_path / "late.py"
    script.write_text(LATE_IMPORT_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(ROOT), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = map(int, run.stdout.split())
    assert before > 0 and after == 0, run.stdout


def test_release_captured_groups_sets_a_default_group_back_to_none(monkeypatch):
    import torch.distributed as dist

    from hapt_hf.pipeline import exit_guard
    group = dist.ProcessGroup.__new__(dist.ProcessGroup)  # an object of the type, never set up

    def collective(tensor, group=group, *, other=group, keep=3):
        return tensor

    monkeypatch.setattr(collective, "__module__", "torch.distributed.fake_for_test")
    module = type(sys)("torch.distributed.fake_for_test")
    module.collective = collective
    monkeypatch.setitem(sys.modules, "torch.distributed.fake_for_test", module)
    assert exit_guard.release_captured_groups() >= 2
    assert collective.__defaults__ == (None,)
    assert collective.__kwdefaults__ == {"other": None, "keep": 3}
