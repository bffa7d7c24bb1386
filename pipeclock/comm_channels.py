"""Which communicator carries a message between two ranks, and what that means for receiving it.

On gloo every message travels over the world group and a receive takes the send with its tag. NCCL
ignores tags and runs the operations of one communicator in order on one stream, so a send to a peer
queued before a receive from the same peer can block it: there each directed neighbour pair ("a to b",
"b to a") gets a communicator of its own, which keeps activations and gradients from waiting on each
other, and receives over one channel must be posted in the order their sends were.
"""

from __future__ import annotations

import torch.distributed as dist

_channel_groups: dict[tuple[int, int], dist.ProcessGroup] = {}  # (src, dst) -> its communicator
_routes: dict[tuple[str, int], tuple[dist.ProcessGroup, int]] = {}  # ("to" | "from", peer) -> (group, rank)


def matches_by_tag() -> bool:
    """Whether a receive takes the send with its tag (gloo), not the next send between the two ranks
    over the same communicator (nccl ignores tags: a receive must then be posted in the order sent)."""
    return not dist.is_initialized() or dist.get_backend() != "nccl"


def add_channels(pipelines: list[list[int]]) -> None:
    """On nccl, the directed channels between neighbours (in a ring) of each pipeline's global ranks.

    ``comms.init`` makes them for one pipeline over the whole world; a mesh of several pipelines adds its
    own. Every rank calls this with the same list (``new_group`` is collective); gloo needs no channels.
    """
    if matches_by_tag():
        return
    for ranks in pipelines:
        for i, src in enumerate(ranks):
            for dst in sorted({ranks[(i + 1) % len(ranks)], ranks[i - 1]} - {src}):
                if (src, dst) not in _channel_groups:
                    _channel_groups[(src, dst)] = dist.new_group([src, dst])
    _routes.clear()


def route(me: int, direction: str, peer: int) -> tuple[dist.ProcessGroup, int]:
    """The process group that carries messages ``"to"`` or ``"from"`` ``peer``, and ``peer``'s rank in it.

    This is what ``dist.isend``/``dist.irecv`` work out on every call; here it is worked out once per
    channel, and the group's ``send``/``recv`` are called directly.
    """
    key = (direction, peer)
    if key not in _routes:
        channel = (me, peer) if direction == "to" else (peer, me)
        group = _channel_groups.get(channel) or dist.group.WORLD
        _routes[key] = (group, dist.get_group_rank(group, peer))
    return _routes[key]


def forget() -> None:
    """Drop every channel and route (the process group is being destroyed)."""
    _channel_groups.clear()
    _routes.clear()
