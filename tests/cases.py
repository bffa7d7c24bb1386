"""Cases the gradient matrices share: each schedule with the chunks per rank and the placement it runs
on (the V schedules hold two chunks on a V, interleaving two on the loop)."""

from __future__ import annotations

SCHEDULE_CHUNKS = {
    "naive": 1,
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zb-h1": 1,
    "zb-v": 2,
    "dualpipev": 2,
}
PLACEMENT = {"zb-v": "v", "dualpipev": "v"}  # the others loop
V_PLACED = tuple(PLACEMENT)
