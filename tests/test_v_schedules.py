"""V placement (ZB-V, DualPipeV) and schedules in torch's CSV format.

The V schedules: their makespans are the papers' formulas, they place the first and the last stage on
rank 0, their lists are the ones ``torch.distributed.pipelining`` builds, and every rank's peak of held
activations is reported against 1F1B's. The CSV format: pipeclock's own schedules round-trip, files that
torch's own schedule classes write (made without a process group) load and give the one-process
gradients, and a malformed file is one error naming its row and cell.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from pipeclock import schedule
from pipeclock.engine.actions import Action, placement_of
from pipeclock.engine.csv_schedule import ScheduleFileError, load_csv, save_csv
from pipeclock.engine.generators import SCHEDULES, chunks_of, dualpipev, generate, zb_v
from pipeclock.engine.placement import Placement
from pipeclock.models.mlp import ShardedMLP
from pipeclock.observe.simulate import simulate
from tests.distributed import run_ok

properties = settings(max_examples=60, deadline=None)


@properties
@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_zb_v_takes_6m_plus_p_minus_1_chunk_times_when_m_is_at_least_2p(p, m):
    m = max(m, 2 * p)
    assert simulate(zb_v(p, m)).makespan == 6 * m + p - 1


@properties
@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_dualpipev_takes_dualpipes_formula_with_overlapped_pairs_run_one_after_the_other(p, m):
    m = max(m, 2 * p)
    forward, backward, weight = 1, 2, 1
    f_and_b = forward + backward  # on a CPU the pair runs one after the other
    assert simulate(dualpipev(p, m)).makespan == 6 * m + (p - 1) * (f_and_b + backward - 3 * weight)


@properties
@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_peak_activations_per_rank_are_p_stages_for_zb_v_and_half_a_stage_more_for_dualpipev(p, m):
    """In stages held (a chunk's micro-batch counts 1/2): 1F1B's rank 0 holds min(m, p)."""
    for generator, bound in ((zb_v, p), (dualpipev, p + 0.5)):
        timeline = simulate(generator(p, m))
        assert max(timeline.peak_live(rank) for rank in range(p)) <= bound


def test_the_papers_figures_at_p4_m8():
    assert simulate(zb_v(4, 8)).makespan == 51
    assert simulate(dualpipev(4, 8)).makespan == 54


@properties
@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_a_v_puts_the_first_and_last_stage_on_rank_0_and_the_turn_on_the_last_rank(p, m):
    placement = placement_of(zb_v(p, m))
    assert placement.owner(0) == (0, 0) and placement.owner(2 * p - 1) == (0, 1)
    assert placement.owner(p - 1)[0] == placement.owner(p)[0] == p - 1


def test_dualpipev_mixes_whole_and_split_backwards_and_marks_its_overlapped_pairs():
    rows = dualpipev(4, 8)
    ops = {a.op for row in rows for a in row}
    assert {"B", "I", "W"} <= ops
    pairs = [(row[i], row[i + 1]) for row in rows for i in range(len(row) - 1) if row[i].overlap]
    assert pairs and all(f.op == "F" and b.op == "B" and f.chunk != b.chunk for f, b in pairs)


def _torch_rows(kind, p: int, m: int) -> list[list[str]]:
    """torch's own per-rank lists, without a process group, as pipeclock's action text."""
    built = _torch_schedule(kind, p, m)
    on_a_v = kind in (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)
    placement = Placement.v(p) if on_a_v else Placement.loop(p, 2)
    rows = []
    for rank in range(p):
        row = []
        for action in built.pipeline_order[rank]:
            for part in action.sub_actions or (action,) if action is not None else ():
                chunk = placement.owner(part.stage_index)[1]
                row.append(str(Action(part.computation_type.value, part.microbatch_index, chunk)))
        rows.append(row)
    return rows


def _torch_schedule(kind, p: int, m: int):
    """A torch schedule object whose per-rank lists are computed as torch does, with no stage objects."""
    built = object.__new__(kind)
    built.pp_group_size, built._n_microbatches, built.n_local_stages = p, m, 2
    built.num_stages = built._num_stages = 2 * p
    built.number_of_rounds = max(1, m // p)
    built.microbatches_per_round = m // built.number_of_rounds
    built.pipeline_order = {rank: built._calculate_single_rank_operations(rank) for rank in range(p)}
    if kind is torch_schedules.ScheduleInterleavedZeroBubble:
        built.pipeline_order = built._add_bubbles_to_actions(2 * p)
    return built


@pytest.mark.parametrize(
    "kind, mine",
    [(torch_schedules.ScheduleZBVZeroBubble, zb_v), (torch_schedules.ScheduleDualPipeV, dualpipev)],
)
@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (2, 5), (3, 6), (4, 8), (4, 11)])
def test_the_v_schedules_are_the_lists_torch_builds(kind, mine, p, m):
    assert _torch_rows(kind, p, m) == [[str(a) for a in row] for row in mine(p, m)]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (3, 7), (4, 8)])
def test_pipeclocks_schedules_saved_as_csv_read_back_as_the_same_lists(name, p, m, tmp_path):
    original = generate(name, p, m, chunks_of(name) or (2 if name == "interleaved-1f1b" else 1))
    loaded = load_csv(save_csv(original, tmp_path / f"{name}.csv"))
    assert [list(row) for row in loaded] == [list(row) for row in original]
    assert [[a.overlap for a in row] for row in loaded] == [[a.overlap for a in row] for row in original]
    assert placement_of(loaded) == placement_of(original)


TORCH_KINDS = {
    "interleaved-1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "looped-bfs": torch_schedules.ScheduleLoopedBFS,
    "interleaved-zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}


def _stage_stand_in(p: int, stage: int, rank: int) -> SimpleNamespace:
    """What torch's schedule classes read of a stage to build their lists: no module, no process group."""
    return SimpleNamespace(num_stages=2 * p, group_size=p, group_rank=rank, stage_index=stage)


def _torch_order(kind, p: int, m: int) -> dict[int, list]:
    if kind is torch_schedules.ScheduleLoopedBFS:  # built as torch builds it, from stand-in stages
        return kind([_stage_stand_in(p, 0, 0), _stage_stand_in(p, p, 0)], m).pipeline_order
    return _torch_schedule(kind, p, m).pipeline_order


def write_torch_csvs(directory, p: int, m: int, format: str = "compute_only") -> dict[str, str]:
    """Each torch schedule's CSV, written by torch's own writer; ``compute_comms`` lowered by torch's
    own lowering (``_PipelineScheduleRuntime``), with its sends, receives, unshards and reductions."""
    paths = {}
    for name, kind in TORCH_KINDS.items():
        path = directory / f"{name}_p{p}_m{m}_{format}.csv"
        runtime = torch_schedules._PipelineScheduleRuntime([_stage_stand_in(p, 0, 0)], m)
        runtime.pipeline_order = _torch_order(kind, p, m)
        runtime._prepare_schedule_with_comms(runtime.pipeline_order)
        runtime._dump_csv(str(path), format=format)
        paths[name] = str(path)
    return paths


def csv_gradient_gaps(rank: int, p: int, paths: dict[str, str]) -> dict[str, float]:
    generator = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(13, 8, generator=generator), torch.randn(13, 8, generator=generator)
    reference = ShardedMLP(8, 16, seed=5)
    F.mse_loss(reference(inputs), targets).backward()
    wanted = dict(reference.named_parameters())
    gaps = {}
    for name, path in paths.items():
        table = load_csv(path)
        chunks = ShardedMLP.for_rank(8, 16, rank, p, 2, seed=5, placement=placement_of(table))
        loss = schedule.Pipeline(chunks, table, None, F.mse_loss).step(inputs, targets)
        grads = [
            ((q.grad - wanted[n].grad).abs().max() / wanted[n].grad.abs().max()).item()
            for chunk in chunks
            for n, q in chunk.named_parameters()
        ]
        want = F.mse_loss(reference(inputs), targets).item()
        gaps[name] = max([abs(loss - want) / want, *grads])
    return gaps


@pytest.mark.parametrize("format", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6)])
def test_schedules_written_by_torchs_own_classes_run_and_give_the_one_process_gradients(
    p, m, format, tmp_path
):
    paths = write_torch_csvs(tmp_path, p, m, format)
    per_rank = run_ok(csv_gradient_gaps, p, paths)
    worst = {name: max(gaps[name] for gaps in per_rank) for name in paths}
    assert all(gap <= 1e-5 for gap in worst.values()), worst


def test_a_malformed_cell_names_its_row_and_cell(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0,1B0\n")
    with pytest.raises(ScheduleFileError, match=r"row 2 \(rank 1\), cell 2: '1Q0' is not an action"):
        load_csv(path)


@pytest.mark.parametrize(
    "rows, message",
    [
        (["0F0,0F0,0B0", "1F0,1B0"], "F0 appears 2 times"),
        (["0F0", "1F0,1B0"], "missing B0"),
        (["0F0,0B0,1F1", "1F0,1B0"], "stage 1 is computed by rank 0 and by rank 1"),
        (["0B0,0F0", "1F0,1B0"], "deadlocks"),
        (["0F0,0I0", "1F0,1B0"], "missing W0"),
    ],
)
def test_a_schedule_file_that_cannot_run_is_refused_before_any_process_waits(rows, message, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ScheduleFileError, match=message):
        load_csv(path)


def train_three_ways(rank: int, p: int, csv_path: str, directory: str) -> dict[str, list[float]]:
    """The main job with zb-v by name, with the same schedule from a CSV file, and a V run resumed as 1F1B."""
    from pipeclock.training.loop import TrainConfig, train

    small = dict(hidden=16, layers=8, batch_size=9, lr=1e-2)
    by_name = train(TrainConfig(schedule="zb-v", microbatches=4, steps=4, **small)).losses
    by_file = train(TrainConfig(schedule_csv=csv_path, steps=4, **small)).losses
    straight = train(TrainConfig(schedule="1f1b", microbatches=4, steps=4, **small)).losses
    saved = dict(checkpoint_dir=directory, **small)
    first = train(TrainConfig(schedule="zb-v", microbatches=4, steps=2, **saved)).losses
    then = train(TrainConfig(schedule="1f1b", microbatches=4, steps=4, resume=True, **saved)).losses
    return {"by_name": by_name, "by_file": by_file, "straight": straight, "v_then_loop": first + then}


def test_the_main_job_runs_a_csv_schedule_and_a_v_run_resumes_as_a_loop_run(tmp_path):
    csv_path = save_csv(generate("zb-v", 2, 4, 2), tmp_path / "zbv.csv")
    per_rank = run_ok(train_three_ways, 2, str(csv_path), str(tmp_path / "ckpt"), deadline=300)
    losses = per_rank[0]
    assert losses["by_file"] == losses["by_name"], "the file's schedule is the named one, bit for bit"
    assert losses["v_then_loop"] == pytest.approx(losses["straight"], rel=1e-5)
    assert losses["by_name"] == pytest.approx(losses["straight"], rel=1e-5), "a V changes no math"
