"""What the watcher of ``lab N --check`` knows of one rank: its step, its calls, what it computed and held.

The ranks' reports (`check_rank`) update it; the watcher (`watch`) and the deadlock's account (`stuck`)
read it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeclock.course.recorder import Message
from pipeclock.engine.actions import Action

BETWEEN_STEPS = "for the others to"  # how a rank waiting between two steps says so


@dataclass
class RankState:
    started: bool = False
    finished: bool = False
    did: str = "nothing yet"
    waits: str | None = None
    m: int | None = None  # the current step's micro-batches
    ran: dict[int, list[Action]] = field(default_factory=dict)  # per m, the forwards and backwards
    done: set[int] = field(default_factory=set)  # the m's whose step this rank has ended
    checked: set[int] = field(default_factory=set)  # the m's whose results this rank has checked
    kept: dict[int, int] = field(default_factory=dict)  # per m, the most micro-batches held (measured)
    sent: Counter = field(default_factory=Counter)  # this step's messages sent (or posted): (to, tag)
    received: Counter = field(default_factory=Counter)  # this step's messages received: (from, tag)
    receiving: tuple[int, int, Message] | None = None  # the receive it waits in: (from, tag, message)

    def message(self, event: str, peer: int, tag: int, message: Message) -> None:
        if event == "send":
            self.sent[peer, tag] += 1
        elif event == "recv":
            self.receiving = (peer, tag, message)
        else:
            self.received[peer, tag] += 1
            self.receiving = None

    @property
    def blocked(self) -> bool:
        """Waiting in a call (or done): a rank that cannot move by itself."""
        return self.finished or self.waits is not None

    @property
    def in_loop(self) -> bool:
        """Waiting in one of the learner's calls, not between two steps."""
        return self.waits is not None and not self.waits.startswith(BETWEEN_STEPS)
