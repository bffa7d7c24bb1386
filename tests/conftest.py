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
# other waits: `make test` took 8:53 so, 9:17 in the order of their names. (Seconds each module took under
# two workers on 2 quiet cores, over two runs; an order, not a promise: a stale one only costs time.)
SLOWEST_FIRST = (
    "test_hf_families",  # ~100 s, `long`
    "test_hf_tp_families",  # ~100 s, `long`
    "test_whole_runs",  # 76-95 s, `long` (on 2 cores under a load average of 6)
    "test_compile",  # 70-90 s with `long` (inductor compiles), 16-30 s without
    "test_walkthrough",  # 45 s, `long`
    "test_wrong_loops",  # 4 s, 75 s with `long` (33 checks, a few of them deadlocks)
    "test_optimizer",  # 30 s, 70 s with `long`
    "test_docs",  # 120 s
    "test_pipeline_matrix",  # 85-100 s before each model and reference was built once per launch
    "test_faults",  # 55-77 s with nine deaths; four now (the nine are `long`)
    "test_data_parallel_runs",  # 44-55 s
    "test_tensor_parallel",  # 48-52 s with the train command's tp runs, now in test_tp_training
    "test_tp_training",
    "test_data_parallel",  # 37 s
    "test_gpt_pipeline",  # 33-38 s
    "test_hf_pipeline",  # 25-39 s
    "test_newcomer_inputs",  # 28-36 s
    "test_bench",  # 26-40 s
    "test_pipeline_measurements",  # 28 s
    "test_generation",  # 26 s
    "test_recompute",  # 22-25 s
    "test_labs",  # 12-40 s (with test_docs on one worker, they share its lab runs)
    "test_cli",  # 20 s
    "test_installed",  # 15-22 s
    "test_folder_lock",  # 15-23 s
    "test_loop_check",  # 15-17 s
    "test_gpt_training",  # 14 s
    "test_data",  # 16 s, 55 s with `long`
    "test_v_schedules",  # 14 s
    "test_bad_input",  # 10-14 s
    "test_generators",  # 13 s
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: the rest as they were
