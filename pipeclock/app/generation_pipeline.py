"""Generation on p ranks: each holds its stage's pieces and, per prompt, their keys and values.

Rank r runs the forwards ``decode_schedule`` gives it, each ``Decode(group, token)`` computing every
prompt of the group through its stage (each prompt alone, batch 1, with its own cache). The messages are
derived from the schedule's dependencies, posted with ``comms.isend`` / ``irecv`` (every wait bounded by
the timeout):

- rank r -> r + 1: a header ``(prompts, 2)`` int64, each prompt's ``[new tokens, reset]`` (0 new tokens:
  the prompt has ended), then the new tokens' hidden states, all prompts' in one ``(1, n, dim)`` tensor;
- the last rank -> rank 0: the byte sampled for each prompt of the group, or -1 when the prompt ended
  (its stop string came, or its bytes are all there).

Rank 0 decides what each prompt feeds: the prompt (the prefill), then its newest byte; when the window
slides (``sampling.window_start``) or without a cache, the whole window again, with ``reset``. The last
rank samples with the keyed draws of ``sampling``, so the text is the one-process ``sample``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeclock import comms
from pipeclock.app.decode_schedule import Decode, decode_schedule
from pipeclock.models.decoding import PromptCache, forward_cached
from pipeclock.models.sampling import choose, uniform_for, window_start
from pipeclock.observe.timeline import Span

_HEADER, _HIDDEN, _BYTES = 11, 12, 13  # message tags: one stream per kind between two ranks
ENDED = -1


@dataclass(frozen=True)
class Settings:
    """What to generate: ``tokens`` bytes per prompt at most, drawn as ``sampling.choose`` says."""

    tokens: int
    seq_len: int
    dim: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    stop: bytes = b""
    cache: bool = True


@dataclass
class Lane:
    """One prompt on one rank: its bytes so far (on the first and last ranks), its window, its cache."""

    index: int
    ids: list[int]
    prompt_length: int
    cache: PromptCache
    start: int = 0
    ended: bool = False

    @property
    def generated(self) -> bytes:
        return bytes(self.ids[self.prompt_length :])


@dataclass
class Outcome:
    """What one rank did: its spans (seconds from a common origin), and on the last rank the bytes each
    prompt generated and when each group's first byte came."""

    spans: list[Span] = field(default_factory=list)
    texts: dict[int, bytes] = field(default_factory=dict)
    first_byte_s: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    weight_bytes: int = 0
    cache_bytes: int = 0


def split_groups(num_prompts: int, num_groups: int) -> list[list[int]]:
    """Prompt indices in ``num_groups`` contiguous groups whose sizes differ by at most one."""
    if not 1 <= num_groups <= num_prompts:
        raise ValueError(
            f"--groups must be between 1 and the number of prompts ({num_prompts}), got {num_groups}"
        )
    size, extra = divmod(num_prompts, num_groups)
    bounds = [g * size + min(g, extra) for g in range(num_groups + 1)]
    return [list(range(bounds[g], bounds[g + 1])) for g in range(num_groups)]


OnByte = Callable[[int, int], None]  # (prompt index, byte): called on the last rank as each byte comes


class StageRunner:
    """One rank's share of a generation: its pieces, its lanes, and the loop over its schedule."""

    def __init__(
        self, pieces: nn.Sequential, prompts: list[list[int]], groups: list[list[int]], settings: Settings
    ) -> None:
        self.pieces, self.settings = pieces.eval(), settings
        self.rank, self.world = comms.get_rank(), comms.get_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.groups = [
            [Lane(i, list(prompts[i]), len(prompts[i]), PromptCache(pieces, settings.seq_len)) for i in group]
            for group in groups
        ]
        self.bytes_in_ring: dict[int, list[int]] = {}  # one rank: the ring's message to itself
        self.sends: list[comms.PendingSend] = []

    def run(self, on_byte: OnByte | None = None) -> Outcome:
        outcome = Outcome()
        schedule = decode_schedule(self.world, len(self.groups), self.settings.tokens)[self.rank]
        origin = time.perf_counter()
        for step in schedule:
            began = time.perf_counter()
            feeds, waited = self._inputs(step)
            outputs = [
                self._forward(lane, feed) for lane, feed in zip(self.groups[step.group], feeds, strict=True)
            ]
            self._hand_on(step, feeds, outputs, on_byte)
            ended = time.perf_counter()
            outcome.spans.append(Span(self.rank, step.as_action(), began - origin, ended - origin, waited))
            if self.last and step.token == 0:
                outcome.first_byte_s[step.group] = ended - origin
            if step.group == len(self.groups) - 1:
                self._finish_sends()
        self._finish_sends()
        outcome.seconds = time.perf_counter() - origin
        outcome.weight_bytes = sum(p.nbytes for p in {id(p): p for p in self.pieces.parameters()}.values())
        outcome.cache_bytes = sum(lane.cache.nbytes for group in self.groups for lane in group)
        if self.last:
            outcome.texts = {lane.index: lane.generated for group in self.groups for lane in group}
        return outcome

    # --- what a forward takes in -----------------------------------------------------------------------

    def _inputs(self, step: Decode) -> tuple[list[tuple[bool, torch.Tensor] | None], float]:
        """Each lane's (reset, inputs) for this forward, None for an ended prompt; and the seconds waited."""
        waited = time.perf_counter()
        if self.first:
            sampled = self._sampled_bytes(step)
            waited = time.perf_counter() - waited
            return [
                self._feed(lane, byte, step.token)
                for lane, byte in zip(self.groups[step.group], sampled, strict=True)
            ], waited
        lanes, source = self.groups[step.group], self.rank - 1
        what = f"the header of group {step.group}, token {step.token}"
        header = comms.irecv((len(lanes), 2), source, torch.int64, _HEADER, what).wait().tolist()
        total = sum(n for n, _ in header)
        hidden = None
        if total:
            what = f"the hidden states of group {step.group}, token {step.token}"
            hidden = comms.irecv((1, total, self.settings.dim), source, torch.float32, _HIDDEN, what).wait()
        waited = time.perf_counter() - waited
        feeds, offset = [], 0
        for n, reset in header:
            feeds.append((bool(reset), hidden[:, offset : offset + n]) if n else None)
            offset += n
        return feeds, waited

    def _sampled_bytes(self, step: Decode) -> list[int | None]:
        """On rank 0: the bytes the last rank sampled at the group's previous token (None for the prefill)."""
        lanes = self.groups[step.group]
        if step.token == 0:
            return [None] * len(lanes)
        if self.world == 1:
            return self.bytes_in_ring.pop(step.group)
        what = f"the bytes of group {step.group}, token {step.token - 1}"
        return comms.irecv((len(lanes),), self.world - 1, torch.int64, _BYTES, what).wait().tolist()

    def _feed(self, lane: Lane, byte: int | None, token: int) -> tuple[bool, torch.Tensor] | None:
        """What rank 0 feeds for ``lane``: the window from its start after a reset, else its newest byte."""
        if byte == ENDED or lane.ended:
            lane.ended = True
            return None
        if byte is not None and not self.last:  # on one rank, sampling appended it already
            lane.ids.append(byte)
        moved = window_start(len(lane.ids), lane.start, self.settings.seq_len)
        reset = token == 0 or moved != lane.start or not self.settings.cache
        lane.start = moved
        fed = lane.ids[moved:] if reset else lane.ids[-1:]
        return reset, torch.tensor(fed, dtype=torch.int64)[None]

    # --- the forward, and what it hands on -------------------------------------------------------------

    def _forward(self, lane: Lane, feed: tuple[bool, torch.Tensor] | None) -> torch.Tensor | None:
        if feed is None:
            return None
        reset, inputs = feed
        if reset:
            lane.cache.reset()
        return forward_cached(self.pieces, inputs, lane.cache)

    def _hand_on(self, step: Decode, feeds: list, outputs: list, on_byte: OnByte | None) -> None:
        if not self.last:
            header = torch.tensor([[0, 0] if f is None else [f[1].shape[1], int(f[0])] for f in feeds])
            target = self.rank + 1
            self.sends.append(comms.isend(header, target, _HEADER, f"the header of group {step.group}"))
            hidden = [out for out in outputs if out is not None]
            if hidden:
                what = f"the hidden states of group {step.group}"
                self.sends.append(comms.isend(torch.cat(hidden, dim=1), target, _HIDDEN, what))
            return
        sampled = [
            self._sample(lane, logits, on_byte)
            for lane, logits in zip(self.groups[step.group], outputs, strict=True)
        ]
        if step.token == self.settings.tokens - 1:
            return  # the last bytes: nobody needs them again
        if self.world == 1:
            self.bytes_in_ring[step.group] = sampled
        else:
            what = f"the bytes of group {step.group}"
            self.sends.append(comms.isend(torch.tensor(sampled, dtype=torch.int64), 0, _BYTES, what))

    def _sample(self, lane: Lane, logits: torch.Tensor | None, on_byte: OnByte | None) -> int:
        """The next byte of ``lane`` (the last rank); ENDED once the prompt's stop string has come."""
        if logits is None or lane.ended:
            lane.ended = True
            return ENDED
        settings = self.settings
        draw = uniform_for(settings.seed, lane.index, len(lane.ids)) if settings.temperature else 0.0
        byte = choose(logits, settings.temperature, settings.top_k, draw)
        lane.ids.append(byte)
        if on_byte:
            on_byte(lane.index, byte)
        if settings.stop and lane.generated.endswith(settings.stop):
            lane.ended = True
            return ENDED
        return byte

    def _finish_sends(self) -> None:
        for pending in self.sends:
            pending.wait()
        self.sends.clear()
