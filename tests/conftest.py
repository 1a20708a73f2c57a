import os
import sys
from pathlib import Path

# Multi-process tests run Gloo ranks on one machine; one thread each keeps 2 cores from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# benchmarks/ is not an installed package: its input helpers are read from the checkout
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
