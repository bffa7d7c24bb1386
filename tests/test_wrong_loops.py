"""Every wrong loop of ``tests/wrong_loops/`` is refused by ``lab N --check``, its cause on the first line.

Each file is a lab's loop with one mistake, named by its file; the table gives the lab it is checked
against and the start of the verdict's first line (``…`` stands for any text: a time, a file's line). The
first line is what a learner reads: it names the cause (a wrong order, the memory a loop keeps, a message
on the wrong tag, a send never waited for, the rank whose own code failed), never a symptom that follows
from it. A few quick files run in the default suite; the whole set is `long` (each check launches 2 and
then 4 processes, and a deadlock waits seconds to be sure).
"""

from __future__ import annotations

import queue
import re
from pathlib import Path

import pytest

from pipeclock.course.check import EXERCISES, Verdict, check
from pipeclock.course.check_rank import CAUSE, Fault
from pipeclock.course.reference import Case
from pipeclock.course.watch import RESULTS_LIMIT, Watch, quiet, watch

WRONG = Path(__file__).resolve().parent / "wrong_loops"

FIRST_LINES = {  # file: (lab, the start of the verdict's first line)
    # another schedule's order, or one step of it off
    "gpipe_as_1f1b": (
        6,
        "wrong order: 1F1B, p = 2, m = 3, rank 1: after F0 the schedule runs B0 (warm-up p − r − 1 = 0); "
        "your loop ran F1",
    ),
    "gpipe_as_naive": (
        4,
        "wrong order: naive, p = 2, m = 3, rank 0: after F0 the schedule runs B0 (stop and wait: each "
        "micro-batch's backward before the next forward); your loop ran F1",
    ),
    "naive_as_gpipe": (
        5,
        "wrong order: GPipe, p = 2, m = 3, rank 0: after F0 the schedule runs F1 (fill: all m forwards "
        "first); your loop ran B0",
    ),
    "one_f_one_b_warms_up_once_more": (
        6,
        "wrong order: 1F1B, p = 2, m = 3, rank 0: after F1 the schedule runs B0 (warm-up p − r − 1 = 1); "
        "your loop ran F2",
    ),
    "one_f_one_b_warms_up_one_short": (  # it deadlocks, but the order is the cause
        6,
        "wrong order: 1F1B, p = 2, m = 3, rank 0: after F0 the schedule runs F1 (warm-up p − r − 1 = 1); "
        "your loop waits for the gradient of micro-batch 0 from rank 1 (for B0)",
    ),
    "one_f_one_b_deadlocks_when_m_lt_p": (
        6,
        "wrong order: 1F1B, p = 4, m = 2, rank 0: after B1 the schedule's step is over; your loop waits for "
        "one gradient more than the step has from rank 1",
    ),
    "interleaved_runs_its_chunks_depth_first": (  # exact numbers: the order is the fault
        7,
        "wrong order: interleaved 1F1B, p = 2, v = 2, m = 3, rank 0: after F0 the schedule runs F1 (warm-up "
        "2(p − r − 1) + (v − 1)p = 4 forwards …); your loop ran F0.1",
    ),
    "interleaved_plans_the_short_round_alone": (
        7,
        "wrong order: interleaved 1F1B, p = 2, v = 2, m = 3, rank 0: after B0.1 the schedule runs B1.1 (…); "
        "your loop ran F2.1",
    ),
    "gpipe_skips_the_last_backward": (  # the step ended short: no gradient follows from it
        5,
        "wrong order: GPipe, p = 2, m = 1, rank 1: after F0 the schedule runs B0 (drain: the backwards in "
        "the forwards' order); your loop's step ended there",
    ),
    # the memory is the lesson
    "one_f_one_b_keeps_every_graph": (
        6,
        "wrong memory: 1F1B, p = 2, m = 3, rank 0 kept the saved tensors of 3 micro-batches alive at once "
        "(measured), where 1F1B holds at most 2 (min(m, p − r)): the order is right, the memory is not",
    ),
    # messages
    "gpipe_last_stage_swaps_two_backwards": (
        5,
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a gradient that is "
        "micro-batch 1's, where micro-batch 0's is due",
    ),
    "gpipe_last_stage_reverses_its_backwards": (
        5,
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a gradient that is "
        "micro-batch 2's (shape (3, 8)), where micro-batch 0's (shape (4, 8)) is due",
    ),
    "gpipe_scales_the_loss_by_m": (
        5,
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a wrong gradient: … it is "
        "0.9167 times the right one (a loss weighted by the wrong count?)",
    ),
    "naive_forgets_requires_grad": (
        4,
        "wrong, with 2 ranks and m = 1: rank 1, micro-batch 0, backward: sent None, not a gradient: x.grad "
        "stays None unless the input was marked with x.requires_grad_() before the forward",
    ),
    "interleaved_never_waits_for_its_sends": (
        7,
        "wrong, with 2 ranks and m = 1: rank … posted the … of micro-batch 0 to rank … with "
        "comms.isend_tensor and never waited for it: isend_tensor returns at once",
    ),
    "interleaved_sends_gradients_on_the_activations_tag": (
        7,
        "wrong, with 2 ranks and m = 1: rank 1 sent the gradient of micro-batch 0 with tag 0, the "
        "activations' tag: activations travel with tag 0 and gradients with tag 1",
    ),
    "interleaved_swaps_the_ring": (
        7,
        "wrong, with 4 ranks and m = 2: rank 0 sent the activation of micro-batch 0 (leaving virtual stage "
        "0) to rank 3; virtual stage 1 is rank 1's; round the ring, rank p − 1 sends to rank 0",
    ),
    "gpipe_sends_the_micro_batches_out_of_order": (
        5,
        "wrong, with 2 ranks and m = 3: rank 0, micro-batch 0, forward: sent an activation that is "
        "micro-batch 1's, where micro-batch 0's is due",
    ),
    "gpipe_forgets_to_split_the_batch": (
        5,
        "wrong, with 2 ranks and m = 3: rank 0, micro-batch 0, forward: sent the activation of micro-batch "
        "0 with shape (11, 8), the one-process model's has shape (4, 8): the whole batch, not a micro-batch",
    ),
    "naive_sends_before_the_backward_is_done": (
        4,
        "wrong, with 4 ranks and m = 2: rank 2, micro-batch 0, backward: sent a wrong gradient: … it is all "
        "zeros (sent before the backward computed it?)",
    ),
    # the loss and the gradients
    "naive_forgets_to_weight_the_loss": (
        4,
        "wrong, with 2 ranks and m = 3: rank 1, micro-batch 0, backward: sent a wrong gradient: … it is 2.75 "
        "times the right one (a loss weighted by the wrong count?)",
    ),
    "naive_returns_no_loss": (
        4,
        "wrong, with 2 ranks and m = 1: rank 1 returned the loss None; the batch's loss",
    ),
    "gpipe_returns_the_last_micro_batch_loss": (
        5,
        "wrong, with 2 ranks and m = 3: rank 1 returned the loss 0.30…; the batch's loss is 11.2606",
    ),
    "gpipe_zeroes_the_gradients_between_micro_batches": (
        5,
        "wrong, with 2 ranks and m = 3: rank 0: the gradient of layers.0.weight differs … it is micro-batch "
        "2's share alone (were the gradients zeroed between backwards?)",
    ),
    # the rank whose own code failed, above what its peers saw
    "one_f_one_b_backward_without_the_gradient": (
        6,
        "wrong, with 2 ranks and m = 1: rank 0 raised RuntimeError: grad can be implicitly created only for "
        "scalar outputs (line 37 of",
    ),
    "interleaved_warms_up_like_1f1b": (  # its own line: it pops a chunk's forward it never ran
        7,
        "wrong, with 2 ranks and m = 1: rank 0 raised KeyError: (0, 1) (line 43 of",
    ),
    "one_f_one_b_warms_up_past_m": (
        6,
        "wrong, with 4 ranks and m = 2: rank 0 raised IndexError: list index out of range (line 23 of",
    ),
    "one_f_one_b_rank_0_runs_its_newest_backward": (
        6,
        "wrong order: 1F1B, p = 2, m = 3, rank 0: after F1 the schedule runs B0 (warm-up p − r − 1 = 1); "
        "your loop ran B1",
    ),
    "one_f_one_b_rank_0_reverses_its_cool_down": (  # its receive's shape says which backward it runs
        6,
        "wrong, with 4 ranks and m = 2: rank 0 asked for the gradient of micro-batch 0 with micro-batch 1's "
        "shape (5, 8): its loop runs B1 where the schedule runs B0",
    ),
    # deadlocks, said by the message never sent
    "one_f_one_b_forgets_a_send": (
        6,
        "deadlock, with 4 ranks and m = 2: no rank has moved for …: rank 1 waits for the gradient of "
        "micro-batch 1 from rank 2, which finished its step without sending it",
    ),
    "one_f_one_b_receives_before_it_sends": (
        6,
        "deadlock, with 2 ranks and m = 3: no rank has moved for …: rank 1 waits for the activation of "
        "micro-batch 1 from rank 0, which never sends it: rank 0 ran F1 and waits first for the gradient of "
        "micro-batch 0 from rank 1; each waits to receive before it sends",
    ),
    "one_f_one_b_sends_activations_on_tag_1": (
        6,
        "deadlock, with 2 ranks and m = 1: no rank has moved for …: rank 1 waits for the activation of "
        "micro-batch 0 from rank 0 on tag 0; rank 0 sent it a message on tag 1 that no receive takes",
    ),
    "one_f_one_b_sends_its_gradient_before_its_next_input": (
        6,
        "deadlock, with 2 ranks and m = 3: no rank has moved for …: rank 0 waits to send the activation "
        "of micro-batch 1 to rank 1, which waits to send the gradient of micro-batch 0 to rank 0: a send "
        "waits until the receiver takes it, and each sends before it receives",
    ),
}
QUICK = (  # the default suite's share: a second or two each
    "one_f_one_b_keeps_every_graph",
    "one_f_one_b_rank_0_runs_its_newest_backward",
)


def starts(line: str, expected: str) -> bool:
    pattern = ".*?".join(re.escape(piece) for piece in expected.split("…"))
    return re.match(pattern, line) is not None


def first_line(name: str) -> str:
    lab = FIRST_LINES[name][0]
    with pytest.raises(Verdict) as raised:
        check(lab, WRONG / f"{name}.py")
    return str(raised.value).splitlines()[0]


def test_the_set_holds_thirty_wrong_loops_each_with_its_first_line():
    files = {path.stem for path in WRONG.glob("*.py")}
    assert files == set(FIRST_LINES), files ^ set(FIRST_LINES)
    assert len(files) >= 30


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICK)
def test_a_quick_wrong_loop_is_refused_with_its_cause_first(name):
    line = first_line(name)
    assert starts(line, FIRST_LINES[name][1]), line


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(set(FIRST_LINES) - set(QUICK)))
def test_each_wrong_loop_is_refused_with_its_cause_first(name):
    line = first_line(name)
    assert starts(line, FIRST_LINES[name][1]), line


@pytest.mark.long
def test_a_loop_that_raises_while_its_order_is_right_so_far_is_told_what_the_schedule_runs_next():
    """The 1F1B warm-up in an interleaved loop pops a forward it never ran: the exception comes before
    any action out of order, so the verdict cannot blame the order, but says what the schedule runs there."""
    with pytest.raises(Verdict) as raised:
        check(7, WRONG / "interleaved_warms_up_like_1f1b.py")
    first, second = str(raised.value).splitlines()[:2]
    assert starts(first, FIRST_LINES["interleaved_warms_up_like_1f1b"][1]), first
    assert starts(
        second,
        "  until then rank 0 followed the order of interleaved 1F1B, p = 2, v = 2, m = 1 (F0); the schedule "
        "runs F0.1 next (warm-up 2(p − r − 1) + (v − 1)p = 4 forwards",
    ), second


def test_exceptions_two_ranks_raise_at_about_the_same_moment_name_the_lowest_rank_every_run():
    """Which of two ranks raised first is up to the machine's scheduler: the verdict must not be."""
    case = Case(m=1)
    later_rank_first = Fault(1, case, CAUSE, when=10.0, text="rank 1 raised", raised=True)
    rank_0 = Fault(0, case, CAUSE, when=10.2, text="rank 0 raised", raised=True)
    assert min([later_rank_first, rank_0], key=lambda f: f.order) is rank_0
    # what the check itself saw the loop do wrong is more precise than an exception it led to
    a_misuse_seen_later = Fault(1, case, CAUSE, when=10.3, text="rank 1 sent None")
    assert min([rank_0, a_misuse_seen_later], key=lambda f: f.order) is a_misuse_seen_later


class _Ended:
    """A rank's process that has already exited, as `multiprocessing.Process` reports it."""

    exitcode = 1

    def is_alive(self) -> bool:
        return False


class _Running(_Ended):
    exitcode = None

    def is_alive(self) -> bool:
        return True


INTERLEAVED = EXERCISES[7]  # lab 7's loop: interleaved 1F1B


def test_when_every_rank_has_ended_each_fault_it_reported_is_weighed():
    """Both ranks raised and exited; rank 1's report happens to be read first. The verdict waits for
    what is still queued instead of naming the first report it read."""
    case, events = Case(m=1), queue.Queue()
    for rank in (1, 0):
        events.put(("started", rank, None))
    for rank, when in ((1, 10.0), (0, 10.1)):
        fault = Fault(rank, case, CAUSE, when, f"rank {rank} raised KeyError", raised=True)
        events.put(("fault", rank, case, fault))
    with pytest.raises(Verdict) as raised:
        watch([_Ended(), _Ended()], events, 2, INTERLEAVED.lab_of(2))
    assert "rank 0 raised KeyError" in str(raised.value), str(raised.value)


def test_a_fault_is_named_once_no_rank_can_move_by_itself_or_after_the_limit():
    """A rank still computing may raise an earlier-ranked exception: the verdict waits for it, as long as
    ``RESULTS_LIMIT`` after the first fault."""
    seen = Watch(2, INTERLEAVED.lab_of)
    seen.add(Fault(1, Case(m=1), CAUSE, 0.0, "rank 1 raised", raised=True), now=0.0)
    assert not seen.settled(1.0, quiet=False)
    assert seen.settled(1.0, quiet=True)
    assert seen.settled(RESULTS_LIMIT + 0.1, quiet=False)


def test_a_rank_waiting_for_a_message_already_sent_is_not_quiet():
    seen = Watch(2, INTERLEAVED.lab_of)
    sender, waiting = seen.states  # rank 0 sends rank 1 an activation (tag 0)
    sender.waits = "receiving the gradient of micro-batch 0"
    waiting.waits = "receiving the activation of micro-batch 0"
    waiting.message("recv", 0, 0, None)
    ranks = [_Running(), _Running()]
    assert quiet(seen.states, ranks)
    sender.message("send", 1, 0, None)  # sent, not yet received: rank 1 will move on
    assert not quiet(seen.states, ranks)
    waiting.message("received", 0, 0, None)
    waiting.message("recv", 0, 0, None)  # and waits for the next, not sent yet
    assert quiet(seen.states, ranks)
