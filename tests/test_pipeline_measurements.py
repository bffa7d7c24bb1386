"""What a run measures: activation memory, the timeline, and the main job that reports them."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipeclock import schedule
from pipeclock.engine.actions import placement_of
from pipeclock.engine.memory import ActivationMeter
from pipeclock.engine.messenger import ACTIVATION, GRADIENT, sends_done_by
from pipeclock.engine.microbatch import loss_weights, microbatch_sizes, split_microbatches
from pipeclock.engine.step_run import StepRun
from pipeclock.model import ShardedMLP
from pipeclock.observe.metrics import ProcessMeter, gather_run
from pipeclock.observe.simulate import simulate
from tests.distributed import run_ok

ROOT = Path(__file__).resolve().parents[1]


def test_split_microbatches_sizes_differ_by_at_most_one_and_weights_sum_to_one():
    for batch in range(1, 20):
        for n in range(1, batch + 1):
            parts = split_microbatches(torch.arange(batch), n)
            sizes = [len(part) for part in parts]
            assert torch.equal(torch.cat(parts), torch.arange(batch))
            assert max(sizes) - min(sizes) <= 1 and sizes == microbatch_sizes(batch, n)
            assert abs(sum(loss_weights(sizes)) - 1.0) < 1e-12
    with pytest.raises(ValueError, match="a batch of 3 samples cannot be split into 4 micro-batches"):
        split_microbatches(torch.zeros(3), 4)


def _peaks_and_spans(rank: int, world: int) -> dict:
    out = {"messages held": {}, "next step's peak": {}}
    for name in ("naive", "gpipe", "1f1b", "zb-h1"):
        pipe = schedule.Pipeline(ShardedMLP(16, 8, rank, world), name, 4)
        with _counting_messages_held(pipe) as held:
            pipe.step(torch.randn(16, 16), torch.randn(16, 16))
        out[name] = (pipe.last.peak_activation_bytes, pipe.last.spans, [str(a) for a in pipe.actions])
        out["messages held"][name] = (max(held), pipe.messenger.messages_held)
        pipe.step(torch.randn(16, 16), torch.randn(16, 16))  # every shape's figures known by now
        out["next step's peak"][name] = pipe.last.peak_activation_bytes
    report = gather_run([pipe.last], ProcessMeter())
    out["gathered"] = None if report is None else (len(report.ranks), report.timelines[0].num_microbatches)
    return out


@contextlib.contextmanager
def _counting_messages_held(pipe: schedule.Pipeline):
    """The number of sent messages the rank still holds, read after each instruction of its program."""
    held, run_program = [], StepRun.run

    def counted(run: StepRun) -> None:
        for instruction in run.program:
            run.handlers[instruction.kind](instruction)
            held.append(pipe.messenger.messages_held)

    StepRun.run = counted
    try:
        yield held
    finally:
        StepRun.run = run_program


@pytest.fixture(scope="module")
def two_rank_steps() -> list[dict]:
    """One launch of 2 ranks, one step of each schedule, shared by the tests below."""
    return run_ok(_peaks_and_spans, 2)


def held_along(actions: list[str], forward_bytes: int, weight_bytes: int) -> int:
    """The peak of what a rank holds, walking its actions: F takes a micro-batch's forward bytes; a
    whole B frees them; an I swaps them for what W needs (each layer's input and output gradient),
    which W then frees."""
    live = peak = 0
    for action in actions:
        change = {
            "F": forward_bytes,
            "B": -forward_bytes,
            "I": weight_bytes - forward_bytes,
            "W": -weight_bytes,
        }[action[0]]
        live += change
        peak = max(peak, live)
    return peak


def test_measured_activation_memory_is_what_the_schedule_holds(two_rank_steps):
    layers_per_rank, microbatch, hidden = 4, 4, 16  # ShardedMLP(16, 8) on 2 ranks, batch 16 in 4
    weight_bytes = layers_per_rank * 2 * microbatch * hidden * 4  # x and dL/d(output) per Linear, fp32
    for rank, results in enumerate(two_rank_steps):
        forward_bytes = results["naive"][0]  # naive holds exactly one micro-batch at a time
        assert forward_bytes > 0
        for name in ("gpipe", "1f1b", "zb-h1"):
            measured, _, actions = results[name]
            assert measured == held_along(actions, forward_bytes, weight_bytes), (name, rank)
        for name in ("gpipe", "1f1b"):  # whole backward: the simulator's count of live micro-batches
            live = simulate(schedule.generate(name, 2, 4)).peak_live(rank)
            assert results[name][0] == live * forward_bytes
        for name in ("naive", "gpipe", "1f1b", "zb-h1"):  # measured once per shape, then reused
            assert results["next step's peak"][name] == results[name][0], (name, rank)


def test_every_action_has_one_span_in_order_and_spans_do_not_overlap(two_rank_steps):
    per_rank = two_rank_steps
    for rank, results in enumerate(per_rank):
        for name in ("naive", "gpipe", "1f1b", "zb-h1"):
            _, spans, actions = results[name]
            assert [str(s.action) for s in spans] == actions
            assert all(s.rank == rank and 0 <= s.wait <= s.end - s.start for s in spans)
            assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
    assert per_rank[0]["gathered"] == (2, 4) and per_rank[1]["gathered"] is None


def test_a_sent_message_is_let_go_once_the_schedule_shows_it_arrived(two_rank_steps):
    """1F1B keeps two micro-batches in flight on two ranks, so it holds two sent messages at most: an
    activation is let go when its gradient comes back, a gradient when the forward the other rank runs
    after taking it delivers its activation. GPipe sends all four before anything comes back. After the
    step nothing is held."""
    rank0, rank1 = (results["messages held"] for results in two_rank_steps)
    assert rank0["1f1b"] == rank1["1f1b"] == (2, 0)
    assert rank0["gpipe"] == rank1["gpipe"] == (4, 0)


def test_the_gradients_a_rank_sent_are_known_taken_by_the_next_activation_that_follows_them():
    table = schedule.generate("1f1b", 2, 4)  # rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    placement = placement_of(table)
    done = sends_done_by(table, placement, rank=1)
    gradient = lambda mb: (GRADIENT, 0, mb)  # noqa: E731  the gradient rank 1 sends to stage 0
    assert done == {
        (ACTIVATION, 1, 0): [],
        (ACTIVATION, 1, 1): [],
        (ACTIVATION, 1, 2): [gradient(0)],
        (ACTIVATION, 1, 3): [gradient(1)],
    }
    assert sends_done_by(table, placement, rank=0) == {}  # the first stage receives no activation


def test_a_shape_is_measured_once_and_its_figures_reused():
    linear = torch.nn.Linear(8, 8)
    meter = ActivationMeter([linear])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measuring("mb 0", stashed=[], shape="4 x 8"):
        linear(x)  # autograd saves x
    with meter.measuring("mb 1", stashed=[], shape="4 x 8"):
        pass  # not measured again: the shape's figure stands
    with meter.measuring("mb 2", stashed=[], shape="2 x 8"):
        pass  # a new shape is measured: here nothing is saved
    for key in ("mb 0", "mb 1", "mb 2"):
        meter.hold(key)
    assert meter.live == 2 * x.nbytes


def test_when_w_keeps_the_graph_a_shape_is_measured_until_its_first_i():
    linear = torch.nn.Linear(8, 8)
    meter = ActivationMeter([linear], w_keeps_graph=True)
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measuring("mb 0", stashed=[], shape="4 x 8"):
        y = linear(x)
    meter.hold("mb 0")
    with meter.measuring("mb 1", stashed=[], shape="4 x 8"):
        pass  # measured: what this shape holds from I to W is not known yet
    meter.hold("mb 1")
    assert meter.live == x.nbytes
    output_grad = torch.ones_like(y)
    meter.update("mb 0", [x.detach(), output_grad], add=True)  # the graph stays; W adds its gradient
    with meter.measuring("mb 2", stashed=[], shape="4 x 8"):
        pass  # now the shape's figures are complete: reused
    meter.hold("mb 2")
    meter.update("mb 2", [], add=True)  # its figure after I is the one mb 0 measured
    assert meter.live == 2 * (x.nbytes + output_grad.nbytes)


def test_a_tensor_the_forward_saved_and_w_keeps_is_counted_once():
    linear = torch.nn.Linear(8, 8)
    meter = ActivationMeter([linear])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measuring("mb", stashed=[]):
        y = linear(x)  # autograd saves x for the weight's gradient
    meter.hold("mb")
    assert meter.live == x.nbytes
    output_grad = torch.ones_like(y)
    meter.update("mb", [x.detach(), output_grad], add=True)  # the graph stays; W keeps x and the gradient
    assert meter.live == x.nbytes + output_grad.nbytes, "x is one tensor, held once"
    meter.update("mb", [x.detach(), output_grad], add=False)  # the graph freed: W's tensors alone
    assert meter.live == x.nbytes + output_grad.nbytes
    meter.release("mb")
    assert meter.live == 0 and meter.peak == x.nbytes + output_grad.nbytes


@pytest.mark.slow
def test_the_main_job_trains_reports_and_writes_its_timeline(tmp_path):
    trace, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "pipeclock", "train", "--schedule", "gpipe", "--microbatches", "4", "--steps", "30",
        "--hidden", "64", "--batch-size", "32", "--trace", str(trace), "--png", str(png),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("pipeclock train: gpipe, 2 stage(s) x 1 chunk(s), 4 micro-batches")
    first = float(re.search(r"step\s+0\s+loss ([\d.]+)", out).group(1))
    final = float(re.search(r"final loss ([\d.]+) after 30 steps\n$", out).group(1))
    assert final < first / 2
    step, makespan, bubble = re.search(
        r"step time\s+([\d.]+ ms) \(the median of 29 steps.*\n"
        r"bubble\s+measured ([\d.]+%) of that step's makespan \(([\d.]+ ms), first action to last\); "
        r"formula \(p-1\)/\(m\+p-1\) = 20.0%",
        out,
    ).group(1, 3, 2)
    assert len(re.findall(r"^\s+[01]\s+[\d.]+%\s+[\d.]+%\s+\d+%\s+[\d.]+ MiB\s+\d+ MiB$", out, re.M)) == 2
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 30 * 2 * 8  # steps x ranks x (4 F + 4 B)
    with Image.open(png) as picture:  # the panels' titles, as the PNG's Description text
        measured = picture.info["Description"].splitlines()[1]
    shown = f"the median of 29 steps (step time {step}): p=2, m=4, makespan {makespan}, bubble {bubble}"
    assert measured == f"gpipe, measured, {shown}", "the picture shows the step the summary quotes"


@pytest.mark.slow
def test_a_bad_main_job_configuration_is_one_clear_line_per_rank():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "pipeclock", "train", "--microbatches", "8", "--batch-size", "4", "--steps", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    for rank in (0, 1):
        assert (
            f"pipeclock train: error: rank {rank}: a batch of 4 samples cannot be split into 8 micro-batches"
            in done.stderr
        )
