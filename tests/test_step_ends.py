"""How the batch sizes reach every rank: for any number of ranks and any ranks holding the two ends.

The sizes travel along the pipeline (``pipeclock.engine.step_ends``); these tests follow the messages
the routes say, without processes, for every placement of the ends: the real messages of the same
routes run in every multi-process test (``test_pipeline_matrix`` among them).
"""

from __future__ import annotations

import itertools

import torch

from pipeclock.engine.step_ends import StepEnds

CPU = torch.device("cpu")


def _routes(count: int, first: int, last: int) -> list[tuple[list[int], list[int], int | None]]:
    return [StepEnds(rank, list(range(count)), first, last, CPU)._route() for rank in range(count)]


def _deliver(count: int, first: int, last: int) -> list[set[str]]:
    """Which ends' sizes each rank holds once every message the routes say has been read.

    A rank sends its own sizes at once; it hands on what it holds only once it has read all it reads,
    as ``batch_sizes`` does. Raises if some rank would wait for a message nobody sends.
    """
    routes = _routes(count, first, last)
    held = [{end for end, at in (("first", first), ("last", last)) if at == rank} for rank in range(count)]
    mail = {(rank, to): set(held[rank]) for rank in range(count) for to in routes[rank][0]}
    unread = {rank: set(routes[rank][1]) for rank in range(count)}
    while any(unread.values()):
        progress = False
        for rank in range(count):
            for sender in sorted(unread[rank]):
                if (sender, rank) in mail:
                    held[rank] |= mail.pop((sender, rank))
                    unread[rank].discard(sender)
                    progress = True
            hand_on_to = routes[rank][2]
            if not unread[rank] and hand_on_to is not None and (rank, hand_on_to) not in mail:
                mail[(rank, hand_on_to)] = set(held[rank])
                routes[rank] = (*routes[rank][:2], None)
        assert progress, f"{count} ranks, ends {first} and {last}: waiting for sizes nobody sends: {unread}"
    assert not mail, f"{count} ranks, ends {first} and {last}: sizes sent that nobody reads: {sorted(mail)}"
    return held


def test_every_rank_learns_both_ends_sizes_wherever_the_ends_are():
    for count in range(1, 7):
        for first, last in itertools.product(range(count), repeat=2):
            held = _deliver(count, first, last)
            assert all(ends == {"first", "last"} for ends in held), (count, first, last, held)


def test_each_rank_reads_one_size_message_the_hub_two_and_the_first_stage_sends_one():
    for count in range(2, 7):
        for first, last in itertools.product(range(count), repeat=2):
            routes = _routes(count, first, last)
            hub = (first + 1) % count
            reads = [len(senders) for _, senders, _ in routes]
            assert max(reads[:hub] + reads[hub + 1 :]) <= 1 and reads[hub] <= 2, (count, first, last)
            assert routes[first][0] == [hub], (count, first, last)


def test_a_rank_hears_the_sizes_from_the_rank_before_it_so_before_that_rank_can_send_it_activations():
    """In a loop of stages, rank r's activations come from rank r - 1: the rank it reads the sizes from
    (after the hub), which hands them on before its own first forward."""
    for count in range(3, 7):
        routes = _routes(count, 0, count - 1)
        for rank in range(2, count):
            assert routes[rank][1] == [rank - 1]
            assert routes[rank - 1][2] == rank
