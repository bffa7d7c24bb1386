"""Run a function on N real gloo processes and collect what each rank returned or raised.

No mocks: each rank is a fresh process that joins a real process group through ``comms.init``, as it
would under torchrun. A rank that outlives the deadline is killed and reported as hung, so a hang is a
test failure, never a stuck suite.

Ranks are forked from one server process per test session (multiprocessing's forkserver) that has
imported torch and pipeclock once (``PRELOAD``): a rank then starts in a fraction of a second instead of
the seconds a fresh interpreter takes to import torch (more on a loaded machine), and still starts from a
clean state: no process group, no tensor computed, nothing a test patched. It gets the caller's
environment and working directory of the moment, as a spawned process would. Starting processes and
their process group still costs something, so tests put many cases into one call.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# What the rank server imports once, before it forks any rank: torch and the parts of pipeclock most tests
# run, and transformers for the Hugging Face tests (skipped where it is not installed). A test's own module
# is imported by its ranks, fast once these are loaded.
PRELOAD = [
    "torch",
    "torch.distributed",
    "pytest",
    "pipeclock.comms",
    "pipeclock.schedule",
    "pipeclock.training.loop",
    "pipeclock.cli.commands.train",
    "torch._dynamo",  # every optimizer's constructor imports it: 0.5 s a rank
    "matplotlib.pyplot",  # the timelines and the labs' figures: 0.4 s
    "transformers",
    "transformers.models.llama.modeling_llama",  # the first model class pulls in modeling_utils: 1 s
    "tests.distributed",
]


@dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    hung: bool = False
    exitcode: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_type is None and not self.hung and self.exitcode in (0, None)


class RanksFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    deadline: float = 240.0,
    linger: bool = True,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return every rank's outcome.

    ``timeout`` is given to ``comms.init`` (it bounds each blocking call; generous by default, so that a
    run expected to succeed does not fail on a busy machine: a test of timeouts gives its own short
    one); ``deadline`` bounds the whole
    run, after which remaining processes are killed and marked hung. With ``linger`` a rank that
    finished waits for the others before leaving; without it, it leaves at once, as a process that
    caught an error would.
    """
    return start_ranks(fn, world_size, *args, timeout=timeout, deadline=deadline, linger=linger).outcomes()


class Started:
    """Ranks started by `start_ranks`, running while the test does something else (another launch)."""

    def __init__(self, procs: list, results, end: float, between=None):
        self._procs, self._results, self._end = procs, results, end
        self._between = between  # kept: its semaphores live as long as this object, and ranks open them
        self._outcomes: list[RankOutcome] | None = None

    def outcomes(self) -> list[RankOutcome]:
        """Every rank's outcome, once all are done or the deadline has passed (what `run_ranks` returns)."""
        if self._outcomes is None:
            found = _collect(self._procs, self._results, self._end - time.monotonic())
            self._outcomes = [found[rank] for rank in range(len(self._procs))]
        return self._outcomes

    def values(self) -> list[Any]:
        """Each rank's value, asserting every rank succeeded (what `run_ok` returns)."""
        failed = [o for o in self.outcomes() if not o.ok]
        if failed:
            raise RanksFailed("\n".join(_describe(o) for o in failed))
        return [o.value for o in self.outcomes()]

    def stop(self) -> None:
        """Kill the ranks still running (a test that failed before it waited for them)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    deadline: float = 240.0,
    linger: bool = True,
) -> Started:
    """`run_ranks`, without waiting: the deadline counts from now."""
    context = _rank_server()
    results, between = context.Queue(), context.Barrier(world_size)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"] = str(world_size)
    procs = [
        context.Process(
            target=_rank_main, args=(rank, env, timeout, linger, fn, args, results, between), daemon=True
        )
        for rank in range(world_size)
    ]
    end = time.monotonic() + deadline
    for proc in procs:
        proc.start()
    return Started(procs, results, end, between)


def _rank_server() -> mp.context.BaseContext:
    """The forkserver context; its server starts at the first rank of the session, with ``PRELOAD``.
    (Where there is no forkserver, each rank is a fresh interpreter: slower, the same outcome.)"""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ok(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_ranks``, asserting every rank succeeded; returns each rank's value."""
    return start_ranks(fn, world_size, *args, **kwargs).values()


@dataclass
class Printed:
    """What a command said on one rank: its exit code, its standard output and its standard error."""

    code: int
    out: str
    err: str


def command(rank: int, world_size: int, argv: list[str]) -> Printed:
    """``python -m pipeclock ARGV`` on this rank (``pipeclock.cli.main``), as torchrun would start it but
    without torchrun's agent: for a job whose test needs the command, not the launcher (its restarts, its
    signals). Run it with ``start_ranks(command, world, argv)``.

    Commands run one after another on the same ranks start together: a command leaves its process group
    (``comms.shutdown``) and the next one forms a new one at the same address, so a rank that began the
    next one while a peer still finished the last would meet that peer's old store and group. Every rank
    waits for the others to end the previous command first (`between_commands`)."""
    from pipeclock import cli

    global _commands_run
    if _commands_run:
        between_commands()
    _commands_run += 1
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return Printed(code, out.getvalue(), err.getvalue())


_between = None  # this rank's barrier with its peers (`start_ranks`), outside any process group
_between_timeout = 120.0
_commands_run = 0  # the commands this rank has run


def between_commands() -> None:
    """Wait until every rank of this launch is here (each has ended its previous command); a peer that
    never comes (it failed or hangs) is an error after the launch's timeout, never a hang."""
    try:
        _between.wait(_between_timeout)
    except threading.BrokenBarrierError:
        raise RanksFailed(
            f"rank {os.environ['RANK']}: the other ranks did not end their command within "
            f"{_between_timeout:g}s, so the next one cannot start together"
        ) from None


def printed(job: Started) -> str:
    """What a `command` job printed (its ranks' standard output, rank 0 first: rank 0 speaks for a
    run), after asserting that every rank ended with exit code 0."""
    ranks = job.values()
    assert all(rank.code == 0 for rank in ranks), [(rank.code, rank.err) for rank in ranks]
    return "".join(rank.out for rank in ranks)


def _describe(outcome: RankOutcome) -> str:
    if outcome.hung:
        return f"rank {outcome.rank} hung"
    where = outcome.value if isinstance(outcome.value, str) else ""
    return f"rank {outcome.rank}: {outcome.error_type}: {outcome.error} (exit {outcome.exitcode})\n{where}"


def _collect(procs: list, results, deadline: float) -> dict[int, RankOutcome]:
    """Each rank's outcome, waiting at most ``deadline`` more seconds; those still running are killed."""
    outcomes: dict[int, RankOutcome] = {}
    end = time.monotonic() + deadline
    while len(outcomes) < len(procs):
        in_time = time.monotonic() < end  # past the deadline, only what is already queued is read
        try:
            outcome = pickle.loads(results.get(timeout=0.2 if in_time else 0))
            outcomes[outcome.rank] = outcome
        except Exception:
            for rank, proc in enumerate(procs):
                if rank not in outcomes and not proc.is_alive() and proc.exitcode is not None:
                    outcomes[rank] = RankOutcome(
                        rank, error_type="died", error="no result", exitcode=proc.exitcode
                    )
            if not in_time:
                break
    for rank, proc in enumerate(procs):
        proc.join(timeout=5 if rank in outcomes else 0)
        lingered = proc.is_alive()  # after its result, in the barrier a peer that failed never reached
        if lingered:
            proc.kill()
            proc.join()
        outcome = outcomes.setdefault(rank, RankOutcome(rank, hung=True))
        outcome.exitcode = None if outcome.hung or lingered else proc.exitcode  # our kill is not its exit
    return outcomes


def _rank_main(rank: int, env: dict, timeout: float, linger: bool, fn, args, results, between) -> None:
    global _between, _between_timeout
    os.environ.clear()  # the caller's environment, not the one the rank server started with
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=env["WORLD_SIZE"])
    _between, _between_timeout = between, timeout
    from pipeclock import comms

    start = time.monotonic()
    try:
        comms.init(timeout=timeout)
        value = fn(rank, int(env["WORLD_SIZE"]), *args)
        outcome = RankOutcome(rank, value=value)
    except BaseException as error:  # report everything, including SystemExit, to the parent
        outcome = RankOutcome(rank, error_type=type(error).__name__, error=str(error))
        outcome.value = traceback.format_exc()
    outcome.seconds = time.monotonic() - start
    # Plain pickle, by value: torch would send tensors through shared memory, gone once this rank exits.
    results.put(pickle.dumps(outcome))
    results.close()
    results.join_thread()
    if outcome.ok and linger:
        # Stay until every rank is done, so no rank leaves while a peer still reads from it.
        with contextlib.suppress(Exception):
            comms.barrier("leaving the test")
    # Leave without tearing down the process group: a peer may already be gone, and gloo's teardown
    # would then block or abort. The parent only needs the queued outcome.
    os._exit(0)
