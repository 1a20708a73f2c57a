import os

# Multi-process tests run Gloo ranks on one machine; one thread each keeps 2 cores from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
