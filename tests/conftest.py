"""Settings for the whole test session, made before any test module imports torch, and the order in
which `make test`'s two workers take the modules (below).

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

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# --- how `make test` shares the tests between two workers (pytest-xdist, --dist loadfile) ------------------
#
# A module's tests stay together on one worker, so that its shared launches (module fixtures) run once. The
# modules that take longest go first, so that no worker is left running one of them at the end while the
# other waits: `make test` took 8:53 so, 9:17 in the order of their names. (Seconds on 2 quiet cores,
# serial, over two runs; an order, not a promise: a stale one only costs time.)
SLOWEST_FIRST = (
    "test_hf_families",  # ~100 s, `long`
    "test_faults",  # 54 s
    "test_docs",  # ~50 s
    "test_pipeline_matrix",  # 43 s
    "test_data_parallel_runs",  # 38 s
    "test_tensor_parallel",  # 37 s
    "test_labs",  # ~25 s
    "test_data_parallel",  # 22 s
    "test_hf_pipeline",  # 21 s
    "test_generation",  # 20 s
    "test_bench",  # 19 s
    "test_gpt_pipeline",  # 9-23 s
    "test_newcomer_inputs",  # 14-21 s
    "test_loop_check",  # 9-16 s
    "test_cli",  # 5-15 s
    "test_recompute",  # 11-15 s
    "test_pipeline_measurements",  # 11-15 s
    "test_installed",  # 8-12 s
    "test_bad_input",  # 10-12 s
    "test_folder_lock",  # 12 s
    "test_gpt_training",  # 8-12 s
    "test_checkpoint",  # 11 s
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: the rest as they were
