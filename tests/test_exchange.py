"""Expert parallel's all-to-alls in the simulator: a lone action pays them, DualPipeV's overlapped pairs
hide one micro-batch's under the other's compute, and ``schedule --program --ep`` shows them."""

from __future__ import annotations

import sys

import pytest

from pipeclock.cli.dispatch import main
from pipeclock.engine.generators import generate
from pipeclock.engine.program import lower
from pipeclock.observe.exchange import charged, exchange_time, paired
from pipeclock.observe.simulate import simulate

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def per_op(costs: dict[str, float]):
    return lambda _rank, action: costs[action.op]


def all_to_all(seconds: float):
    return lambda _rank, action: seconds if action.op in ("F", "B", "I") else 0.0


def test_without_pairs_each_action_pays_its_all_to_all_on_top_of_its_compute():
    schedule = generate("1f1b", 4, 8)
    charged_run = simulate(schedule, COSTS, exchange=all_to_all(0.5))
    dearer = simulate(schedule, {"F": 1.5, "B": 2.5, "I": 1.5, "W": 1.0})
    assert charged_run.makespan == pytest.approx(dearer.makespan)
    assert exchange_time(schedule, per_op(COSTS), all_to_all(0.5)).hidden == 0.0


def test_a_pair_takes_the_longer_of_its_two_computes_and_its_two_all_to_alls():
    programs = lower(generate("dualpipev", 2, 4, 2))
    rank, program = 0, lower(generate("dualpipev", 2, 4, 2))[0]
    forward_at, backward_at = next(iter(paired(program).items()))
    forward, backward = program[forward_at].action, program[backward_at].action
    for exchange, left in ((0.5, 0.0), (2.0, 4.0 - 3.0)):  # hidden whole; 1 of 4 left past the computes
        seconds, _ = charged(programs, per_op(COSTS), all_to_all(exchange))
        assert seconds(rank, forward) == 1.0 and seconds(rank, backward) == 2.0 + left


def test_dualpipev_hides_part_of_a_deepseek_like_all_to_all_and_1f1b_none():
    pytest.importorskip("transformers")
    from benchmarks.exchange_overlap import deepseek_costs, overlap

    one = overlap("1f1b", 1, deepseek_costs(1), m=32)  # 39 % hidden at m = 32, 84 % at the run's 120
    two = overlap("dualpipev", 2, deepseek_costs(2), m=32)
    assert one.hidden == 0.0 and one.makespan > one.without
    assert two.hidden > 0.3 and two.all_to_all == pytest.approx(one.all_to_all, rel=1e-9)
    assert two.makespan / two.without < one.makespan / one.without  # it costs dualpipev less


def run(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["pipeclock", "schedule"])
    code = main(["schedule", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_program_with_ep_names_each_computes_all_to_all_and_its_expert_group(monkeypatch, capsys):
    code, out, err = run(
        monkeypatch, capsys, "1f1b", "-p", "2", "-m", "2", "--program", "--dp", "4", "--ep", "2"
    )
    assert (code, err) == (0, "")
    assert "experts over ep 2 of the replicas" in out
    # rank 0 is replica 0's first stage: its expert group is replica 1's first stage, rank 2
    assert "rank 0 (dp 0, pp 0, tp 0): SIZES AGREE 0F0 0A2A_F0<->2 0SEND_F0->1" in out
    assert "rank 5 (dp 2, pp 1, tp 0): SIZES AGREE 1RECV_F0<-4 1F0 1A2A_F0<->7 1B0 1A2A_B0<->7" in out
    assert "A2A_B       the backward's all-to-alls with the ep group" in out


def test_the_simulated_step_says_how_much_all_to_all_it_hid(monkeypatch, capsys):
    _, one, _ = run(monkeypatch, capsys, "1f1b", "-p", "4", "-m", "8", "--all-to-all", "0.5")
    _, two, _ = run(monkeypatch, capsys, "dualpipev", "-p", "4", "-m", "8", "--all-to-all", "0.5")
    assert "all-to-all        32 in all ranks' actions, 0.0% of it hidden" in one
    assert "all-to-all        32 in all ranks' actions, " in two and "0.0% of it hidden" not in two


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["1f1b", "-p", "2", "-m", "2", "--program", "--dp", "3", "--ep", "2"],
         "--ep 2 is carved from the data-parallel replicas: give --dp a multiple of 2, not 3"),
        (["1f1b", "-p", "2", "-m", "2", "--dp", "2", "--ep", "2"],
         "--dp, --tp and --ep lay out the printed program on a mesh: give --program"),
    ],
)  # fmt: skip
def test_an_ep_the_mesh_cannot_take_is_one_line_and_exit_code_2(monkeypatch, capsys, args, message):
    code, out, err = run(monkeypatch, capsys, *args)
    assert (code, out) == (2, "") and err == f"pipeclock schedule: error: {message}\n"


def test_compare_charges_the_all_to_all_as_each_schedule_alone_does(monkeypatch, capsys):
    _, alone, _ = run(monkeypatch, capsys, "1f1b", "-p", "4", "-m", "8", "--all-to-all", "0.5")
    _, every, _ = run(monkeypatch, capsys, "--compare", "-p", "4", "-m", "8", "--all-to-all", "0.5")
    makespan = next(line.split()[1] for line in alone.splitlines() if line.startswith("makespan"))
    row = next(line for line in every.splitlines() if line.startswith("1f1b "))
    assert row.split()[1] == makespan == "44"  # 33 without: each F and each B pays 0.5 more
