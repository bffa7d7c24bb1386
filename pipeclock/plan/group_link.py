"""The link a data-parallel collective (all-reduce, reduce-scatter, all-gather) gets per rank.

Ranks are laid out dp x pp x tp with tp innermost (`pipeclock.plan.cluster_config`), so the ranks of one
data-parallel group sit tp x pp apart: a node holds ``gpus_per_node // (tp x pp)`` of them (at least one,
at most dp). NCCL lays a collective's rings and trees over one channel per NIC its ranks own: a group with
k ranks on each node moves its traffic between nodes through k NICs at once, and each rank's share of
it runs k times as fast as through one NIC, until the node's own links (which carry the data to and from
those NICs) are the slower: min(k x NIC, NVLink) per rank. A group inside one node uses NVLink alone.

With tp 8 each node holds one rank of a group (one NIC: the flat model); with tp 2, four; without model
parallelism, all eight. The all-to-all of expert parallel is not such a collective: each rank's tokens
leave through its own NIC (`pipeclock.plan.experts`). Sources and measurements: docs/cluster.md.
"""

from __future__ import annotations

from pipeclock.plan.cluster_config import Config
from pipeclock.plan.gpus import GpuKind


def ranks_per_node(config: Config, gpu: GpuKind) -> int:
    """How many ranks of one data-parallel group the emptiest of its nodes holds."""
    k = max(1, min(config.dp, gpu.gpus_per_node // (config.tp * config.pp)))
    return min(k, config.dp % k or k)  # a last node holding fewer sets the ring's pace


def bandwidth(config: Config, gpu: GpuKind) -> float:
    """Bytes/s per rank, one direction, of a data-parallel collective (the line rate: the caller applies
    the links' efficiency)."""
    if config.gpus <= gpu.gpus_per_node:
        return gpu.intra_node_bandwidth
    return min(ranks_per_node(config, gpu) * gpu.inter_node_bandwidth, gpu.intra_node_bandwidth)
