"""The fault matrix: a rank SIGKILLed at every place it can die, and the run still ends as if it had not.

One ``torchrun --max-restarts K`` job per layout (2 ranks, 4 ranks, dp 2 x pp 2) dies K times, once
per attempt, each time at another place (``PIPECLOCK_FAULT``, ``pipeclock.engine.faults``). For every
death the test reads the log and checks that each survivor printed one clear error of its own, naming
its rank and what it was waiting for, before anything stopped it (so within the timeout: a survivor that
has said nothing after ``--timeout`` seconds says so instead); that torchrun restarted the group; and
that the restarted attempt resumed from the newest checkpoint there was (nothing lost beyond it). The
job's losses must then equal, bit for bit, those of the same run left alone.

Each rank's stderr goes to a file of its own per attempt, so two survivors' lines printed at the same
moment cannot interleave. The test writes what it saw as tables; docs/faults.md shows them, and the test
fails when the page says anything else (``PIPECLOCK_WRITE_FAULTS=1`` writes the page instead). The
default suite runs a 2-rank job dying at four of the places (``QUICK``); the whole 2-rank matrix runs with
the long tests, and the other two layouts, about two minutes each on 2 cores, with
``PIPECLOCK_FAULTS_ALL=1`` as well.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeclock import comms
from pipeclock.engine import faults
from tests.distributed import command, printed, start_ranks
from tests.jobs import Launch, final_loss, losses_of

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "faults.md"
MODEL = dict(hidden=32, layers=8, batch_size=16, microbatches=4, timeout=20)
ALL_LAYOUTS = os.environ.get("PIPECLOCK_FAULTS_ALL") == "1"
WRITE = os.environ.get("PIPECLOCK_WRITE_FAULTS") == "1"
JOB_TIMEOUT = 500.0  # a job that hangs fails the test after this (seconds); each layout's job is one test's
pytestmark = pytest.mark.timeout(2 * JOB_TIMEOUT)


@dataclass(frozen=True)
class Layout:
    name: str
    processes: int
    dp: int
    schedule: str  # zb-h1 splits the backward into I and W; 1f1b runs it whole, as B
    victims: dict[str, int]  # place -> the rank that dies there, in the order the attempts die

    def plan(self) -> tuple[list[faults.Fault], list[int], int]:
        """The fault of each attempt, the step each attempt resumes from, and the run's length.

        Attempt k resumes from the newest checkpoint (one per step) and dies at place k: one step later
        for a death in a step (so the next attempt has one step more), in the save of the next step (so
        the next attempt has none), or in the resume itself.
        """
        planned, resumes, at = [], [], 0
        for place in self.victims:
            resumes.append(at)
            step = at if place == "resume" else at + 1
            planned.append(faults.Fault(place, self.victims[place], step))
            at += place not in ("save", "resume")
        resumes.append(at)
        return planned, resumes, at + 2


# The default suite's cross-section of the 2-rank matrix: a death in a forward, in a receive, in rank 0 (the
# store's host) while it saves, and in a resume; the whole matrix (and its page) runs with the long tests.
QUICK = Layout("2 ranks, 4 places", 2, 1, "zb-h1", dict(F=1, recv=1, save=0, resume=1))
LAYOUTS = [
    Layout("2 ranks", 2, 1, "zb-h1", dict(F=1, I=1, W=1, send=0, recv=1, gather=1, loss=0, save=0, resume=1)),
    Layout("4 ranks", 4, 1, "zb-h1", dict(F=2, I=1, W=2, send=1, recv=3, gather=3, loss=1, save=0, resume=2)),
    Layout("dp 2 x pp 2", 4, 2, "1f1b", dict(F=3, B=1, send=2, recv=3, gather=1, loss=2, save=0, resume=3)),
]


def _flags(layout: Layout, directory: Path, steps: int, restarts: int) -> list[str]:
    options = {**MODEL, "schedule": layout.schedule, "steps": steps, "dp": layout.dp}
    options |= {"checkpoint_dir": directory / "checkpoints"}
    options |= {"checkpoint_every": 1, "losses": directory / "losses.json"}
    flags = ["train", "--resume"] if restarts else ["train"]
    for name, value in options.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


# --- reading a job's log -----------------------------------------------------------------------------------

FAULT_LINE = re.compile(
    r"^pipeclock fault: rank (\d+) SIGKILLs itself at (\S+) of step (\d+) \(attempt (\d+)\)$"
)
ERROR_LINE = re.compile(r"^pipeclock train: error: (.*)$")
# torch's C++ log (a store client's retries, each with its stack frames) and its abort: not for a user
CPP_LOG = re.compile(r"terminate called|Exception raised from|^frame #|\[c10d\]")


@dataclass
class Death:
    fault: faults.Fault
    attempt: int
    errors: list[str]  # the survivors' error lines, in the order printed
    others: list[str]  # any other pipeclock line printed meanwhile (a "stopped" line), a traceback, C++ logs


def deaths(rank_logs: Path) -> list[Death]:
    """Each attempt that died: its fault line, and what every rank printed in that attempt.

    ``rank_logs`` is torchrun's ``--log-dir``: ``<run>/attempt_<k>/<rank>/stderr.log``.
    """
    found: list[Death] = []
    for attempt in sorted(rank_logs.glob("*/attempt_*"), key=lambda path: int(path.name.split("_")[1])):
        lines = [
            line for log in sorted(attempt.glob("*/stderr.log")) for line in log.read_text().splitlines()
        ]
        matches = [match for line in lines if (match := FAULT_LINE.match(line))]
        if not matches:
            continue  # the attempt that ran clean
        rank, place, step, attempt_number = matches[0].groups()
        death = Death(faults.Fault(place, int(rank), int(step)), int(attempt_number), [], [])
        for line in lines:
            if FAULT_LINE.match(line):
                continue
            if match := ERROR_LINE.match(line):
                death.errors.append(match.group(1))
            elif line.startswith("pipeclock") or "Traceback" in line or CPP_LOG.search(line):
                death.others.append(line)
        found.append(death)
    return found


def survivor_rank(error: str) -> int:
    return int(re.match(r"rank (\d+): ", error).group(1))


def shown(error: str, directory: Path) -> str:
    """An error as the page shows it: the checkpoint directory and the micro-batch left out, as they
    change with the machine and with how far a survivor got before it noticed."""
    error = error.replace(f"{directory / 'checkpoints'}/", "")
    error = re.sub(r"micro-batch \d+", "a micro-batch", error)
    error = re.sub(r"; rank \d+ most likely died first \(.*\)$", "", error)  # comm_blame's chain
    return re.sub(r"; (rank \d+|a peer) most likely died \(see its log\)$", "", error)


def resumes(stdout: str, found: list[Death]) -> list[int]:
    """The step each attempt started from: as it said (0 when it started fresh), or for an attempt that
    died resuming, as its fault line said."""
    started = r"^(?:resumed from \S+ at step (\d+) |no checkpoint in \S+ to resume from)"
    said = iter(int(step or 0) for step in re.findall(started, stdout, re.M))
    attempts = [death.fault for death in found] + [None]
    return [fault.step if fault and fault.place == "resume" else next(said, -1) for fault in attempts]


# --- the jobs ---------------------------------------------------------------------------------------------


@dataclass
class Matrix:
    layout: Layout
    directory: Path
    planned: list[faults.Fault]
    expected_resumes: list[int]
    stdout: str
    stderr: str  # torchrun's own
    rank_logs: Path  # each rank's stderr, per attempt
    reference_stdout: str

    def deaths(self) -> list[Death]:
        return deaths(self.rank_logs)

    def losses(self) -> tuple[int, list[float]]:
        return losses_of(self.directory / "losses.json")

    def reference_losses(self) -> tuple[int, list[float]]:
        return losses_of(self.directory / "reference" / "losses.json")


def run_matrix(layout: Layout, tmp: Path) -> Matrix:
    """The layout's job dying at every place, and beside it the same job left alone (the train command on
    forked ranks: it tests no launcher, and the same threads per rank give the same bits)."""
    planned, expected, steps = layout.plan()
    directory, reference = tmp / "killed", tmp / "killed" / "reference"
    reference.mkdir(parents=True)
    os.environ[faults.VARIABLE] = ",".join(map(str, planned))
    try:
        job = Launch(directory / "job", layout.processes, _flags(layout, directory, steps, len(planned)),
                     restarts=len(planned), rank_logs=directory / "ranks")  # fmt: skip
    finally:
        del os.environ[faults.VARIABLE]
    alone = start_ranks(command, layout.processes, _flags(layout, reference, steps, 0), deadline=JOB_TIMEOUT)
    try:
        reference_stdout = printed(alone)
        with contextlib.suppress(subprocess.TimeoutExpired):  # ten attempts take longer than one
            job.proc.wait(timeout=JOB_TIMEOUT)
        stdout = job.result()
    finally:
        job.stop()
        alone.stop()
    stderr = (directory / "job.err").read_text()
    return Matrix(layout, directory, planned, expected, stdout, stderr, directory / "ranks", reference_stdout)


@pytest.fixture(
    scope="module",
    params=[QUICK, *(pytest.param(layout, marks=pytest.mark.long) for layout in LAYOUTS)],
    ids=lambda layout: layout.name,
)
def matrix(request, tmp_path_factory) -> Matrix:
    layout = request.param
    if layout.processes > 2 and not ALL_LAYOUTS:
        pytest.skip("PIPECLOCK_FAULTS_ALL=1 runs the 4-rank and dp 2 x pp 2 matrices (2 min each, 2 cores)")
    return run_matrix(layout, tmp_path_factory.mktemp(layout.name.replace(" ", "")))


# --- the properties ---------------------------------------------------------------------------------------


def test_each_attempt_dies_where_planned_and_the_last_runs_clean(matrix):
    found = matrix.deaths()
    assert [death.fault for death in found] == matrix.planned
    assert [death.attempt for death in found] == list(range(len(matrix.planned)))


def test_every_survivor_says_once_which_peer_it_lost_and_nothing_else_is_printed(matrix):
    world = matrix.layout.processes
    for death in matrix.deaths():
        survivors = sorted(survivor_rank(error) for error in death.errors)
        assert survivors == [r for r in range(world) if r != death.fault.rank], (death.fault, death.errors)
        assert all("lost the connection to" in error for error in death.errors), death.errors
        assert death.others == [], (death.fault, death.others)  # no traceback, no C++ log, no "stopped"
    assert "Traceback" not in matrix.stderr  # nor in torchrun's own output


def test_each_restart_resumes_from_the_newest_checkpoint_there_was(matrix):
    assert resumes(matrix.stdout, matrix.deaths()) == matrix.expected_resumes
    assert not list((matrix.directory / "checkpoints").glob("*.partial")), "the killed save was redone"


def test_the_job_ends_with_the_losses_of_the_run_left_alone_bit_for_bit(matrix):
    first, losses = matrix.losses()
    start, reference = matrix.reference_losses()
    assert start == 0 and first == matrix.expected_resumes[-1]
    assert losses == reference[first:]
    assert final_loss(matrix.stdout) == final_loss(matrix.reference_stdout)


def test_the_page_shows_what_the_matrix_measured(matrix):
    if matrix.layout is QUICK:
        pytest.skip("the page shows the whole matrices: the 2-rank one is compared with the long tests")
    table = fault_table(matrix)
    text = PAGE.read_text()
    begin, end = f"<!-- faults: {matrix.layout.name} -->", "<!-- end faults -->"
    before, rest = text.split(begin + "\n", 1)
    current, after = rest.split(end, 1)
    measured = "\n".join(table) + "\n"
    if WRITE:
        PAGE.write_text(before + begin + "\n" + measured + end + after)
        current = measured
    wanted = f"docs/faults.md ({matrix.layout.name}) should read:\n{measured}"
    assert _timing_free(current) == _timing_free(measured), wanted


def _timing_free(table: str) -> list[str]:
    """A table with each survivor's message cut to its rank: what a survivor was doing when it noticed
    (waiting for a gradient, for the next step's batch size, or already for the loss) depends on how far
    it got, so the page shows one run's words, and the test (which checks every message's form) compares
    the rest."""
    return [re.sub(r"(rank \d+): [^|]*?(?=<br>| \|)", r"\1", line) for line in table.splitlines()]


def fault_table(matrix: Matrix) -> list[str]:
    """One row per death: where, who, what every survivor said, where the next attempt went on."""
    lines = [
        "| place | the rank that dies | what the survivors print (one line each) | next attempt resumes |",
        "| --- | --- | --- | --- |",
    ]
    found = matrix.deaths()
    for death, resumed in zip(found, resumes(matrix.stdout, found)[1:], strict=True):
        fault = death.fault
        errors = sorted(death.errors, key=survivor_rank)
        said = "<br>".join(shown(error, matrix.directory) for error in errors)
        lines.append(
            f"| `{fault.place}` | rank {fault.rank}, step {fault.step} | {said} | from step {resumed} |"
        )
    first, losses = matrix.losses()
    equal = "equal" if losses == matrix.reference_losses()[1][first:] else "NOT equal"
    lines += [
        "",
        f"After {len(found)} restarts the job ends at step {first + len(losses)}; the steps its last attempt "
        f"ran (from step {first}) have losses {equal}, bit for bit, to the run left alone.",
    ]
    return lines


@pytest.mark.long
def test_when_rank_0_dies_with_the_store_the_survivor_says_one_line_and_exits_1(tmp_path, monkeypatch):
    """With a store per attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/faults.md launches a job
    that restarts) the store lives in rank 0 and dies with it. Rank 1 then prints its one line, without
    torch's C++ log of a client retrying the dead store, and ends with the exit code docs/errors.md gives
    a peer's failure, 1, as torchrun reports it (not killed by torchrun's SIGTERM, not aborted)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv(faults.VARIABLE, "gather:0:1")  # as step 1 opens: rank 1 waits on rank 0 then
    job = Launch(tmp_path / "job", 2, _flags(QUICK, tmp_path, 3, 0), rank_logs=tmp_path / "ranks")
    try:
        job.proc.wait(timeout=JOB_TIMEOUT)
    finally:
        job.stop()
    [survivor] = tmp_path.glob("ranks/*/attempt_0/1/stderr.log")
    assert re.fullmatch(
        r"pipeclock train: error: rank 1: lost the connection to rank 0 while [^\n]+; rank 0 stopped or died "
        r"\(see its log; which rank failed first is not known here\)\n",
        survivor.read_text(),
    ), survivor.read_text()
    torchrun = job.err.read_text()
    assert re.search(r"rank +: 1 \(local_rank: 1\)\n +exitcode +: 1 ", torchrun), torchrun
    assert job.proc.returncode == 1
    assert not CPP_LOG.search(torchrun), torchrun


# --- the fault points themselves (no processes) -----------------------------------------------------------


def test_a_fault_list_gives_one_fault_per_attempt_and_only_to_the_rank_it_names():
    value = "W:1:3,save:0:4"
    assert faults.arm(2, {faults.VARIABLE: value, "RANK": "1"}) == faults.Fault("W", 1, 3)
    assert faults.arm(2, {faults.VARIABLE: value, "RANK": "0"}) is None
    second = {faults.VARIABLE: value, "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert faults.arm(2, second) == faults.Fault("save", 0, 4)
    assert faults.arm(2, {**second, "TORCHELASTIC_RESTART_COUNT": "2"}) is None  # past the list: clean
    faults.point("save", 4)  # disarmed by the clean attempt: this process lives on
    faults.disarm()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("W:1", "rank 0: PIPECLOCK_FAULT: 'W:1' is not place:rank:step (e.g. W:1:3)"),
        ("X:0:1", "rank 0: PIPECLOCK_FAULT: unknown place 'X'; places: " + ", ".join(faults.PLACES)),
        ("F:4:1", "rank 0: PIPECLOCK_FAULT: F:4:1 names rank 4, but the world has 4"),
    ],
)
def test_a_bad_fault_is_one_clear_error(value, error):
    with pytest.raises(ValueError) as raised:
        faults.arm(4, {faults.VARIABLE: value, "RANK": "0"})
    assert str(raised.value) == error


def test_a_lost_peer_inside_a_library_collective_is_reported_like_any_other_lost_peer():
    """FSDP2 and DDP call gloo themselves; ``comms.explained`` turns gloo's raw error into pipeclock's."""
    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41119. GLHF!"
    summing = "summing the gradients across replicas"
    with pytest.raises(comms.PeerGoneError) as raised, comms.explained(summing):
        raise RuntimeError(gloo)
    assert str(raised.value) == (
        "rank 0: lost the connection to a peer while summing the gradients across replicas; "
        "a peer most likely died (see its log)"
    )
    with pytest.raises(ValueError, match="not a transport error"), comms.explained("anything"):
        raise ValueError("not a transport error")


# --- SIGTERM as notice (a process of its own: the handler is for the whole process) ------------------------

NOTICED = """
import os, signal, sys, time
from pipeclock.cli import stopping
stopping.report_before_stopping(rank=3, grace=float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGTERM)  # as torchrun does when another rank died
time.sleep(float(sys.argv[2]))  # until this rank's own wait fails
sys.exit("rank 3: lost the connection to rank 1")
"""


def test_a_rank_sent_sigterm_first_reports_its_own_error_and_stops_after_the_grace_without_one():
    def start(grace: float, fails_after: float) -> subprocess.Popen:
        command = [sys.executable, "-c", NOTICED, str(grace), str(fails_after)]
        return subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    in_time, too_late = start(grace=60, fails_after=0.5), start(grace=0.5, fails_after=60)
    assert in_time.communicate(timeout=50)[1] == "rank 3: lost the connection to rank 1\n"
    assert in_time.returncode == 1  # the error of its own, well before the grace ran out
    assert too_late.communicate(timeout=50)[1] == (
        "pipeclock train: stopped: rank 3 was sent SIGTERM and no error of its own came within 0.5s "
        "(torchrun stops every rank when one fails: see the other ranks' lines)\n"
    )
    assert too_late.returncode == 128 + signal.SIGTERM
