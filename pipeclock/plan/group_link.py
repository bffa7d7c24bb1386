"""Where a cluster run's ranks sit on its nodes, and the links their collectives and messages get.

The ranks follow ``Software.rank_order`` (`rank`), tp innermost in both orders, nodes holding
consecutive ranks. Under the frameworks' order (pp x dp x cp x tp, pp outermost) the ranks that hold a
stage's weights (its dp x cp replicas, which reduce the gradients together) sit tp apart: a node holds
``gpus_per_node // tp`` of them (at least one, at most dp x cp), and a pipeline's neighbouring stages sit
dp x cp x tp ranks apart, so once the run spans nodes a stage-to-stage message crosses the network. Under
pipeclock's own (dp x pp x cp x tp, dp outermost, as `pipeclock.parallel.mesh` lays it; cp kept next to
tp) a pipeline's pp x cp x tp ranks are consecutive: a stage's replicas sit that far apart, so a node
holds ``gpus_per_node // (pp x cp x tp)`` replicas (at least one) with their cp ranks, and neighbouring
stages sit cp x tp apart, their messages crossing the network only where a pipeline spans nodes.
NCCL lays a collective's rings and trees over one channel per NIC its ranks own: a group with k ranks on
each node moves its traffic between nodes through k NICs at once, and each rank's share of it runs k
times as fast as through one NIC, until the node's own links (which carry the data to and from those
NICs) are the slower: min(k x NIC, NVLink) per rank. A group inside one node uses NVLink alone.

With tp 8 each node holds one rank of a group (one NIC: the flat model); with tp 2, four (pp outermost);
without model parallelism, all eight. A stage-to-stage message that crosses nodes goes one pair of ranks
on one NIC each, and the slowest boundary sets the pipeline's pace. The all-to-all of expert parallel is
not a ring either: each rank's tokens leave through its own NIC (`pipeclock.plan.experts`).

DeepSpeed's ZeRO-3 (``Software.deepspeed`` with ZeRO-3) is held to one NIC a rank: its published runs
(Narayanan et al. 2021, Table 2) keep a step of about 67 s from 768 to 1,536 GPUs, a rank's bytes moving
at one HDR NIC's rate; what DeepSpeed did to get no more is not measured anywhere found, so this is the
rows' own reading, not a mechanism. Sources and measurements: docs/cluster.md.
"""

from __future__ import annotations

from pipeclock.plan.cluster_config import DP_OUTERMOST, Config, Software
from pipeclock.plan.gpus import GpuKind


def rank(config: Config, order: str, replica: int, stage: int, cp_rank: int, tp_rank: int) -> int:
    """The global rank of replica ``replica``'s stage ``stage``, context-parallel rank ``cp_rank``, tensor-
    parallel rank ``tp_rank`` under ``order`` (`cluster_config.RANK_ORDERS`)."""
    inner = cp_rank * config.tp + tp_rank
    if order == DP_OUTERMOST:
        return (replica * config.pp + stage) * config.cp * config.tp + inner
    return (stage * config.dp + replica) * config.cp * config.tp + inner


def ranks_per_node(config: Config, gpu: GpuKind, order: str) -> int:
    """How many ranks of one data-parallel group (a stage's dp x cp replicas) the emptiest of its nodes
    holds."""
    if order != DP_OUTERMOST:
        k = max(1, min(config.replicas, gpu.gpus_per_node // config.tp))
        return min(k, config.replicas % k or k)  # a last node holding fewer sets the ring's pace
    pipelines = max(1, min(config.dp, gpu.gpus_per_node // (config.pp * config.cp * config.tp)))
    pipelines = min(pipelines, config.dp % pipelines or pipelines)
    return pipelines * max(1, min(config.cp, gpu.gpus_per_node // config.tp))


def group_in_one_node(config: Config, gpu: GpuKind, order: str) -> bool:
    """Whether each data-parallel group lies inside one node: the run fits in one, or the ranks between a
    group's first and last fill whole slots of a node (a stage's dp x cp x tp with pp outermost; with dp
    outermost, a stage's cp x tp when dp is 1, else the whole run)."""
    if order == DP_OUTERMOST:
        span = config.cp * config.tp if config.dp == 1 else config.gpus
    else:
        span = config.replicas * config.tp
    return config.gpus <= gpu.gpus_per_node or (span <= gpu.gpus_per_node and gpu.gpus_per_node % span == 0)


def one_nic_a_rank(config: Config, software: Software | None) -> bool:
    """Whether the run's data-parallel collectives get one NIC a rank whatever the layout: DeepSpeed's
    ZeRO-3, as its published rows read (the module's rules)."""
    return software is not None and software.deepspeed and config.zero == 3


def bandwidth(config: Config, gpu: GpuKind, software: Software | None = None) -> float:
    """Bytes/s per rank, one direction, of a data-parallel collective (the line rate: the caller applies
    the links' efficiency); without ``software``, `Software`'s defaults."""
    order = (software or Software()).rank_order
    if group_in_one_node(config, gpu, order):
        return gpu.intra_node_bandwidth
    nics = 1 if one_nic_a_rank(config, software) else ranks_per_node(config, gpu, order)
    return min(nics * gpu.inter_node_bandwidth, gpu.intra_node_bandwidth)


def message_crosses_nodes(config: Config, gpu: GpuKind, order: str) -> bool:
    """Whether some stage-to-stage message of the pipeline crosses the network (the slowest sets the
    pipeline's pace). pp outermost: the stages sit dp x cp x tp ranks apart, so once the run spans nodes
    some do. dp outermost: a pipeline's pp x cp x tp ranks are consecutive, so only one that spans
    nodes (more than a node's ranks, or not a whole slot of one) sends a message across."""
    if config.pp == 1 or config.gpus <= gpu.gpus_per_node:
        return False
    pipeline = config.pp * config.cp * config.tp
    return order != DP_OUTERMOST or pipeline > gpu.gpus_per_node or gpu.gpus_per_node % pipeline != 0
