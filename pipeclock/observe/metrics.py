"""Measured, not claimed: a run's figures computed from what the ranks recorded.

Each rank keeps its steps' ``StepRecord``s (spans with start/end times, the loss, the activation peak)
and meters what the operating system or the GPU can tell (CPU time, resident memory, NVML
utilisation). ``gather_run`` brings it all to rank 0 in one message per rank, after the timed steps, so
measuring never slows the steps down. There the spans of one step form a ``Timeline`` (the same class
the simulator produces), from which busy %, bubble and step time are read.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch

from pipeclock import comms
from pipeclock.engine.orchestrator import StepRecord
from pipeclock.observe.timeline import Span, Timeline


class ProcessMeter:
    """CPU use of this process (as % of one core) over an interval, and its peak resident memory."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._wall = time.perf_counter()
        self._cpu = self._cpu_seconds()
        self.peak_rss = self._process.memory_info().rss

    def _cpu_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def sample_rss(self) -> None:
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)

    def cpu_percent(self) -> float:
        """CPU seconds per wall second since the meter was made, in % of one core."""
        wall = time.perf_counter() - self._wall
        return 100.0 * (self._cpu_seconds() - self._cpu) / wall if wall > 0 else 0.0


class GpuUtilization:
    """Samples this rank's GPU utilisation through NVML (what nvidia-smi reads) in a background thread.

    Does nothing without CUDA or NVML; ``mean`` is then None.
    """

    def __init__(self, interval: float = 0.05):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = _nvml_handle() if torch.cuda.is_available() else None
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
            self._thread.start()

    def _run(self, interval: float) -> None:
        import pynvml

        while not self._stop.wait(interval):
            self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def stop(self) -> float | None:
        """Stop sampling; the mean utilisation in %, or None when there is no GPU to ask."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        return statistics.fmean(self.samples) if self.samples else None


def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # no driver, no library: utilisation is simply not reported
        return None


@dataclass
class RankRun:
    """What one rank measured over a run (picklable, gathered to rank 0)."""

    rank: int
    steps: list[StepRecord]
    cpu_percent: float
    peak_rss: int
    gpu_utilization: float | None = None
    cuda_peak_bytes: int | None = None
    host: str = ""  # the machine (node) this rank ran on


@dataclass
class RunReport:
    """Every rank's measurements, on rank 0. Steps before ``warmup`` are left out of the figures, and so
    are the steps profiled for tensor parallel's collectives (``timed``: the profiler slows them)."""

    ranks: list[RankRun]
    chunks: int = 1
    warmup: int = 1
    timelines: list[Timeline] = field(init=False)

    def __post_init__(self) -> None:
        num_steps = min(len(r.steps) for r in self.ranks)
        self.warmup = min(self.warmup, max(0, num_steps - 1))
        self.timelines = [self._timeline(i) for i in range(num_steps)]

    def _timeline(self, step: int) -> Timeline:
        spans = [s for r in self.ranks for s in r.steps[step].spans]
        origin = min(s.start for s in spans)
        shifted = [Span(s.rank, s.action, s.start - origin, s.end - origin, s.wait) for s in spans]
        return Timeline(shifted, num_ranks=len(self.ranks), chunks=self.chunks)

    def timed(self, step: int) -> bool:
        """Whether ``step`` was profiled for tensor parallel's collectives (``observe.collectives``)."""
        return any(run.steps[step].collective_seconds is not None for run in self.ranks)

    @property
    def timed_steps(self) -> list[int]:
        return [step for step in range(len(self.timelines)) if self.timed(step)]

    @property
    def measured_steps(self) -> list[int]:
        """The steps the figures describe: after the warm-up, less the timed ones (unless all were)."""
        after = range(self.warmup, len(self.timelines))
        return [step for step in after if not self.timed(step)] or list(after)

    @property
    def measured(self) -> list[Timeline]:
        return [self.timelines[step] for step in self.measured_steps]

    def seconds_of(self, step: int) -> float:
        """A step's time: the slowest rank's ``step`` call, which includes its communication."""
        return max(r.steps[step].seconds for r in self.ranks)

    @property
    def median_index(self) -> int:
        """The measured step of median step time (the lower middle one for an even count): the step the
        headline figures and the pictures describe, one real step rather than an average of several."""
        measured = self.measured_steps
        return sorted(measured, key=self.seconds_of)[(len(measured) - 1) // 2]

    @property
    def step_seconds(self) -> float:
        """The median step's time."""
        return self.seconds_of(self.median_index)

    @property
    def bubble_share(self) -> float:
        """The median step's bubble: 1 - compute time / (ranks x step span)."""
        return self.timelines[self.median_index].bubble_share

    def busy_fraction(self, rank: int) -> float:
        """The share of the median step ``rank`` spent computing."""
        return self.timelines[self.median_index].busy_fraction(rank)

    def wait_fraction(self, rank: int) -> float:
        """Share of the step this rank spent blocked on receives inside its actions."""
        return statistics.fmean(
            sum(s.wait for s in t.spans_of(rank)) / t.makespan for t in self.measured if t.makespan
        )

    def sync_fraction(self, rank: int) -> float:
        """Share of the step this rank spent summing gradients across data-parallel replicas."""
        steps = [self.ranks[rank].steps[step] for step in self.measured_steps]
        return statistics.fmean(s.sync_seconds / s.seconds for s in steps if s.seconds)

    @property
    def data_parallel(self) -> bool:
        return any(step.syncs for run in self.ranks for step in run.steps)

    @property
    def hosts(self) -> list[str]:
        return sorted({run.host for run in self.ranks})

    def peak_activation_bytes(self, rank: int) -> int | None:
        peaks = [s.peak_activation_bytes for s in self.ranks[rank].steps]
        return None if None in peaks else max(peaks)  # type: ignore[type-var]


def gather_run(
    steps: list[StepRecord], meter: ProcessMeter, gpu: GpuUtilization | None = None, chunks: int = 1
) -> RunReport | None:
    """Collect every rank's measurements on rank 0 (one message per rank); None on the other ranks."""
    meter.sample_rss()
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    mine = RankRun(
        comms.get_rank(),
        steps,
        meter.cpu_percent(),
        meter.peak_rss,
        gpu and gpu.stop(),
        cuda_peak,
        socket.gethostname(),
    )
    gathered = comms.gather_object(mine, "gathering the run's measurements")
    return RunReport(gathered, chunks=chunks) if gathered is not None else None  # type: ignore[arg-type]
