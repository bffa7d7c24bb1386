"""The ``SIZES``, ``AGREE`` and ``LOSS`` words of a program: the batch sizes before a step, the loss after.

Only the first stage sees the inputs and only the last the targets, yet every rank needs the batch size
(to cut micro-batches and post receives of the right size) and the inputs' shape key
(``pytree.shape_key``), and a bad batch must be one error on every rank before any activation is sent.
So the ends' sizes travel along the pipeline: the first stage sends its own to the next rank (the
hub), the last stage its own to the hub and to the first stage, and each rank hands the pair on to the
next before its first forward. The first stage does not wait for them: its program's ``AGREE``, where
it reads and checks the last stage's size, comes after its first forward. The last stage sends the
loss to every rank; the others post its receive when the step begins. Point-to-point messages rather than one
collective each: ``docs/benchmarks.md`` ("the batch size and the loss as messages") measures the gain.
"""

from __future__ import annotations

import torch

from pipeclock import comm_channels, comms
from pipeclock.engine.messenger import STEP, message_tag

# Batch sizes that are not sizes. The ends' values are combined by taking the larger, so NOT_HERE is the
# smallest; GIVEN_NONE (-1), REJECTED and DIFFERS are told apart from a size and from each other.
NOT_HERE = -4  # from a rank that does not hold that end of the pipeline
DIFFERS = -3  # that end's tp ranks were given different batches (``engine.tp_batch``)
REJECTED = -2  # that end was given a batch it could not read (its own error says why)
GIVEN_NONE = -1
BATCH_TAG = message_tag(STEP, 0, 0, 0)
LOSS_TAG = message_tag(STEP, 0, 0, 1)


class StepEnds:
    """This rank's side of the batch-size and loss messages of one pipeline.

    ``rank`` and the ``*_rank`` are pipeline ranks; ``peers`` maps them to global ranks.
    """

    def __init__(self, rank: int, peers: list[int], first_rank: int, last_rank: int, device: torch.device):
        self.rank, self.peers, self.device = rank, peers, device
        self.first_rank, self.last_rank = first_rank, last_rank
        self._sends: list[comms.PendingSend] = []
        self._mine: torch.Tensor | None = None  # this step's sizes, until the others' are read
        self._sizes: list[comms.PendingRecv] = []
        self._loss: comms.PendingRecv | None = None
        self._recipients, self._senders, self._hand_on_to = self._route()

    def _route(self) -> tuple[list[int], list[int], int | None]:
        """Whom this rank sends its own sizes to, whose size messages it reads, whom it hands them on to.

        Ranks are counted from the first stage: it is place 0, the hub place 1, the rest follow.
        """
        count, first, last, me = len(self.peers), self.first_rank, self.last_rank, self.rank
        if count == 1:
            return [], [], None
        place, hub = (me - first) % count, (first + 1) % count
        recipients = [hub] if me == first else []
        if me == last != first:
            recipients += [first] + ([hub] if hub != me else [])
        if me == first:
            senders = [last] if last != first else []
        elif me == hub:
            senders = [first] + ([last] if last not in (first, hub) else [])
        else:
            senders = [(me - 1) % count]  # the pair, as the rank before has it
        return recipients, senders, ((me + 1) % count if 1 <= place < count - 1 else None)

    def send_batch_sizes(self, mine: list[int]) -> None:
        """Send this rank's batch sizes (if it holds an end) and post the receives of the others'.

        ``mine`` is this rank's [inputs' batch size, targets' batch size, inputs' ``pytree.shape_key``],
        ``NOT_HERE`` for what it does not hold. A size sent is waited for when the step ends
        (``share_loss``): by then every rank has read it, so the sender never waits for a rank still busy
        with the previous step.
        """
        self._mine = torch.tensor(mine, dtype=torch.int64, device=self.device)
        for recipient in self._recipients:
            self._send(self._mine, recipient, BATCH_TAG, "sending the batch size")
        self._sizes = [
            comms.irecv((3,), self.peers[sender], torch.int64, BATCH_TAG, "receiving the batch size")
            for sender in self._senders
        ]

    def batch_sizes(self) -> tuple[int, int, int]:
        """(the first stage's batch size, the last stage's, the inputs' shape key), the same on every
        rank, once ``send_batch_sizes`` has posted this rank's part; handed on to the next rank first."""
        values, self._mine = self._mine, None
        pending, self._sizes = self._sizes, []
        for received in pending:
            values = torch.maximum(values, received.wait())
        if self._hand_on_to is not None:
            self._send(values, self._hand_on_to, BATCH_TAG, "handing on the batch size")
        batch, target_batch, shapes = values.tolist()
        return batch, target_batch, shapes

    def expect_loss(self) -> None:
        """Post the receive of the loss now, so that it can arrive while the step runs.

        Only where receives are matched by tag: on nccl the loss, sent last, must be received after the
        step's other messages from the last stage (gradients; on a V, activations).
        """
        if comm_channels.matches_by_tag():
            self._post_loss()

    def _post_loss(self) -> None:
        if self.rank != self.last_rank and len(self.peers) > 1 and self._loss is None:
            last = self.peers[self.last_rank]
            self._loss = comms.irecv((), last, torch.float64, LOSS_TAG, "receiving the loss")

    def share_loss(self, value: torch.Tensor) -> float:
        """The last stage's ``value`` (a float64 scalar) on every rank; ``expect_loss`` came first.

        On gloo the loss's receives were posted when the step began, so the last stage's sends complete
        at once.
        """
        if self.rank == self.last_rank:
            self._send_to_others(value, LOSS_TAG, "sending the loss")
        elif len(self.peers) > 1:
            self._post_loss()  # posted already, unless receives are matched in order
            value, self._loss = self._loss.wait(), None
        self.wait_sends()
        return float(value)

    def _send(self, value: torch.Tensor, to: int, tag: int, what: str) -> None:
        self._sends.append(comms.isend(value, self.peers[to], tag, what))

    def _send_to_others(self, value: torch.Tensor, tag: int, what: str) -> None:
        for other in range(len(self.peers)):
            if other != self.rank:
                self._send(value, other, tag, what)

    def wait_sends(self) -> None:
        """Complete this rank's sends of the step: when it ends, or when it is refused before it runs.

        A send dropped unwaited may be cancelled with its work object, and the rank it was for would then
        wait for it until the timeout.
        """
        sends, self._sends = self._sends, []
        for send in sends:
            send.wait()
