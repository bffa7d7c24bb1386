"""``pipeclock schedule``: simulate a schedule without any process and show its timeline and bubble.

python -m pipeclock schedule 1f1b --stages 4 --microbatches 8 --png 1f1b.png
python -m pipeclock schedule --compare --stages 4 --microbatches 8 --png compare.png
python -m pipeclock schedule --schedule-csv zbv.csv             # a schedule written by another engine
python -m pipeclock schedule zb-v -p 4 -m 8 --save-csv zbv.csv   # and the other way
python -m pipeclock schedule 1f1b -p 2 -m 3 --program               # what each rank sends and receives
python -m pipeclock schedule dualpipev -p 2 -m 4 --program --dp 2 --ep 2 --all-to-all 0.5   # and experts
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from pipeclock.cli.arguments import check_output, non_negative_float, positive_int
from pipeclock.engine import program
from pipeclock.engine.actions import Schedule, join_first_stage_backwards, num_chunks, placement_of
from pipeclock.engine.csv_schedule import FORMATS, load_csv, save_csv
from pipeclock.engine.generators import (
    SCHEDULES,
    bubble_formula,
    bubble_formula_text,
    chunks_of,
    generate,
    get_schedule,
    supports_chunks,
)
from pipeclock.engine.limits import MAX_MICROBATCHES, MAX_STAGES
from pipeclock.observe.diagrams import ascii_diagram, draw_comparison_png, draw_png
from pipeclock.observe.exchange import WORDS as EXCHANGE_WORDS
from pipeclock.observe.exchange import all_to_all_word, ep_peers, exchange_time
from pipeclock.observe.simulate import DeadlockError, simulate
from pipeclock.observe.timeline import Timeline

DEFAULT_CHUNKS = 2
# The most forwards (stages x micro-batches x chunks) one command simulates and draws: the work grows in
# proportion, and a larger step shows no pattern a smaller one does not.
MAX_FORWARDS = 50_000


class UsageError(ValueError):
    """A bad command line, reported as one line and exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help=f"the schedule: {', '.join(SCHEDULES)}")
    parser.add_argument("--compare", action="store_true", help="simulate every schedule, side by side")
    parser.add_argument(
        "--stages", "-p", metavar="P", type=positive_int,
        help="pipeline stages, one per rank (required, unless --schedule-csv gives them)",
    )  # fmt: skip
    parser.add_argument(
        "--microbatches", "-m", metavar="M", type=positive_int,
        help="micro-batches per step (required, unless --schedule-csv gives them)",
    )  # fmt: skip
    parser.add_argument(
        "--chunks",
        "-v",
        metavar="V",
        type=positive_int,
        help=f"model chunks per rank, for interleaved schedules (default {DEFAULT_CHUNKS} for those, else 1)",
    )
    parser.add_argument(
        "--costs",
        metavar="F,I,W",
        help="time of a stage's forward, input-gradient backward and weight-gradient backward "
        "(default 1,1,1); a whole backward B costs I+W",
    )
    parser.add_argument(
        "--schedule-csv", metavar="FILE",
        help="simulate the schedule in FILE (torch.distributed.pipelining's compute_only CSV) instead of a "
        "named one; its ranks, micro-batches and placement come from the file",
    )  # fmt: skip
    parser.add_argument("--save-csv", metavar="FILE", help="also write the schedule in that CSV format")
    parser.add_argument(
        "--format", choices=FORMATS, default="compute_only",
        help="--save-csv's format: the compute actions (default), or the program with its messages",
    )  # fmt: skip
    parser.add_argument(
        "--program", action="store_true",
        help="print each rank's program: its compute and the messages it sends and receives",
    )  # fmt: skip
    parser.add_argument(
        "--dp", type=positive_int, default=1, metavar="N",
        help="with --program: N replicas of the pipeline (train --dp N); every rank's program, each "
        "message with its peer rank",
    )  # fmt: skip
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N",
        help="with --program: N tensor-parallel ranks per stage (train --tp N), innermost in the mesh",
    )  # fmt: skip
    parser.add_argument(
        "--ep", type=positive_int, default=1, metavar="N",
        help="with --program and --dp: each stage's experts over N of the dp replicas (train --ep N); the "
        "all-to-alls each compute runs with its expert group",
    )  # fmt: skip
    parser.add_argument(
        "--all-to-all", dest="all_to_all", metavar="X", type=non_negative_float, default=0.0,
        help="expert parallel's all-to-alls inside each stage's forward, and again in its backward, in "
        "stage forwards (default 0): charged, and hidden in dualpipev's overlapped pairs",
    )  # fmt: skip
    parser.add_argument(
        "--link-latency", dest="latency", metavar="L", type=non_negative_float, default=0.0,
        help="time a message between ranks takes once both sides are posted, in stage forwards (default 0); "
        "with a model's message sizes, plan and train --png also take --link-bandwidth",
    )  # fmt: skip
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline into this PNG file")


def run(args: argparse.Namespace) -> int:
    try:
        for option, path in (("--png", args.png), ("--save-csv", args.save_csv)):
            if path:
                check_output(path, option)
        if (args.dp > 1 or args.tp > 1 or args.ep > 1) and (args.compare or not args.program):
            raise UsageError("--dp, --tp and --ep lay out the printed program on a mesh: give --program")
        if args.dp % args.ep:
            raise UsageError(
                f"--ep {args.ep} is carved from the data-parallel replicas: give --dp a multiple of "
                f"{args.ep}, not {args.dp}"
            )
        return _compare(args) if args.compare else _show_one(args)
    except BrokenPipeError:
        raise  # a closed output: the command line ends quietly
    except (ValueError, OSError, DeadlockError) as error:
        lines = str(error).splitlines() or [type(error).__name__]
        # a deadlock's detail (where each rank is stuck, waiting for what) is the answer: all of it
        deadlock = DeadlockError in (type(error), type(error.__context__))  # a CSV's comes wrapped
        shown = lines if deadlock else lines[:1]
        print("pipeclock schedule: error: " + "\n".join(shown), file=sys.stderr)
        return 2


def _show_one(args: argparse.Namespace) -> int:
    name, schedule = _chosen(args)
    p, m, chunks = len(schedule), _microbatches(schedule), num_chunks(schedule)
    timeline = _simulate(schedule, _costs(args.costs), args.latency, args.all_to_all)
    print(_header(name, p, m, chunks, placement_of(schedule).name))
    print(ascii_diagram(timeline))
    print()
    print(_summary(name, p, m, chunks, timeline))
    if args.all_to_all:
        print(_all_to_all_line(schedule, _costs(args.costs), args.all_to_all))
    joined = _joined_backwards(schedule)
    if joined:
        print(
            f"as run            stage 0's I, W pairs run as one B ({joined} of {m} micro-batches): "
            "nothing waits for its input gradient"
        )
    if args.program:
        print()
        print(_program_text(schedule, args.dp, args.tp, args.ep))
    if args.save_csv:
        Path(args.save_csv).parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {save_csv(schedule, args.save_csv, args.format)}")
    if args.png:
        print(f"drew {draw_png(timeline, args.png, title=name)}")
    return 0


def _chosen(args: argparse.Namespace) -> tuple[str, Schedule]:
    """The schedule asked for: a named one (with --stages and --microbatches) or a CSV file's."""
    if args.schedule_csv:
        if args.name:
            raise UsageError("name a schedule or give --schedule-csv, not both")
        schedule = load_csv(args.schedule_csv)
        _check_size(len(schedule), _microbatches(schedule), num_chunks(schedule))
        checks = [("--stages", args.stages, len(schedule))]
        checks.append(("--microbatches", args.microbatches, _microbatches(schedule)))
        for option, given, found in checks:
            if given is not None and given != found:
                raise UsageError(f"{args.schedule_csv} has {found} for {option}, not {given}")
        return args.schedule_csv, schedule
    if not args.name:
        raise UsageError(
            "name a schedule (one of " + ", ".join(SCHEDULES) + "), give --schedule-csv, or pass --compare"
        )
    p, m = _required(args.stages, "--stages"), _required(args.microbatches, "--microbatches")
    chunks = _chunks_for(args.name, args.chunks)
    _check_size(p, m, chunks)
    return args.name, generate(args.name, p, m, chunks)


def _program_text(schedule: Schedule, dp: int = 1, tp: int = 1, ep: int = 1) -> str:
    """Each rank's program as the engine runs it, then the words it uses. On a (dp, pp, tp) mesh, every
    rank's: each (replica, tp rank) runs the pipeline's programs over its own ranks."""
    programs = getattr(schedule, "programs", None) or program.lower(
        join_first_stage_backwards(schedule), replicas=dp > 1, ties=True
    )
    if dp > 1 and getattr(schedule, "programs", None):
        programs = [program.add_reduce_grad(p) for p in programs]
    used = {instruction.kind for rank in programs for instruction in rank}
    words = [f"  {kind:<12}{program.WORDS[kind]}" for kind in program.KINDS if kind in used]
    if dp == tp == 1:
        return "\n".join(["program (one line per rank, in order):", program.describe(programs), "", *words])
    from pipeclock.parallel.mesh import mesh_layout, pipelines  # torch's: only a mesh's program needs it

    world = len(programs) * dp * tp
    on_mesh: dict[int, program.Program] = {}
    for ranks in pipelines(world, dp, tp):
        on_mesh.update(zip(ranks, program.on_ranks(programs, ranks), strict=True))
    layout = mesh_layout(world, dp, tp)
    coordinates = _coordinates(layout)
    names = [f"rank {r} (dp {d}, pp {s}, tp {t})" for r, (d, s, t) in enumerate(coordinates)]
    described = program.describe([on_mesh[r] for r in range(world)], names=names)
    if ep > 1:
        described = _with_all_to_alls(
            [on_mesh[r] for r in range(world)], names, ep_peers(coordinates, layout, ep)
        )
        words += [f"  {kind:<12}{text}" for kind, text in EXCHANGE_WORDS.items()]
    experts = f", experts over ep {ep} of the replicas" if ep > 1 else ""
    lines = [
        f"program on a mesh of dp {dp} x pp {len(programs)} x tp {tp} = {world} ranks{experts} (one line per "
        "rank, in order; a message names its peer: -> to, <- from):",
        described,
        "",
        *words,
    ]
    if tp > 1:
        inside = "each F, B and I runs its stage's tensor-parallel collectives over its tp group"
        lines.append(f"  {'(inside)':<12}{inside}")
    return "\n".join(lines)


def _with_all_to_alls(programs, names: list[str], peers: list[list[int]]) -> str:
    """Each rank's program with peers named (``program.describe``), each compute followed by the
    all-to-alls it runs inside with its expert group."""
    lines = []
    for rank, instructions in enumerate(programs):
        words = []
        for instruction in instructions:
            words.append(program.with_peer(instruction))
            exchanged = all_to_all_word(instruction, peers[rank])
            if exchanged:
                words.append(exchanged)
        lines.append(f"{names[rank]}: " + " ".join(words))
    return "\n".join(lines)


def _coordinates(layout) -> list[tuple[int, int, int]]:
    """Each global rank's (dp, pp, tp) place in ``layout`` (``mesh_layout``), rank by rank."""
    found = {int(layout[d, s, t]): (d, s, t) for d, s, t in itertools.product(*map(range, layout.shape))}
    return [found[r] for r in range(len(found))]


def _joined_backwards(schedule: Schedule) -> int:
    """How many first-stage I, W pairs the engine runs as one B (``join_first_stage_backwards``)."""
    split = sum(a.op == "I" for row in schedule for a in row)
    return split - sum(a.op == "I" for row in join_first_stage_backwards(schedule) for a in row)


def _microbatches(schedule: Schedule) -> int:
    return 1 + max(a.microbatch for row in schedule for a in row)


def _compare(args: argparse.Namespace) -> int:
    if args.name:
        raise UsageError("--compare simulates every schedule; do not name one")
    p, m = _required(args.stages, "--stages"), _required(args.microbatches, "--microbatches")
    chunks = args.chunks if args.chunks is not None else DEFAULT_CHUNKS
    _check_size(p, m, max(chunks, *(chunks_of(name) or 1 for name in SCHEDULES)))
    costs, latency = _costs(args.costs), args.latency
    timelines = {}
    for name in SCHEDULES:
        name_chunks = chunks_of(name) or (chunks if supports_chunks(get_schedule(name)) else 1)
        label = f"{name} (v={name_chunks})" if supports_chunks(get_schedule(name)) else name
        schedule = generate(name, p, m, name_chunks)
        timelines[label] = (name, name_chunks, _simulate(schedule, costs, latency, args.all_to_all))
    print(f"every schedule, p={p} stages, m={m} micro-batches; times in stage forwards")
    print(_comparison_table(p, m, timelines))
    if args.png:
        drawn = draw_comparison_png({label: entry[2] for label, entry in timelines.items()}, args.png)
        print(f"drew {drawn}")
    return 0


def _simulate(
    schedule: Schedule, costs: tuple[float, float, float], latency: float, all_to_all: float = 0.0
) -> Timeline:
    """Simulate with per-stage ``costs`` (F, I, W; B = I + W) and ``all_to_all`` inside each F and each B
    or I; a chunk does 1/chunks of a stage's work."""
    per_op = _per_op(schedule, costs)
    exchange = _exchange(schedule, all_to_all) if all_to_all else None
    return simulate(schedule, per_op, comm_latency=latency, exchange=exchange)


def _per_op(schedule: Schedule, costs: tuple[float, float, float]) -> dict[str, float]:
    forward, backward, weight = (cost / num_chunks(schedule) for cost in costs)
    return {"F": forward, "B": backward + weight, "I": backward, "W": weight}


def _exchange(schedule: Schedule, all_to_all: float):
    share = all_to_all / num_chunks(schedule)
    return lambda _rank, action: share if action.op in ("F", "B", "I") else 0.0


def _all_to_all_line(schedule: Schedule, costs: tuple[float, float, float], all_to_all: float) -> str:
    """How much of the step's all-to-all time the schedule hides under another micro-batch's compute."""
    per_op = _per_op(schedule, costs)
    time = exchange_time(
        join_first_stage_backwards(schedule), lambda _r, a: per_op[a.op], _exchange(schedule, all_to_all)
    )
    return (
        f"all-to-all        {_number(time.total)} in all ranks' actions, {time.hidden:.1%} of it hidden "
        "under another micro-batch's compute (overlapped F, B pairs)"
    )


def _header(name: str, p: int, m: int, chunks: int, placement: str = "loop") -> str:
    shape = f"{name}: p={p} stages, m={m} micro-batches"
    if chunks == 1:
        return f"{shape}; times in stage forwards\n"
    where = f", {placement} placement" if placement != "loop" else ""
    return (
        f"{shape}, {chunks} chunks per rank{where}; times in stage forwards "
        f"(a chunk does 1/{chunks} of a stage)\n"
    )


def _summary(name: str, p: int, m: int, chunks: int, timeline: Timeline) -> str:
    peaks = " ".join(_number(timeline.peak_live(rank)) for rank in range(p))
    formula = "no formula (a schedule from a file)"
    if name in SCHEDULES:
        formula = f"formula {bubble_formula_text(name)} = {bubble_formula(name, p, m, chunks):.1%}"
    return "\n".join(
        [
            f"makespan          {_number(timeline.makespan)}",
            f"bubble            {timeline.bubble_share:.1%} of the step (simulated); {formula}",
            f"bubble vs ideal   {timeline.bubble_vs_ideal:.1%} longer than the busiest rank's compute",
            f"peak activations  {peaks} (stages held, rank 0 first)",
        ]
    )


def _comparison_table(p: int, m: int, timelines: dict[str, tuple[str, int, Timeline]]) -> str:
    header = ("schedule", "makespan", "bubble", "formula", "vs ideal", "peak", "peak per rank")
    rows = [header]
    for label, (name, chunks, timeline) in timelines.items():
        peaks = [timeline.peak_live(rank) for rank in range(p)]
        formula = bubble_formula(name, p, m, chunks)
        rows.append(
            (
                label,
                _number(timeline.makespan),
                f"{timeline.bubble_share:.1%}",
                f"{formula:.1%} {bubble_formula_text(name)}",
                f"{timeline.bubble_vs_ideal:.1%}",
                _number(max(peaks)),
                " ".join(_number(peak) for peak in peaks),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _number(value: float) -> str:
    return f"{value:.4g}" if value != int(value) else str(int(value))


def _required(value: int | None, option: str) -> int:
    if value is None:
        raise UsageError(f"{option} is required")
    return value


def _check_size(p: int, m: int, chunks: int) -> None:
    """Refuse, before any work, a step larger than the engine runs or than is worth simulating."""
    if p * chunks > MAX_STAGES:
        shown = f"--stages {p}" + (f" x {chunks} chunks" if chunks > 1 else "")
        raise UsageError(f"{shown}: the engine runs at most {MAX_STAGES} virtual stages")
    if m > MAX_MICROBATCHES - 1:
        raise UsageError(f"--microbatches {m}: the engine runs at most {MAX_MICROBATCHES - 1} per step")
    if p * m * chunks > MAX_FORWARDS:
        raise UsageError(
            f"--stages {p} x --microbatches {m} x {chunks} chunk(s) is {p * m * chunks} forwards per step: "
            f"schedule simulates at most {MAX_FORWARDS} (fewer micro-batches show the same pattern)"
        )


def _chunks_for(name: str, chunks: int | None) -> int:
    if chunks is not None:
        return chunks
    return chunks_of(name) or (DEFAULT_CHUNKS if supports_chunks(get_schedule(name)) else 1)


def _costs(text: str | None) -> tuple[float, float, float]:
    if text is None:
        return (1.0, 1.0, 1.0)
    parts = text.split(",")
    try:
        costs = tuple(float(part) for part in parts)
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) < 0 or costs[0] + costs[1] + costs[2] <= 0:
        raise UsageError(f"--costs must be three numbers >= 0 like 1,1,1 (F,I,W), got {text!r}")
    return costs  # type: ignore[return-value]
