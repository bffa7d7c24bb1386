"""Settings for the whole test session, made before any test module imports torch.

OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``). By default a thread that
has finished its share of an operation spins for a while, waiting for the next one; when other processes
share the cores, the spinning thread holds a core that the thread it waits for needs, and a process with
two intra-op threads runs many times slower (lab 1's step on 2 cores loaded by other work: 650 ms
spinning, 17 ms sleeping). The policy changes how threads wait, not how many there are nor what they
compute. libgomp reads it when it is loaded (with torch), so it is set here, and every process the tests
start inherits it: the ranks, the torchrun jobs, the pages' commands.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
