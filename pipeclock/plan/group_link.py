"""Where a cluster run's ranks sit on its nodes, and the links their collectives and messages get.

Ranks are laid out pp x dp x cp x tp, pp outermost (`pipeclock.plan.cluster_config`), so the ranks that
hold a stage's weights (its dp x cp replicas, which reduce the gradients together) sit tp apart: a node
holds ``gpus_per_node // tp`` of them (at least one, at most dp x cp).
NCCL lays a collective's rings and trees over one channel per NIC its ranks own: a group with k ranks on
each node moves its traffic between nodes through k NICs at once, and each rank's share of it runs k
times as fast as through one NIC, until the node's own links (which carry the data to and from those
NICs) are the slower: min(k x NIC, NVLink) per rank. A group inside one node uses NVLink alone.

With tp 8 each node holds one rank of a group (one NIC: the flat model); with tp 2, four; without model
parallelism, all eight. A pipeline's neighbouring stages sit dp x cp x tp ranks apart: once the run spans
nodes, a stage-to-stage message crosses the network, one pair of ranks on one NIC each. The all-to-all of
expert parallel is not a ring either: each rank's tokens leave through its own NIC
(`pipeclock.plan.experts`).

DeepSpeed's ZeRO-3 (``Software.deepspeed`` with ZeRO-3) is held to one NIC a rank: its published runs
(Narayanan et al. 2021, Table 2) keep a step of about 67 s from 768 to 1,536 GPUs, a rank's bytes moving
at one HDR NIC's rate; what DeepSpeed did to get no more is not measured anywhere found, so this is the
rows' own reading, not a mechanism. Sources and measurements: docs/cluster.md.
"""

from __future__ import annotations

from pipeclock.plan.cluster_config import Config, Software
from pipeclock.plan.gpus import GpuKind


def ranks_per_node(config: Config, gpu: GpuKind) -> int:
    """How many ranks of one data-parallel group (a stage's dp x cp replicas) the emptiest of its nodes
    holds."""
    k = max(1, min(config.replicas, gpu.gpus_per_node // config.tp))
    return min(k, config.replicas % k or k)  # a last node holding fewer sets the ring's pace


def group_in_one_node(config: Config, gpu: GpuKind) -> bool:
    """Whether each data-parallel group lies inside one node: the run fits in one, or a stage's dp x cp x tp
    ranks fill whole slots of a node (a node holds whole stages)."""
    span = config.replicas * config.tp
    return config.gpus <= gpu.gpus_per_node or (span <= gpu.gpus_per_node and gpu.gpus_per_node % span == 0)


def one_nic_a_rank(config: Config, software: Software | None) -> bool:
    """Whether the run's data-parallel collectives get one NIC a rank whatever the layout: DeepSpeed's
    ZeRO-3, as its published rows read (the module's rules)."""
    return software is not None and software.deepspeed and config.zero == 3


def bandwidth(config: Config, gpu: GpuKind, software: Software | None = None) -> float:
    """Bytes/s per rank, one direction, of a data-parallel collective (the line rate: the caller applies
    the links' efficiency)."""
    if group_in_one_node(config, gpu):
        return gpu.intra_node_bandwidth
    nics = 1 if one_nic_a_rank(config, software) else ranks_per_node(config, gpu)
    return min(nics * gpu.inter_node_bandwidth, gpu.intra_node_bandwidth)


def message_crosses_nodes(config: Config, gpu: GpuKind) -> bool:
    """Whether some stage-to-stage message of the pipeline crosses the network (the slowest sets the
    pipeline's pace): its stages sit dp x cp x tp ranks apart, so once the run spans nodes some do."""
    return config.pp > 1 and config.gpus > gpu.gpus_per_node
