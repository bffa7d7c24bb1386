"""The search: every way to run the job on the cluster, the ones that fit, ranked by tokens/s.

The knobs: tp (a divisor of the node's GPU count, and of the heads), pp (at most the layer count), dp
(the rest; it must divide the global batch), cp (context parallel, `pipeclock.plan.context_parallel`:
for sequences of 32,768 tokens or more, 1, 2, 4, 8 and 16 where they divide the GPUs; else 1 unless
``--fix cp=N`` asks), the micro-batch size (a divisor of each replica's share),
the schedule (pipeclock's seven; one stage needs none) with its chunks per rank (interleaving: 2, 3, 4,
6 or 8 while every stage keeps a layer; a V: 2), recompute, the ZeRO stage, and sequence parallel.

A configuration whose states alone (weights, gradients, optimizer state, sharded as far as it goes)
exceed the GPU is dropped at once. The others wait in a queue ordered by a floor on their step time:
first the cheapest (`pipeclock.plan.cluster_time.work_floor`: the work spread evenly over the stages),
and when one reaches the front, the tighter one its schedule gives (`pipeline_floor`, plus what data
parallel and the optimizer add for sure), with which it queues again; at the front a second time it is
judged: the fullest GPU's memory (first a floor on it that reads no schedule, `memory_floor`), and where
it fits, the step from the program simulator. A
selective-attention configuration is not judged when the same one without recompute fit: it does the
same work plus the attention core again, on the same schedule. The search stops once no floor left can
beat the ``top``-th best step found; the simulations themselves are cached by their costs' ratios.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from pipeclock.engine.generators import SCHEDULES, V_SCHEDULES
from pipeclock.plan import context_parallel, experts
from pipeclock.plan.cluster_config import RECOMPUTES, ZERO_STAGES, Config, Job, Software
from pipeclock.plan.cluster_memory import (
    GpuMemory,
    gpu_memory,
    memory_floor,
    most_virtual_stages,
    static_floor,
)
from pipeclock.plan.cluster_plan import Prediction, rate
from pipeclock.plan.cluster_time import (
    Rates,
    data_parallel_seconds,
    message_seconds,
    optimizer_seconds,
    stage_costs,
    step_time,
    work_floor,
)
from pipeclock.plan.gpus import Cluster
from pipeclock.plan.paper_model import PaperModel
from pipeclock.plan.pipeline_time import pipeline_floor, shape_floor

INTERLEAVE_CHUNKS = (2, 3, 4, 6, 8)
DEGREES = ("tp", "cp", "pp", "dp")  # the layout's degrees, innermost first
# A free search tries context parallel for sequences this long (below, attention's share of the work is
# small and cp only adds its exchange), at powers of two up to this degree
CP_SEARCHED_FROM, CP_SEARCHED_UP_TO = 32768, 16
ONE_STAGE_SCHEDULE = "1f1b"  # with one stage every schedule is F then B per micro-batch
FIXABLE = (
    "tp", "pp", "dp", "cp", "schedule", "chunks", "microbatch-size", "recompute", "zero", "sp", "ep", "ends"
)  # fmt: skip


class SearchError(ValueError):
    """A job or a --fix that no configuration can satisfy."""


@dataclass
class SearchResult:
    ranked: list[Prediction]  # the fastest that fit, best first
    considered: int = 0  # every configuration the knobs allow
    judged: int = 0  # of them, whose memory was judged (best floor first, until none left could win)
    fitting: int = 0  # of those, that fit
    simulated: int = 0
    smallest: Prediction | None = None  # only when nothing fits: the configuration that comes closest
    notes: list[str] = field(default_factory=list)


def search(
    model: PaperModel,
    cluster: Cluster,
    job: Job,
    software: Software,
    fixed: dict | None = None,
    top: int = 5,
    progress: Callable[[int, int, float | None], None] | None = None,
) -> SearchResult:
    """The ``top`` fastest configurations that fit (see the module's order of work). ``progress``, when
    given, is called now and then with (configurations considered, judged, the best step so far)."""
    with _collector_paused():
        return _search(model, cluster, job, software, fixed or {}, top, progress)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: a search keeps hundreds of thousands of objects alive
    (schedule tables, compiled programs) and makes no cycles, and each full collection walked them all
    (a third of a 1T search's time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _search(model, cluster, job, software, fixed: dict, top: int, progress) -> SearchResult:
    progress = progress or (lambda _considered, _judged, _best: None)
    result = SearchResult([])
    rates, capacity = Rates(cluster.kind, software), cluster.kind.memory
    queue: list[tuple[float, int, bool, object]] = []  # (floor, order, refined, group or config): a heap
    leanest: tuple[float, int, Config] | None = None  # the least static memory, for when nothing fits
    for base, members in config_groups(model, cluster, job, fixed):
        before = result.considered
        result.considered += len(members)
        if result.considered // 4096 > before // 4096:
            progress(result.considered, 0, None)
        static = static_floor(model, base, software)  # the cheap floors read no schedule
        if leanest is None or (static, members[0][2]) < leanest[:2]:
            leanest = (static, members[0][2], base)
        if static <= capacity:
            queue.append(
                (work_floor(model, base, job, software, rates), members[0][2], False, (base, members))
            )
    heapq.heapify(queue)
    ranked: list[tuple[float, int, Prediction]] = []  # (step, order number, prediction)
    fit: set[Config] = set()
    too_large: list[tuple[Config, GpuMemory | None]] = []  # judged, in order, with their memory if read
    while queue:
        floor, number, refined, config = heapq.heappop(queue)
        if len(ranked) >= top and (floor, number) >= ranked[top - 1][:2]:
            break
        if not refined:  # the cheap floor let them this far: each schedule's tighter one, queued again
            base = config[0]
            for schedule, chunks, member, tight in group_floors(model, *config, job, software, rates):
                heapq.heappush(queue, (max(floor, tight), member, True, (base, schedule, chunks)))
            continue
        base, schedule, chunks = config
        config = replace(base, schedule=schedule, chunks=chunks)
        if config.recompute == "selective-attention" and replace(config, recompute="none") in fit:
            continue  # the same run keeping the attention core too fits, and skips the core's second run
        progress(result.considered, result.judged, ranked[0][0] if ranked else None)
        result.judged += 1
        if memory_floor(model, config, job, software) > capacity:
            too_large.append((config, None))  # over the GPU without reading its schedule
            continue
        memory = gpu_memory(model, config, job, software)
        if memory.total > capacity:
            too_large.append((config, memory))
            continue
        result.fitting += 1
        fit.add(config)
        prediction = _judged(model, config, job, software, cluster, memory)
        result.simulated += 1
        twin = next((i for i, (_, _, p) in enumerate(ranked) if _twins(p, prediction)), None)
        if twin is not None:  # the same run but for the sharding: keep the leaner
            if prediction.memory.total < ranked[twin][2].memory.total:
                ranked[twin] = (prediction.time.step, number, prediction)
                ranked.sort(key=lambda entry: entry[:2])
            continue
        # equal steps rank in the order the knobs enumerate them, not the order the floors judged them in
        ranked.append((prediction.time.step, number, prediction))
        ranked.sort(key=lambda entry: entry[:2])
        del ranked[top:]
    result.ranked = [prediction for _, _, prediction in ranked]
    if not ranked:
        result.smallest = _closest(model, too_large, job, software, cluster)
    if not ranked and result.smallest is None and leanest is not None:
        config = leanest[2]
        result.smallest = _judged(
            model, config, job, software, cluster, gpu_memory(model, config, job, software)
        )
    return result


def _closest(model, too_large: list, job: Job, software: Software, cluster: Cluster) -> Prediction | None:
    """Of the judged configurations that do not fit, in the order judged, the first with the least
    memory, predicted (only a search where nothing fits needs it)."""
    closest: tuple[Config, GpuMemory] | None = None
    for config, memory in too_large:
        memory = memory or gpu_memory(model, config, job, software)
        if closest is None or memory.total < closest[1].total:
            closest = (config, memory)
    return None if closest is None else _judged(model, closest[0], job, software, cluster, closest[1])


def group_floors(model, base: Config, members, job: Job, software: Software, rates: Rates) -> list:
    """For each member of a `config_groups` group, (its schedule, chunks, order number, a step time it
    cannot beat): its pipeline's floor, plus what data parallel adds for sure and the optimizer. What
    reads no schedule is computed once a group (the message, the optimizer) or once per chunk count (the
    stage costs, data parallel's share); a test holds each floor to `floor_of` the configuration."""
    transfer, optimizer = message_seconds(model, base, job, rates), optimizer_seconds(model, base, rates)
    per_chunks: dict[int, tuple] = {}
    floors = []
    pp, m = base.pp, base.microbatches
    for schedule, chunks, number in members:
        if chunks not in per_chunks:
            config = replace(base, schedule=schedule, chunks=chunks)
            costs = stage_costs(model, config, job, software, rates)
            per_chunks[chunks] = (
                costs,
                data_parallel_seconds(model, config, software, rates, costs, None, 1.0),
            )
        costs, data_parallel = per_chunks[chunks]
        tight = shape_floor(schedule, pp, chunks, m, costs, transfer) + data_parallel + optimizer
        floors.append((schedule, chunks, number, tight))
    return floors


def floor_of(model, config: Config, job: Job, software: Software, rates: Rates) -> float:
    """A step time ``config`` cannot beat (`group_floors`' rule, for one configuration on its own)."""
    costs = stage_costs(model, config, job, software, rates)
    floor = pipeline_floor(config, costs, message_seconds(model, config, job, rates))
    floor += data_parallel_seconds(model, config, software, rates, costs, None, 1.0)
    return floor + optimizer_seconds(model, config, rates)


def _twins(a: Prediction, b: Prediction) -> bool:
    """Two configurations that differ only in how data parallel shards the states (or in sequence
    parallel) and run equally fast: one row is enough."""
    same = replace(a.config, zero=b.config.zero, sequence_parallel=b.config.sequence_parallel) == b.config
    return same and abs(a.time.step - b.time.step) <= 1e-3 * b.time.step


def _judged(model, config, job, software, cluster, memory) -> Prediction:
    return rate(model, config, job, software, cluster, memory, step_time(model, config, job, software,
                                                                         cluster.kind))  # fmt: skip


def configurations(model: PaperModel, cluster: Cluster, job: Job, fixed: dict) -> Iterator[Config]:
    """Every configuration the knobs allow (the module's list), honouring ``fixed``; `SearchError` when
    none exists, saying which constraint leaves nothing."""
    check_fixed(model, cluster, job, fixed)
    layouts = list(_layouts(model, cluster, job, fixed))
    if not layouts:
        raise SearchError(_no_layout(model, cluster, job, fixed))
    found = False
    for tp, cp, pp, dp in layouts:
        local = job.global_batch // dp
        sizes = [fixed["microbatch-size"]] if "microbatch-size" in fixed else _divisors(local)
        for size, (schedule, chunks) in itertools.product(sizes, _schedules(model, pp, fixed)):
            if local % size:
                continue
            for recompute, zero, sp, ep in itertools.product(
                _choice(fixed, "recompute", RECOMPUTES),
                _choice(fixed, "zero", ZERO_STAGES if dp * cp > 1 else (0,)),
                _choice(fixed, "sp", (False, True) if tp > 1 else (False,)),
                experts.ep_choices(model, dp, fixed),
            ):
                found = True
                yield Config(tp, pp, dp, schedule, chunks, size, local // size, recompute, zero, sp, ep, cp,
                             fixed.get("ends", "ride"))  # fmt: skip
    if not found:
        raise SearchError(
            f"--fix microbatch-size={fixed.get('microbatch-size')} divides no replica's share of "
            f"--global-batch {job.global_batch}"
        )


def config_groups(
    model: PaperModel, cluster: Cluster, job: Job, fixed: dict
) -> Iterator[tuple[Config, list[tuple[str, int, int]]]]:
    """`configurations` grouped by all but the schedule and its chunks: (the group's first configuration,
    each member's schedule, chunks and place in `configurations`' order). The cheap floors read no
    schedule, so a search computes them once a group (a test holds them equal within each)."""
    check_fixed(model, cluster, job, fixed)
    layouts = list(_layouts(model, cluster, job, fixed))
    if not layouts:
        raise SearchError(_no_layout(model, cluster, job, fixed))
    number = 0
    for tp, cp, pp, dp in layouts:
        local = job.global_batch // dp
        sizes = [fixed["microbatch-size"]] if "microbatch-size" in fixed else _divisors(local)
        schedules = list(_schedules(model, pp, fixed))
        inner = list(itertools.product(
            _choice(fixed, "recompute", RECOMPUTES),
            _choice(fixed, "zero", ZERO_STAGES if dp * cp > 1 else (0,)),
            _choice(fixed, "sp", (False, True) if tp > 1 else (False,)),
            experts.ep_choices(model, dp, fixed),
        ))  # fmt: skip
        for size in sizes:
            if local % size:
                continue
            (schedule, chunks) = schedules[0] if schedules else ("", 0)
            for i, (recompute, zero, sp, ep) in enumerate(inner):
                members = [(name, v, number + j * len(inner) + i) for j, (name, v) in enumerate(schedules)]
                if members:
                    yield (
                        Config(
                            tp,
                            pp,
                            dp,
                            schedule,
                            chunks,
                            size,
                            local // size,
                            recompute,
                            zero,
                            sp,
                            ep,
                            cp,
                            fixed.get("ends", "ride"),
                        ),
                        members,
                    )
            number += len(schedules) * len(inner)
    if number == 0:
        raise SearchError(
            f"--fix microbatch-size={fixed.get('microbatch-size')} divides no replica's share of "
            f"--global-batch {job.global_batch}"
        )


def _layouts(model, cluster, job, fixed) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp): for each cp (`_cp_choices`), tp, pp and dp of the GPUs it leaves."""
    for cp in _cp_choices(model, cluster, job, fixed):
        for tp, pp, dp in _layouts_of(model, cluster.count // cp, cluster.kind.gpus_per_node, job, fixed):
            yield tp, cp, pp, dp


def _cp_choices(model, cluster, job, fixed) -> tuple[int, ...]:
    """The fixed cp; else 1, and for sequences of `CP_SEARCHED_FROM` tokens or more the powers of two up to
    `CP_SEARCHED_UP_TO` that divide the GPUs and split the sequence into 2 x cp chunks."""
    if "cp" in fixed:
        return (fixed["cp"],)
    if job.seq_len < CP_SEARCHED_FROM or model.kind == "mlp":
        return (1,)
    wanted = (2**k for k in range(CP_SEARCHED_UP_TO.bit_length()))
    return tuple(cp for cp in wanted if cp == 1 or (cluster.count % cp == 0 and job.seq_len % (2 * cp) == 0))


def _layouts_of(model, count: int, per_node: int, job, fixed) -> Iterator[tuple[int, int, int]]:
    for tp in _divisors(min(per_node, count)):
        if count % tp or (model.kind == "transformer" and model.heads % tp) or model.hidden % tp:
            continue
        for pp in _divisors(count // tp):
            dp = count // (tp * pp)
            wanted = {"tp": tp, "pp": pp, "dp": dp}
            if pp > model.layers or any(fixed.get(k, v) != v for k, v in wanted.items()):
                continue
            if job.global_batch % dp == 0 and dp % fixed.get("ep", 1) == 0:
                yield tp, pp, dp


def _schedules(model: PaperModel, pp: int, fixed: dict) -> Iterator[tuple[str, int]]:
    if pp == 1:
        if fixed.get("schedule") not in V_SCHEDULES:  # a V needs a pipeline to fold the model over
            yield fixed.get("schedule", ONE_STAGE_SCHEDULE), 1
        return
    for name in _choice(fixed, "schedule", tuple(SCHEDULES)):
        if name in V_SCHEDULES:
            options = (2,)
        elif name == "interleaved-1f1b":
            options = INTERLEAVE_CHUNKS
        else:
            options = (1,)
        for chunks in _choice(fixed, "chunks", options):
            # a free search tries the usual counts; a fixed one any count of two or more (5, 7 ...)
            allowed = chunks in options or (name == "interleaved-1f1b" and chunks >= 2)
            if pp * chunks <= most_virtual_stages(model, fixed.get("ends", "ride")) and allowed:
                yield name, chunks


def _choice(fixed: dict, knob: str, options: tuple) -> tuple:
    return (fixed[knob],) if knob in fixed else options


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def check_fixed(model: PaperModel, cluster: Cluster, job: Job, fixed: dict) -> None:
    """Refuse a --fix that cannot work, in one line naming the knob."""
    per_node = cluster.kind.gpus_per_node
    if fixed.get("tp", 1) > per_node:
        raise SearchError(
            f"--fix tp={fixed['tp']} is more than the {per_node} GPUs of one {cluster.kind.name} node: "
            "tensor parallel stays inside a node"
        )
    if fixed.get("pp", 1) > model.layers:
        raise SearchError(f"--fix pp={fixed['pp']} is more than the model's {model.layers} layers")
    product = 1
    for knob in DEGREES:
        product *= fixed.get(knob, 1)
    named = [k for k in DEGREES if k in fixed]
    if all(k in fixed for k in ("tp", "pp", "dp")) and product != cluster.count:
        raise SearchError(
            f"--fix {' x '.join(named)} = {' x '.join(str(fixed[k]) for k in named)} = {product}, not the "
            f"cluster's {cluster.count} GPUs"
        )
    if cluster.count % product:
        raise SearchError(f"--fix {'x'.join(named)} = {product} "
                          f"does not divide the cluster's {cluster.count} GPUs")  # fmt: skip
    if context_parallel.refusal(model, job, fixed):
        raise SearchError(context_parallel.refusal(model, job, fixed))
    if model.kind == "transformer" and model.heads % fixed.get("tp", 1):
        raise SearchError(f"--fix tp={fixed['tp']} does not divide the model's {model.heads} heads")
    if "dp" in fixed and job.global_batch % fixed["dp"]:
        raise SearchError(f"--fix dp={fixed['dp']} does not divide --global-batch {job.global_batch}")
    if experts.refusal(model, fixed):
        raise SearchError(experts.refusal(model, fixed))
    schedule, chunks = fixed.get("schedule"), fixed.get("chunks")
    if chunks is not None and chunks > 1 and schedule not in (None, "interleaved-1f1b", *V_SCHEDULES):
        raise SearchError(f"--fix chunks={chunks} needs an interleaved schedule, not {schedule}")
    if schedule in V_SCHEDULES and fixed.get("pp") == 1:
        raise SearchError(
            f"--fix schedule={schedule} folds the model over the pipeline's ranks: not with pp=1"
        )
    if chunks is not None and schedule in V_SCHEDULES and chunks != 2:
        raise SearchError(f"--fix schedule={schedule} is a V: two chunks per rank, not {chunks}")
    most = most_virtual_stages(model, fixed.get("ends", "ride"))
    if chunks is not None and "pp" in fixed and fixed["pp"] * chunks > most:
        slots = " and its two ends" if most > model.layers else ""
        raise SearchError(
            f"--fix pp={fixed['pp']} x chunks={chunks} is {fixed['pp'] * chunks} virtual stages, more "
            f"than the model's {model.layers} layers{slots}"
        )


def _no_layout(model, cluster, job, fixed) -> str:
    if any(k in fixed for k in ("tp", "pp", "dp", "ep", "cp")):
        return (
            f"no tp x cp x pp x dp of {cluster.count} GPUs matches --fix and divides --global-batch "
            f"{job.global_batch} by dp"
        )
    return (
        f"no dp x m divides --global-batch {job.global_batch}: on {cluster} (tp at most "
        f"{cluster.kind.gpus_per_node}, pp at most {model.layers} layers) no data-parallel degree divides "
        "it; use a multiple of a power of two"
    )
