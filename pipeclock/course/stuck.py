"""A deadlock in a learner's loop, said by its cause: the wrong order, the wrong tag, the message never sent.

When no rank moves, the watcher (`watch`) knows what each rank computed, the receive it waits in (from
whom, on which tag, for which message of the step), and the messages each sent. The first line names
the cause, in this order: a rank whose forwards and backwards left the schedule; a rank that waits for
a message the schedule does not need there (a warm-up one short waits for a gradient where the schedule
runs a forward); a message sent on one tag and awaited on another; two ranks that each wait to receive
before they send (or to send before they receive); a peer that finished without sending. The lines
below give each rank's last call and wait beside what the schedule runs there.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pipeclock.course.order import Lab, divergence, next_in_schedule
from pipeclock.course.rank_state import RankState
from pipeclock.course.recorder import ACTIVATION, Message
from pipeclock.engine.actions import Action


def deadlock(
    states: list[RankState], lab_of: Callable[[int], Lab], still: float, word: str = "deadlock"
) -> str:
    """The paragraph for ranks that have not moved for ``still`` seconds, its cause first."""
    world = len(states)
    m = next((s.m for s in states if s.m is not None), None)
    lab = lab_of(m) if m is not None else None
    shown = m if m is not None else "?"
    head = f"{word}, with {world} ranks and m = {shown}: no rank has moved for {still:.0f}s"
    ran = {rank: state.ran.get(m, []) for rank, state in enumerate(states)}
    found = divergence(lab, ran, complete=False) if lab else None
    order = found[1] if found else (waits_out_of_order(lab, states, m) if lab else None)
    cause = never_sent(states)
    if order:
        lines = [f"wrong order: {order}", f"  and then a {head}" + (f": {cause}" if cause else "")]
    else:
        lines = [head + (f": {cause}" if cause else "")]
    lines.append("what each rank did last, what it waits for, and what the schedule runs there:")
    for rank, state in enumerate(states):
        expected = next_in_schedule(lab, rank, state.ran.get(m, [])) if lab else ""
        lines.append(
            f"  rank {rank}: last did: {state.did}; {now_doing(state)}"
            + (f"; {expected}" if expected else "")
        )
    return "\n".join(lines)


def waits_out_of_order(lab: Lab, states: list[RankState], m: int) -> str | None:
    """The first rank that, its actions so far the schedule's, waits for a message the schedule's next
    action does not take: said as the place it leaves the schedule."""
    for rank, (state, want) in enumerate(zip(states, lab.rows(), strict=True)):
        done = state.ran.get(m, [])
        if state.receiving is None or done != want[: len(done)]:
            continue
        peer, _, message = state.receiving
        waits = f"your loop waits for {message} from rank {peer}"
        before = f"after {done[-1]}" if done else "at its first action"
        if len(done) == len(want):
            return f"{lab.title}, rank {rank}: {before} the schedule's step is over; {waits}"
        if message.microbatch < 0:
            continue
        needs = Action("F" if message.kind == ACTIVATION else "B", message.microbatch, message.chunk)
        if needs != want[len(done)]:
            runs = f"the schedule runs {want[len(done)]} ({lab.why(rank, len(done))})"
            return f"{lab.title}, rank {rank}: {before} {runs}; {waits} (for {needs})"
    return None


def never_sent(states: list[RankState]) -> str | None:
    """The message a rank waits for that its peer will never send, and why, or None."""
    for rank, state in enumerate(states):
        if state.receiving is None:
            continue
        peer, tag, message = state.receiving
        other, waits = states[peer], f"rank {rank} waits for {message} from rank {peer}"
        stray = sorted(
            t for (to, t), n in other.sent.items() if to == rank and t != tag and n > state.received[peer, t]
        )
        if stray:
            return (
                f"{waits} on tag {tag}; rank {peer} sent it a message on tag {stray[0]} that no receive "
                "takes: a message is received only on the tag it was sent with"
            )
        if other.finished or other.did == "finished its step":
            return f"{waits}, which finished its step without sending it"
    cycle = [r for r, state in enumerate(states) if waits_on_each_other(states, r)]
    # an activation made is sent at once (the next rank waits for it); a gradient may wait for the next input
    made = sorted(
        (r for r in cycle if produced(states, r)), key=lambda r: states[r].receiving[2].kind != ACTIVATION
    )
    if cycle:
        rank = (made or cycle)[0]
        peer, _, message = states[rank].receiving
        other = states[peer]
        did = f" ran {producer(message, len(states))} and" if made else ""
        return (
            f"rank {rank} waits for {message} from rank {peer}, which never sends it: rank {peer}{did} waits "
            f"first for {other.receiving[2]} from rank {rank}; each waits to receive before it sends"
        )
    for rank, state in enumerate(states):
        sending = re.match(r"to send (.*) to rank (\d+)$", state.waits or "")
        peer = states[int(sending[2])] if sending else None
        if peer is not None and (peer.finished or peer.did == "finished its step"):
            return f"rank {rank} waits {state.waits}, which finished its step without taking it"
        back = peer is not None and re.match(rf"to send (.*) to rank {rank}$", peer.waits or "")
        if back:
            return (
                f"rank {rank} waits to send {sending[1]} to rank {sending[2]}, which waits to send {back[1]} "
                f"to rank {rank}: a send waits until the receiver takes it, and each sends before it receives"
            )
    return None


def waits_on_each_other(states: list[RankState], rank: int) -> bool:
    """Whether ``rank`` waits to receive from a peer that waits to receive from it."""
    receiving = states[rank].receiving
    back = states[receiving[0]].receiving if receiving else None
    return back is not None and back[0] == rank


def producer(message: Message, ranks: int) -> Action:
    """The action on the sending rank that makes ``message`` (received): the forward of the stage before,
    or the backward of the stage after."""
    forward = message.kind == ACTIVATION
    stage = message.stage - 1 if forward else message.stage + 1
    return Action("F" if forward else "B", message.microbatch, stage // ranks)


def produced(states: list[RankState], rank: int) -> bool:
    """Whether the message ``rank`` waits for was computed by its sender: made, and never sent."""
    peer, _, message = states[rank].receiving
    m = states[rank].m
    return message.microbatch >= 0 and producer(message, len(states)) in states[peer].ran.get(m, [])


def now_doing(state: RankState) -> str:
    if state.finished:
        return "it is done"
    return f"waits {state.waits}" if state.waits else "computes, in no message (an endless loop?)"
