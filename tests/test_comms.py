"""comms: real gloo processes send, receive, check shapes, time out and notice a dead peer."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pipeclock import comms
from tests.distributed import run_ok, run_ranks

ROUND_TRIP_CASES = [
    ((4, 3), torch.float32),
    ((2, 3, 5), torch.float64),
    ((7,), torch.int64),
    ((), torch.float32),
    ((0, 4), torch.float32),
    ((3, 2), torch.bfloat16),
    ((5,), torch.bool),
]


def _sample(shape, dtype, salt):
    generator = torch.Generator().manual_seed(salt)
    return (torch.rand(shape, generator=generator) * 100).to(dtype)


def _checked_exchanges(rank, world):
    """Rank 0 sends; rank 1 receives and reports what it got, and what the mismatches raised."""
    report = {}
    for index, (shape, dtype) in enumerate(ROUND_TRIP_CASES):
        if rank == 0:
            comms.send_tensor(_sample(shape, dtype, index), dest=1)
        else:
            got = comms.recv_tensor(shape, src=0, dtype=dtype)
            report[index] = torch.equal(got, _sample(shape, dtype, index))
    if rank == 0:
        comms.send_tensor(torch.zeros(5), dest=1)  # expected as (3,)
        comms.send_tensor(torch.zeros(3, dtype=torch.float64), dest=1)  # expected as float32
        comms.send_tensor(torch.arange(6.0).reshape(2, 3), dest=1)  # shape unknown to the receiver
        comms.send_tensor(torch.ones(2), dest=1)  # proves the channel is still in step
        return report
    for key, shape in (("size", (3,)), ("dtype", (3,))):
        try:
            comms.recv_tensor(shape, src=0)
        except comms.ShapeMismatchError as error:
            report[key] = str(error)
    report["learned"] = comms.recv_tensor(None, src=0).tolist()
    report["after"] = comms.recv_tensor((2,), src=0).tolist()
    return report


def test_send_recv_delivers_every_shape_and_dtype_intact_and_names_mismatches():
    report = run_ok(_checked_exchanges, 2)[1]
    assert all(report[i] for i in range(len(ROUND_TRIP_CASES)))
    assert (
        report["size"] == "rank 1 expected shape (3,) float32 from rank 0, but rank 0 sent shape (5,) float32"
    )
    assert (
        report["dtype"]
        == "rank 1 expected shape (3,) float32 from rank 0, but rank 0 sent shape (3,) float64"
    )
    assert report["learned"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert report["after"] == [1.0, 1.0]


def _topology_and_tagged_ring(rank, world):
    """Each rank sends two tagged tensors to its next rank and posts the receives in reverse tag order."""
    nxt, prev = comms.get_next_rank(), comms.get_prev_rank()
    ring_next, ring_prev = (rank + 1) % world, (rank - 1) % world
    sends = [comms.isend(torch.full((3,), 10.0 * rank + tag), ring_next, tag=tag) for tag in (1, 2)]
    second = comms.irecv((3,), ring_prev, tag=2)
    first = comms.irecv((3,), ring_prev, tag=1)
    got = [first.wait()[0].item(), second.wait()[0].item()]
    for send in sends:
        send.wait()
    header = comms.send_meta(torch.zeros(2, 7, dtype=torch.float16), ring_next, tag=9)
    meta = comms.recv_meta(ring_prev, tag=9)
    header.wait()
    return nxt, prev, got, meta


def test_topology_and_tags_on_three_ranks():
    results = run_ok(_topology_and_tagged_ring, 3)
    assert [(nxt, prev) for nxt, prev, _, _ in results] == [(1, None), (2, 0), (None, 1)]
    for rank, (_, _, got, meta) in enumerate(results):
        sender = (rank - 1) % 3
        assert got == [10.0 * sender + 1, 10.0 * sender + 2]
        assert meta == ((2, 7), torch.float16)


def _receive_what_never_comes(rank, world):
    if rank == 0:
        time.sleep(3)  # alive but silent
        return None
    start = time.monotonic()
    try:
        comms.recv_tensor((3,), src=0)
    except comms.CommTimeoutError as error:
        return time.monotonic() - start, str(error)
    return None


def test_a_receive_whose_sender_never_sends_times_out_within_the_timeout():
    outcome = run_ranks(_receive_what_never_comes, 2, timeout=2.0)[1]
    waited, message = outcome.value
    assert 2.0 <= waited < 4.0
    assert message.startswith("rank 1: ") and "rank 0" in message and "within 2s" in message


def _peer_dies(rank, world):
    comms.barrier()
    if rank == 0:
        time.sleep(0.5)
        os._exit(3)  # a crash: no goodbye, no teardown
    start = time.monotonic()
    try:
        comms.recv_tensor((3,), src=0)
    except comms.PeerGoneError as error:
        return time.monotonic() - start, str(error)
    return None


def test_a_peer_that_dies_is_reported_quickly_and_by_rank():
    outcomes = run_ranks(_peer_dies, 2, timeout=30.0)
    assert outcomes[0].exitcode == 3
    waited, message = outcomes[1].value
    assert waited < 10.0, "noticed by the broken connection, not by the 30 s timeout"
    assert message.startswith("rank 1: lost the connection to rank 0")


def test_init_without_torchrun_makes_a_one_process_world(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert comms.init(timeout=5.0) == (0, 1)
        assert (comms.get_next_rank(), comms.get_prev_rank()) == (None, None)
        assert comms.timeout() == 5.0 and comms.device() == torch.device("cpu")
    finally:
        comms.shutdown()


@pytest.mark.parametrize(("local_ranks", "expected"), [("1", None), ("2", 0.5), ("64", 0)])
def test_threads_are_the_cores_shared_among_local_ranks(monkeypatch, local_ranks, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    cores = len(os.sched_getaffinity(0))
    want = cores if expected is None else max(1, int(cores * expected))
    assert comms.threads_per_process() == want
