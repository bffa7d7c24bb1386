"""Generation on p ranks: each holds its stage's pieces and, per prompt, their keys and values.

Rank r walks its decode program (the engine's lowering of the forward-only decode schedule, made as it
is walked: ``decode_program.decode_instructions``) with a handler per instruction: ``F`` of group g at
token t computes every prompt of the group through its stage (each prompt alone, batch 1, with its own
cache); ``RECV_F`` and ``SEND_F`` post the messages the lowering derived, with ``comms.irecv`` /
``isend`` (every wait bounded by the timeout):

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
from typing import Any

import torch
from torch import nn

from pipeclock import comms
from pipeclock.engine.program import Instruction
from pipeclock.engine.spans import Span
from pipeclock.generation.decode_program import decode_instructions, token_of
from pipeclock.models.decoding import PromptCache, forward_cached
from pipeclock.models.sampling import choose, uniform_for, window_start

_HEADER, _HIDDEN, _BYTES = 11, 12, 13  # message tags: one stream per kind between two ranks
ENDED = -1
TIMED_TOKENS = 1000  # the tokens whose forwards are kept as spans: the timeline of a long run is its start


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
    cache: Any  # the prompt's keys and values on this stage (Decoding.new_cache)
    start: int = 0
    ended: bool = False

    @property
    def generated(self) -> bytes:
        return bytes(self.ids[self.prompt_length :])


@dataclass
class Outcome:
    """What one rank did: its spans (seconds from a common origin; the first ``TIMED_TOKENS`` tokens'),
    and on the last rank the bytes each prompt generated and when each group's first byte came."""

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


@dataclass(frozen=True)
class Decoding:
    """How a stage's pieces compute a prompt's new tokens with its cache: ``new_cache(pieces, seq_len)``
    and ``forward(pieces, inputs, cache)``, hidden states out, or the last token's byte logits on the
    head's stage (``models.decoding`` for the GPT, ``models.hf.decoding`` for a Hugging Face model)."""

    new_cache: Callable[[nn.Module, int], Any]
    forward: Callable[[nn.Module, torch.Tensor, Any], torch.Tensor]


GPT_DECODING = Decoding(PromptCache, forward_cached)


class StageRunner:
    """One rank's share of a generation: its pieces, its lanes, and its decode program, walked with a
    handler per instruction kind (``RECV_F``, ``F``, ``SEND_F``)."""

    def __init__(
        self,
        pieces: nn.Module,
        prompts: list[list[int]],
        groups: list[list[int]],
        settings: Settings,
        decoding: Decoding = GPT_DECODING,
    ) -> None:
        self.pieces, self.settings, self.decoding = pieces.eval(), settings, decoding
        self.rank, self.world, self.device = comms.get_rank(), comms.get_world_size(), comms.device()
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.groups = [[self._lane(i, prompts[i]) for i in group] for group in groups]
        self.receiving: dict[tuple[int, int], comms.PendingRecv] = {}  # (stage, group): a posted receive
        self.outputs: dict[tuple[int, int], object] = {}  # (stage, group): what a forward hands on
        self.sends: list[comms.PendingSend] = []
        self.on_byte: OnByte | None = None
        self.outcome = Outcome()
        self.origin = 0.0

    def _lane(self, index: int, prompt: list[int]) -> Lane:
        cache = self.decoding.new_cache(self.pieces, self.settings.seq_len)
        return Lane(index, list(prompt), len(prompt), cache)

    def run(self, on_byte: OnByte | None = None) -> Outcome:
        self.on_byte, self.outcome = on_byte, Outcome()
        program = decode_instructions(self.world, len(self.groups), self.settings.tokens, self.rank)
        handlers = {"RECV_F": self._post_receive, "F": self._forward_step, "SEND_F": self._send}
        self.origin = time.perf_counter()
        for instruction in program:
            handlers[instruction.kind](instruction)
        self._finish_sends()
        outcome = self.outcome
        outcome.seconds = time.perf_counter() - self.origin
        outcome.weight_bytes = sum(p.nbytes for p in {id(p): p for p in self.pieces.parameters()}.values())
        outcome.cache_bytes = sum(lane.cache.nbytes for group in self.groups for lane in group)
        if self.last:
            outcome.texts = {lane.index: lane.generated for group in self.groups for lane in group}
        return outcome

    # --- the handlers -----------------------------------------------------------------------------------

    def _post_receive(self, instruction: Instruction) -> None:
        """Post the receive of a forward's input: the bytes of the group's previous token on rank 0 (from
        the last rank), else the header of what the previous rank computed (the hidden states follow)."""
        group, token = instruction.microbatch, token_of(instruction, self.world)
        size = len(self.groups[group])
        if self.first:
            what = f"the bytes of group {group}, token {token - 1}"
            pending = comms.irecv((size,), instruction.peer, torch.int64, _BYTES, what)
        else:
            what = f"the header of group {group}, token {token}"
            pending = comms.irecv((size, 2), instruction.peer, torch.int64, _HEADER, what)
        self.receiving[(instruction.stage, group)] = pending

    def _forward_step(self, instruction: Instruction) -> None:
        """Token ``token`` of every prompt of the group through this rank's stage, timed as a span."""
        group, token = instruction.microbatch, token_of(instruction, self.world)
        began = time.perf_counter()
        feeds, waited = self._inputs(instruction.stage, group, token)
        outputs = [self._forward(lane, feed) for lane, feed in zip(self.groups[group], feeds, strict=True)]
        if self.last:
            handed = [
                self._sample(lane, logits) for lane, logits in zip(self.groups[group], outputs, strict=True)
            ]
        else:
            sizes = [[0, 0] if f is None else [f[1].shape[1], int(f[0])] for f in feeds]
            header = torch.tensor(sizes, dtype=torch.int64, device=self.device)
            hidden = [out for out in outputs if out is not None]
            handed = (header, torch.cat(hidden, dim=1) if hidden else None)
        if token < self.settings.tokens - 1 or not self.last:  # the last bytes: nobody needs them again
            self.outputs[(instruction.stage, group)] = handed
        ended = time.perf_counter()
        if token < TIMED_TOKENS:
            span = Span(self.rank, instruction.action, began - self.origin, ended - self.origin, waited)
            self.outcome.spans.append(span)
        if self.last and token == 0:
            self.outcome.first_byte_s[group] = ended - self.origin
        if group == len(self.groups) - 1:
            self._finish_sends()

    def _send(self, instruction: Instruction) -> None:
        """Hand a forward's output on: the bytes sampled (the last rank, to rank 0), else the header and
        the new tokens' hidden states, all prompts' in one ``(1, n, dim)`` tensor."""
        group = instruction.microbatch
        handed = self.outputs.pop((instruction.stage, group))
        if self.last:
            sampled = torch.tensor(handed, dtype=torch.int64, device=self.device)
            self.sends.append(comms.isend(sampled, instruction.peer, _BYTES, f"the bytes of group {group}"))
            return
        header, hidden = handed
        what = f"the header of group {group}"
        self.sends.append(comms.isend(header, instruction.peer, _HEADER, what))
        if hidden is not None:
            what = f"the hidden states of group {group}"
            self.sends.append(comms.isend(hidden, instruction.peer, _HIDDEN, what))

    # --- what a forward takes in -----------------------------------------------------------------------

    def _inputs(
        self, stage: int, group: int, token: int
    ) -> tuple[list[tuple[bool, torch.Tensor] | None], float]:
        """Each lane's (reset, inputs) for this forward, None for an ended prompt; and the seconds waited."""
        waited = time.perf_counter()
        lanes = self.groups[group]
        if self.first:
            sampled = self._sampled_bytes(stage, group, token)
            waited = time.perf_counter() - waited
            return [self._feed(lane, byte, token) for lane, byte in zip(lanes, sampled, strict=True)], waited
        header = self.receiving.pop((stage, group)).wait().tolist()
        total = sum(n for n, _ in header)
        hidden = None
        if total:
            what = f"the hidden states of group {group}, token {token}"
            hidden = comms.irecv((1, total, self.settings.dim), self.rank - 1, torch.float32, _HIDDEN, what)
            hidden = hidden.wait()
        waited = time.perf_counter() - waited
        feeds, offset = [], 0
        for n, reset in header:
            feeds.append((bool(reset), hidden[:, offset : offset + n]) if n else None)
            offset += n
        return feeds, waited

    def _sampled_bytes(self, stage: int, group: int, token: int) -> list[int | None]:
        """On rank 0: the bytes the last rank sampled at the group's previous token (None for the
        prefill), received, or on one rank handed over in memory by the previous round's forward."""
        if token == 0:
            return [None] * len(self.groups[group])
        if (stage, group) in self.receiving:
            return self.receiving.pop((stage, group)).wait().tolist()
        return self.outputs.pop((stage - 1, group))  # type: ignore[return-value]

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
        return reset, torch.tensor(fed, dtype=torch.int64, device=self.device)[None]

    # --- the forward, and what it hands on -------------------------------------------------------------

    def _forward(self, lane: Lane, feed: tuple[bool, torch.Tensor] | None) -> torch.Tensor | None:
        if feed is None:
            return None
        reset, inputs = feed
        if reset:
            lane.cache.reset()
        return self.decoding.forward(self.pieces, inputs, lane.cache)

    def _sample(self, lane: Lane, logits: torch.Tensor | None) -> int:
        """The next byte of ``lane`` (the last rank); ENDED once the prompt's stop string has come."""
        if logits is None or lane.ended:
            lane.ended = True
            return ENDED
        settings = self.settings
        draw = uniform_for(settings.seed, lane.index, len(lane.ids)) if settings.temperature else 0.0
        byte = choose(logits, settings.temperature, settings.top_k, draw)
        lane.ids.append(byte)
        if self.on_byte:
            self.on_byte(lane.index, byte)
        if settings.stop and lane.generated.endswith(settings.stop):
            lane.ended = True
            return ENDED
        return byte

    def _finish_sends(self) -> None:
        for pending in self.sends:
            pending.wait()
        self.sends.clear()
