"""Testbed hooks, loaded by Python at start-up when this directory is first on PYTHONPATH.

Does nothing unless the testbed set one of:
- HAPT_TESTBED_SLOWDOWN=<factor>: the process's main thread needs factor x the CPU time for the
  same work: all of its work (modules, functional ops, loss, optimizer) is charged at a few points
  and paid by keeping the core busy (compute slow-down without a CPU quota);
- HAPT_TESTBED_SHIM=<json>: {"group_of_rank": [...], "links": {"a|b": [mbps or 0, latency_ms]}}:
  every point-to-point send to a rank of another group is delivered after latency +
  bytes/bandwidth by a background thread, so the sender computes meanwhile (link shaping without
  network namespaces; latency on top of namespaces, which lack netem).
Both patch torch only, so they act the same on any training framework built on it.
"""
import os

if os.environ.get("HAPT_TESTBED_SLOWDOWN") or os.environ.get("HAPT_TESTBED_SHIM"):
    try:
        import testbed_hooks  # noqa: F401  (same directory)
    except Exception as e:  # never stop the program itself from starting
        import sys
        print(f"[testbed] hooks not installed: {e}", file=sys.stderr)
