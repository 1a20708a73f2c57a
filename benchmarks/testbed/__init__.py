"""An emulated heterogeneous cluster on one machine: slowed CPU ranks and shaped links.

See docs/testbed.md. The planner never reads the testbed file; it profiles the ranks.
"""
from .launch import Mechanisms, RankResult, Testbed, free_port
from .spec import GroupSpec, LinkShape, TestbedError, TestbedSpec, load_testbed

__all__ = ["TestbedSpec", "GroupSpec", "LinkShape", "TestbedError", "load_testbed", "Testbed",
           "Mechanisms", "RankResult", "free_port"]
