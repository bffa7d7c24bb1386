"""The step as a program: what a lowered schedule says each rank sends, receives and computes.

Every program of every schedule matches each send with one receive between the right ranks, finishes
when simulated, and keeps each rank's compute actions in the schedule's order (an evaluation's, the
forwards alone, in (micro-batch, stage) order); with free messages each compute starts as soon as its
rank is free and its inputs are computed. Saved in torch's ``compute_comms``
format it reads back as the same program, and torch's own checker (``_simulate_comms_compute``) finds
no deadlock in it. A file whose messages do not match, or that would wait for ever, is refused naming
the rank and the cell.
"""

from __future__ import annotations

import csv
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from pipeclock.engine import program
from pipeclock.engine.actions import Action, Schedule, dependencies, forward_only, placement_of
from pipeclock.engine.csv_schedule import ScheduleFileError, load_csv, save_csv
from pipeclock.engine.generators import SCHEDULES, chunks_of, generate
from pipeclock.engine.program_run import simulate_program
from pipeclock.observe.simulate import simulate

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def chunks_for(name: str) -> int:
    return chunks_of(name) or (2 if name == "interleaved-1f1b" else 1)


def compute_cost(_rank: int, instruction: program.Instruction) -> float:
    return COSTS[instruction.kind]


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 8),
    m=st.integers(1, 16),
    replicas=st.booleans(),
)
def test_every_program_matches_each_send_with_one_receive_and_finishes(name, p, m, replicas):
    table = generate(name, p, m, chunks_for(name))
    programs = program.lower(table, replicas=replicas, ties=True)
    program.check(programs)
    simulate_program(programs, compute_cost, latency=0.5)
    for rank, rank_program in enumerate(programs):
        assert [i.action for i in rank_program if i.is_compute] == list(table[rank])
        assert (rank_program[0].kind, rank_program[-1].kind) == ("SIZES", "LOSS")
        before_agree = rank_program[: [i.kind for i in rank_program].index("AGREE")]
        assert not [i for i in before_agree if i.kind in program.MESSAGES], "a bad batch stops all messages"
        if replicas:  # a replica may be in a collective: nothing computes before the batch is agreed
            assert [i.kind for i in before_agree] == ["SIZES"]
        reduced = [i.stage for i in rank_program if i.kind == "REDUCE_GRAD"]
        assert sorted(reduced) == (sorted(placement_of(table).stages[rank]) if replicas else [])


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 8),
    m=st.integers(1, 16),
    replicas=st.booleans(),
)
def test_every_evaluation_program_runs_each_micro_batch_through_the_stages_in_order_and_finishes(
    name, p, m, replicas
):
    """DualPipeV's F&B marks, kept on the forwards alone, once paired two forwards of a V and hung."""
    table = generate(name, p, m, chunks_for(name))
    placement = placement_of(table)
    programs = program.lower(forward_only(table), replicas=replicas)
    program.check(programs)
    simulate_program(programs, compute_cost, latency=0.5)
    for rank, rank_program in enumerate(programs):
        computes = [i.action for i in rank_program if i.is_compute]
        order = [(a.microbatch, placement.stage(rank, a.chunk)) for a in computes]
        assert order == sorted((mb, stage) for mb in range(m) for stage in placement.stages[rank])
        assert {a.op for a in computes} == {"F"} and not any(a.overlap for a in computes)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 3), (2, 4), (3, 5), (4, 8)])
def test_with_free_messages_each_compute_starts_once_its_rank_is_free_and_its_inputs_exist(name, p, m):
    table = generate(name, p, m, chunks_for(name))
    timeline = simulate(table, COSTS)
    placement = placement_of(table)
    ended = {(span.rank, span.action): span.end for span in timeline.spans}
    for rank, actions in enumerate(table):  # an I gives the input's gradient, as a B does
        ended.update(
            {(rank, Action("B", a.microbatch, a.chunk)): ended[(rank, a)] for a in actions if a.op == "I"}
        )
    sent = dict(ended)  # another rank's data leaves when its group ends: a pair sends after both halves
    for rank, actions in enumerate(table):
        for first, second in itertools.pairwise(actions):
            if first.overlap:
                sent[(rank, first)] = ended[(rank, second)]
    for rank in range(p):
        free = 0.0
        for span in timeline.spans_of(rank):
            needs = dependencies(span.action, rank, placement)
            inputs = [(ended if r == rank else sent)[(r, a)] for r, a in needs]
            assert span.start == max([free, *inputs]), (rank, span)
            free = span.end
    assert timeline.makespan == simulate_program(program.lower(table), compute_cost).makespan


def test_a_receive_is_posted_just_before_the_compute_that_uses_it_and_stage_0_agrees_after_its_f0():
    table = generate("1f1b", 2, 3)
    assert program.describe(program.lower(table)).splitlines() == [
        "rank 0: SIZES 0F0 AGREE 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2 "
        "LOSS",
        "rank 1: SIZES AGREE 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 "
        "LOSS",
    ]


def test_stages_on_one_rank_hand_over_in_memory_without_messages():
    table = generate("zb-v", 2, 2, 2)  # stages 1 and 2 both live on rank 1
    kinds = [str(i) for i in program.lower(table)[1]]
    assert "1SEND_F0" not in kinds and "2RECV_F0" not in kinds
    assert "1RECV_F0" in kinds and "2SEND_F0" in kinds


def test_messages_cost_latency_and_bytes_over_bandwidth():
    programs = program.lower(generate("gpipe", 2, 1))
    free = simulate_program(programs, compute_cost)
    paid = simulate_program(
        programs, compute_cost, latency=0.25, bandwidth=100.0, message_bytes=lambda _: 50.0
    )
    assert paid.makespan == free.makespan + 2 * (0.25 + 0.5)  # one activation, one gradient


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_program_saved_as_compute_comms_reads_back_the_same(name, tmp_path):
    table = generate(name, 3, 5, chunks_for(name))
    loaded = load_csv(save_csv(table, tmp_path / "p.csv", format="compute_comms"))
    assert [list(row) for row in loaded] == [list(row) for row in table]
    assert loaded.programs == program.lower(table, ties=True)


def torch_order(path) -> dict[int, list]:
    """A compute_comms file as torch reads it, an overlapped pair as its two actions (torch's checker
    does not take pairs)."""
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    order = {}
    for rank, row in enumerate(rows):
        actions = [torch_schedules._Action.from_str(cell) for cell in row]
        order[rank] = [part for action in actions for part in (action.sub_actions or (action,))]
    return order


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 2), (2, 3), (2, 8), (3, 5), (4, 4), (4, 9)])
def test_torchs_own_checker_finds_no_deadlock_in_pipeclocks_programs(name, p, m, tmp_path):
    table = generate(name, p, m, chunks_for(name))
    placement = placement_of(table)
    table = Schedule(table, placement)
    table.programs = program.lower(table)
    order = torch_order(save_csv(table, tmp_path / "p.csv", format="compute_comms"))
    simulated = torch_schedules._simulate_comms_compute(
        order, lambda stage: placement.owner(stage)[0], placement.num_virtual
    )
    for rank, actions in simulated.items():
        ran = [str(a) for a in actions if a is not None and a.is_compute_op]
        assert ran == [str(a) for a in order[rank] if a.is_compute_op]


@pytest.mark.parametrize(
    "rows, message",
    [
        (["0F0,0SEND_F0,0B0", "1F0,1B0"], r"rank 0: 0SEND_F0 has no matching receive on rank 1"),
        (["0F0,0SEND_F0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"], r"rank 1: 1SEND_B0 has no matching receive"),
        (
            ["0F0,0SEND_F0,0RECV_B0,0B0", "1F0,1RECV_F0,1B0,1SEND_B0"],
            r"(?s)deadlocks.*rank 1: stuck at F0 \(action 0\), waiting for F0 on rank 0",
        ),
        (
            ["0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0,1SEND_F0"],
            r"cell 5: 1SEND_F0 has no stage 2 at its other end",
        ),
        (["0F0,0SEND_F,0B0", "1F0,1B0"], r"row 1 \(rank 0\), cell 2: 0SEND_F needs a micro-batch"),
    ],
)
def test_a_program_file_that_cannot_run_is_refused_naming_the_rank_and_cell(rows, message, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ScheduleFileError, match=message):
        load_csv(path)
