"""The decode loop as a schedule like any other: forward-only actions, lowered to the engine's program.

Generation cuts the prompts into groups; group g's token t goes through every rank's stage, and the last
rank's byte comes back to rank 0 as the input of token t + 1. Unrolled over the tokens, that loop is a
forward-only pipeline of ``tokens x p`` virtual stages on the loop placement with one chunk per token:
rank r's chunk t is virtual stage ``t * p + r`` (the same pieces, met again at every token). So a decode
forward is the training IR's ``Action("F", group, token)`` (micro-batch = group, chunk = token), and every
rank runs the same order, token by token and within a token group by group:

    rank r:  F0.0 F1.0 ... F(G-1).0  F0.1 F1.1 ...

``engine.program.lower`` derives the messages as it does for an interleaved schedule: ``SEND_F`` /
``RECV_F`` between neighbours, and from the last rank to rank 0 where a token goes round (the byte
sampled, the input of the next token's first stage); on one rank the ring hands over in memory. The
generation runtime walks that program and ``engine.program_run.simulate_program`` times it: a group's next
token cannot start before its last one has gone round, so with one group p - 1 of p ranks wait (decoding's
own bubble); with G >= p groups each rank always has another group's token to compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from pipeclock.engine.actions import Action, Schedule
from pipeclock.engine.placement import Placement
from pipeclock.engine.program import STEP, Instruction, Program, lower
from pipeclock.engine.program_run import simulate_program
from pipeclock.engine.spans import Span
from pipeclock.observe.timeline import Timeline


def decode_schedule(num_stages: int, num_groups: int, tokens: int) -> Schedule:
    """Each rank's forwards, in the order it runs them (the same on every rank), and their placement."""
    order = [Action("F", group, token) for token in range(tokens) for group in range(num_groups)]
    return Schedule([list(order) for _ in range(num_stages)], Placement.loop(num_stages, max(tokens, 1)))


def decode_program(num_stages: int, num_groups: int, tokens: int) -> list[Program]:
    """Every rank's decode program: the schedule lowered by the engine, without the training step's own
    words (``SIZES``, ``AGREE``, ``LOSS``): a decode program has no batch to agree on and no loss."""
    programs = lower(decode_schedule(num_stages, num_groups, tokens))
    return [[i for i in program if i.kind not in STEP] for program in programs]


def decode_instructions(num_stages: int, num_groups: int, tokens: int, rank: int) -> Iterator[Instruction]:
    """Rank ``rank``'s decode program, made as it is walked: ``decode_program(...)[rank]``, instruction for
    instruction, without holding it (a run of a billion bytes starts at once, in constant memory).

    The program repeats itself: every token between the first and the last is the second token's
    instructions, moved ``p`` virtual stages (one round) on per token. So three tokens are lowered, and
    the middle one is repeated.
    """
    if tokens <= 3:
        yield from decode_program(num_stages, num_groups, tokens)[rank]
        return
    first, middle, last = _by_token(decode_program(num_stages, num_groups, 3)[rank], num_stages)
    yield from first
    for token in range(1, tokens - 1):
        yield from (_moved(instruction, token - 1, num_stages) for instruction in middle)
    yield from (_moved(instruction, tokens - 3, num_stages) for instruction in last)


def _by_token(program: Program, num_stages: int) -> list[Program]:
    """A three-token program cut where its token changes: its first, middle and last token's parts."""
    parts: list[Program] = [[], [], []]
    for instruction in program:
        parts[token_of(instruction, num_stages)].append(instruction)
    return parts


def _moved(instruction: Instruction, rounds: int, num_stages: int) -> Instruction:
    """The same instruction ``rounds`` tokens later: its virtual stage and its chunk (the token) moved."""
    assert instruction.stage is not None
    action = instruction.action
    if action is not None:
        action = Action(action.op, action.microbatch, action.chunk + rounds)
    return dataclasses.replace(instruction, stage=instruction.stage + rounds * num_stages, action=action)


def token_of(instruction: Instruction, num_stages: int) -> int:
    """The token step an instruction of the decode program belongs to (its virtual stage's round)."""
    assert instruction.stage is not None
    return instruction.stage // num_stages


def simulate(
    num_stages: int,
    group_sizes: Sequence[int],
    tokens: int,
    per_prompt: float = 1.0,
    latency: float = 0.0,
) -> Timeline:
    """The decode program's timeline (``simulate_program``) when a forward of a group costs
    ``per_prompt`` per prompt in it on every rank, and a message ``latency``."""
    programs = decode_program(num_stages, len(group_sizes), tokens)
    run = simulate_program(programs, lambda _rank, i: per_prompt * group_sizes[i.microbatch], latency=latency)
    spans = [
        Span(rank, instruction.action, start, end)
        for rank, rows in enumerate(run.spans)
        for instruction, start, end in rows
        if instruction.action is not None
    ]
    return Timeline(spans, num_stages)
