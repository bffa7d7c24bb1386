"""Checkpoints: a resumed run is the uninterrupted run, whatever the stages, a dead rank, a killed save or
a damaged checkpoint; what a resume takes from the checkpoint and what from the flags; --keep-last.

Every run is real: the train command (``pipeclock train ...``) or the training loop on gloo processes
from ``tests.distributed``, as torchrun would start them (torchrun's own part, its restarts, is tested in
tests/test_data_parallel_runs.py and tests/test_faults.py). Starting processes costs time, so the runs
are made once, in two waves of concurrent launches (``runs``), and the tests below compare what they
left: their losses (JSON, exact floats), their logs and their checkpoints. The reference run's processes
go on to resume damaged copies of its own checkpoints (``_resumes``), so those cases cost no launch of
their own; the damage that export must name is done to copies in the test process.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from pipeclock import cli, comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.model import ShardedMLP
from pipeclock.training.loop import TrainConfig, train
from tests.checkpoint_damage import damages, flip_a_byte, truncate
from tests.distributed import Started, command, printed, run_ok, run_ranks, start_ranks
from tests.jobs import LAUNCH_TIMEOUT, losses_of

MODEL = {"hidden": 32, "layers": 8, "batch_size": 16, "microbatches": 4}
STEPS = 20


def _flags(**options) -> list[str]:
    flags = []
    for name, value in {**MODEL, **options}.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


# --- the reference run (gloo processes: its trained stages are chained to check export) ------------------


def _train_then_chain_the_stages(rank: int, world: int, directory: str, probe: torch.Tensor) -> dict:
    """The uninterrupted run; then the probe through its stages, rank to rank, and through its export."""
    config = TrainConfig(**MODEL, steps=STEPS, checkpoint_dir=directory, checkpoint_every=5)
    result = train(config)
    (stage,) = result.modules
    with torch.no_grad():
        x = probe if rank == 0 else comms.recv_tensor(None, rank - 1)
        y = stage(x)
    if rank + 1 < world:
        comms.send_tensor(y, rank + 1)
    outcome = {"losses": result.losses, "refusals": _refusals(config), "resumes": _resumes(config, rank)}
    if rank + 1 == world:
        outcome |= _export_and_run(config, probe, y)
    return outcome


def _export_and_run(config: TrainConfig, probe: torch.Tensor, chained: torch.Tensor) -> dict:
    """The export command, and the probe through the one-process model it loads into.

    Run here, in a process like the stages': the matmul kernels torch picks depend on the process's
    thread count, so only outputs computed alike can be compared bit for bit.
    """
    exported, stdout = f"{config.checkpoint_dir}.pt", io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(["export", config.checkpoint_dir, exported])
    model = ShardedMLP(config.hidden, config.layers)
    model.load_state_dict(torch.load(exported))
    with torch.no_grad():
        output = model(probe)
    # numpy copies: a tensor would cross the result queue by shared memory, gone when this process exits
    return {
        "export exit code": code,
        "export says": stdout.getvalue(),
        "stages chained": chained.numpy(),
        "exported model": output.numpy(),
    }


def _refusals(config: TrainConfig) -> dict[str, str]:
    """The same directory, misused: a fresh run into it, and a resume with another model."""
    misuses = {
        "fresh run": replace(config, checkpoint_every=0),
        "other model": replace(config, hidden=16, resume=True),
        "other seed": replace(config, seed=1, resume=True),
    }
    refusals = {}
    for name, misuse in misuses.items():
        try:
            train(misuse)
            refusals[name] = "accepted"
        except ValueError as error:
            refusals[name] = str(error)
    return refusals


def _resumes(config: TrainConfig, rank: int) -> dict[str, dict]:
    """The finished run's checkpoints (steps 5, 10, 15, 20), copied and damaged, resumed in these processes.

    In the copy, step 20 has one byte flipped in ``__0_0.distcp``: same size, so only its CRC32 tells,
    and only rank 1 sums that file. Step 15 has ``__1_0.distcp`` cut short.
    """
    root = Path(config.checkpoint_dir)
    copy, fresh = root.with_name("damaged"), (lambda name: str(root.with_name(name)))
    if rank == 0:
        shutil.copytree(root, copy)
        flip_a_byte(copy / "step_000020" / "__0_0.distcp")
        truncate(copy / "step_000015" / "__1_0.distcp")
        (copy / "step_000003.partial").mkdir()  # a save in progress: --keep-last never touches it
    comms.barrier("damaging the copy")
    resumes = {
        "damaged, named": replace(config, checkpoint_dir=fresh("named"), resume=str(copy / "step_000020")),
        "damaged newest": replace(config, checkpoint_dir=str(copy), resume=True, keep_last=2),
        "new lr": replace(
            config, checkpoint_dir=fresh("new_lr"), resume=str(root / "step_000010"), lr=0.01, steps=12
        ),
        "older into newer": replace(config, resume=str(root / "step_000010")),
    }
    return {name: _resumed(resumed) for name, resumed in resumes.items()}


def _resumed(config: TrainConfig) -> dict:
    """What a resumed run said (rank 0 speaks), the losses of its steps, or its error."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            losses = train(config).losses
    except (ValueError, checkpoint.CheckpointError) as error:
        return {"said": said.getvalue(), "error": f"{type(error).__name__}: {error}"}
    return {"said": said.getvalue(), "losses": losses}


# --- a save that a rank does not survive -----------------------------------------------------------------


def _die_while_saving_step_10(rank: int, world: int, directory: str) -> tuple[int, str]:
    """The train command, with rank 1 SIGKILLed inside the save of step 10."""
    save = checkpoint.dcp.save

    def save_or_die(state, checkpoint_id):
        if rank == 1 and Path(checkpoint_id).name == "step_000010.partial":
            os.kill(os.getpid(), signal.SIGKILL)
        return save(state, checkpoint_id=checkpoint_id)

    checkpoint.dcp.save = save_or_die
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = cli.main(["train", *_flags(steps=STEPS, checkpoint_dir=directory, checkpoint_every=5)])
    return code, stderr.getvalue()


# --- every run the tests compare ---------------------------------------------------------------------------


@dataclass
class Runs:
    tmp: Path
    reference: list[dict]  # per rank, from _train_then_chain_the_stages
    logs: dict[str, str]
    killed_save: list  # per rank RankOutcome of _die_while_saving_step_10

    def losses(self, name: str) -> tuple[int, list[float]]:
        return losses_of(self.tmp / f"{name}.json")

    @property
    def reference_losses(self) -> list[float]:
        return self.reference[0]["losses"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("checkpoints")
    d, j = tmp.joinpath, (lambda name: tmp / f"{name}.json")
    started: list[Started] = []

    def train_job(name: str, stages: int, **options) -> Started:
        flags = [
            "train",
            *_flags(checkpoint_dir=d(options.pop("directory", name)), losses=j(name), **options),
        ]
        started.append(start_ranks(command, stages, flags, deadline=LAUNCH_TIMEOUT))
        return started[-1]

    probe = torch.randn(5, MODEL["hidden"], generator=torch.Generator().manual_seed(1))
    try:
        first = {"halt": train_job("halt", 2, steps=10), "four": train_job("four", 4, steps=10)}
        reference = run_ok(_train_then_chain_the_stages, 2, str(d("reference")), probe, timeout=60)
        logs = {name: printed(job) for name, job in first.items()}
        shutil.copytree(d("four"), d("four_to_2"))
        second = {
            "resume": train_job("resume", 2, directory="halt", steps=STEPS, resume=True),
            "four_to_2": train_job("four_to_2", 2, steps=STEPS, resume=True),
            # --resume PATH: one checkpoint of another run; the saves go to a directory of its own
            "four_to_3": train_job(
                "four_to_3",
                3,
                steps=STEPS,
                resume=d("four") / "step_000010",
                schedule="interleaved-1f1b",
                microbatches=6,
            ),
        }
        killed_save = run_ranks(_die_while_saving_step_10, 2, str(d("killed_save")), timeout=60, linger=False)
        logs |= {name: printed(job) for name, job in second.items()}
        yield Runs(tmp, reference, logs, killed_save)
    finally:
        for job in started:
            job.stop()


# --- the properties ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ten_steps_then_resume_for_ten_more_equals_twenty_steps_bit_for_bit(runs):
    assert runs.losses("halt") == (0, runs.reference_losses[:10])
    assert runs.losses("resume") == (10, runs.reference_losses[10:])
    assert (
        "resumed from" in runs.logs["resume"]
        and "at step 10 (saved by 2 stage(s), now 2)" in runs.logs["resume"]
    )
    resumed, _ = checkpoint.load_full_model(runs.tmp / "halt" / "step_000020")
    uninterrupted, _ = checkpoint.load_full_model(runs.tmp / "reference" / "step_000020")
    assert resumed.keys() == uninterrupted.keys() and len(resumed) == 2 * MODEL["layers"]
    assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed)


@pytest.mark.slow
def test_a_checkpoint_of_four_stages_resumes_on_two_and_three_on_the_same_loss_curve(runs):
    first, losses = runs.losses("four")
    assert first == 0 and losses == pytest.approx(runs.reference_losses[:10], rel=1e-5)
    for stages in (2, 3):
        first, losses = runs.losses(f"four_to_{stages}")
        assert first == 10 and losses == pytest.approx(runs.reference_losses[10:], rel=1e-5)
        assert f"at step 10 (saved by 4 stage(s), now {stages})" in runs.logs[f"four_to_{stages}"]


@pytest.mark.slow
def test_a_rank_killed_while_saving_fails_its_peer_fast_and_the_previous_checkpoint_stays_newest(runs):
    survivor, victim = runs.killed_save
    assert victim.exitcode == -signal.SIGKILL
    code, stderr = survivor.value
    assert code == 1 and stderr.startswith(
        "pipeclock train: error: rank 0: lost the connection to a peer while saving "
    )
    directory = runs.tmp / "killed_save"
    assert (directory / "step_000010.partial").is_dir()
    assert checkpoint_choice.newest(directory) == directory / "step_000005"
    loaded, _ = checkpoint.load_full_model(checkpoint_choice.newest(directory))
    uninterrupted, _ = checkpoint.load_full_model(runs.tmp / "reference" / "step_000005")
    assert all(torch.equal(loaded[key], uninterrupted[key]) for key in uninterrupted)


@pytest.mark.slow
def test_a_partial_directory_never_wins_even_with_every_file_in_it(runs, tmp_path):
    shutil.copytree(runs.tmp / "reference" / "step_000010", tmp_path / "step_000010")
    shutil.copytree(runs.tmp / "reference" / "step_000020", tmp_path / "step_000030.partial")
    assert checkpoint_choice.newest(tmp_path) == tmp_path / "step_000010"
    assert checkpoint_choice.resolve(tmp_path) == tmp_path / "step_000010"


@pytest.mark.slow
def test_a_fresh_run_or_another_model_cannot_reuse_a_runs_checkpoint_directory(runs):
    for rank, outcome in enumerate(runs.reference):
        refusals = outcome["refusals"]
        assert (
            refusals["fresh run"].startswith(f"rank {rank}: ")
            and "already holds checkpoints" in refusals["fresh run"]
        )
        assert refusals["other model"].endswith("holds a ShardedMLP 8 x 32, not 8 x 16 (--hidden 32, not 16)")
        assert refusals["other seed"].startswith(f"rank {rank}: ") and refusals["other seed"].endswith(
            "step_000020 was trained with --seed 0, not --seed 1 (the seed fixes the initial weights and "
            "every batch: resume with the checkpoint's)"
        )


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_by_every_rank_and_the_run_ends_bit_for_bit(runs):
    copy, reference = runs.tmp / "damaged", runs.tmp / "reference"
    cut_from = (reference / "step_000015" / "__1_0.distcp").stat().st_size
    assert [outcome["resumes"]["damaged newest"]["losses"] for outcome in runs.reference] == 2 * [
        runs.reference_losses[10:]
    ]
    said = runs.reference[0]["resumes"]["damaged newest"]["said"].splitlines()
    assert said[:3] == [
        f"checkpoint {copy / 'step_000020'} is damaged (__0_0.distcp: its CRC32 differs from the one saved: "
        "the content changed); resuming from step_000010",
        f"checkpoint {copy / 'step_000015'} is damaged (__1_0.distcp: truncated to 1000 of {cut_from} "
        "bytes); resuming from step_000010",
        f"resumed from {copy / 'step_000010'} at step 10 (saved by 2 stage(s), now 2)",
    ]
    # --keep-last 2 after the save of step 15: the damaged step 20 is the other one kept, until replaced
    assert "--keep-last 2: removed step_000005, step_000010" in said
    assert sorted(p.name for p in copy.iterdir()) == ["step_000003.partial", "step_000015", "step_000020"]
    resaved, _ = checkpoint.load_full_model(copy / "step_000020")
    uninterrupted, _ = checkpoint.load_full_model(reference / "step_000020")
    assert all(torch.equal(resaved[key], uninterrupted[key]) for key in uninterrupted)


@pytest.mark.slow
def test_a_damaged_checkpoint_named_by_resume_is_one_error_on_every_rank_naming_the_file(runs):
    # Only rank 1 sums __0_0.distcp: rank 0 reports the damage too, because the ranks share verdicts.
    named = runs.tmp / "damaged" / "step_000020"
    for rank, outcome in enumerate(runs.reference):
        assert outcome["resumes"]["damaged, named"] == {
            "said": "",
            "error": f"ResumeRefused: rank {rank}: checkpoint {named} is damaged: __0_0.distcp: its CRC32 "
            "differs from the one saved: the content changed",
        }


@pytest.mark.slow
def test_a_resume_trains_with_the_flags_settings_and_says_once_what_changed(runs):
    said, losses = runs.reference[0]["resumes"]["new lr"].values()
    assert said.splitlines()[1] == "resume: --lr 0.01 (checkpoint had 0.0003); --steps 12 (checkpoint had 20)"
    assert runs.reference[1]["resumes"]["new lr"]["said"] == ""  # rank 0 speaks for the run
    assert losses[0] == runs.reference_losses[10]  # the checkpoint's weights ...
    assert losses[1] != runs.reference_losses[11]  # ... stepped at --lr 0.01, not the saved 0.0003


@pytest.mark.slow
def test_resuming_an_older_checkpoint_into_a_directory_with_newer_ones_is_refused(runs):
    reference = runs.tmp / "reference"
    for rank, outcome in enumerate(runs.reference):
        assert outcome["resumes"]["older into newer"]["error"] == (
            f"ValueError: rank {rank}: --checkpoint-dir {reference} already holds step_000020, newer than "
            f"the checkpoint resumed from ({reference / 'step_000010'}): the saves of two runs would mix "
            "there; choose another --checkpoint-dir, or move the newer checkpoints away"
        )


@pytest.mark.slow
def test_export_of_a_damaged_checkpoint_is_one_error_naming_the_file_and_the_fault(runs, tmp_path, capsys):
    saved = runs.tmp / "reference" / "step_000020"
    for name, (damage, expected) in damages(saved).items():
        copy, output = tmp_path / name / "step_000020", tmp_path / name / "model.pt"
        shutil.copytree(saved, copy)
        damage(copy)
        assert cli.main(["export", str(copy), str(output)]) == 2, name
        error = capsys.readouterr().err
        assert error.startswith(f"pipeclock export: error: checkpoint {copy} is damaged: {expected}"), name
        assert error.count("\n") == 1 and not output.exists(), name
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(expected)):
            checkpoint.load_model(copy)  # generate's way in


@pytest.mark.slow
def test_export_of_a_run_directory_skips_its_damaged_newest_and_says_so(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs.tmp / "reference", run)
    truncate(run / "step_000020" / "__1_0.distcp")
    (run / "step_000015" / "pipeclock.json").unlink()
    assert cli.main(["export", str(run), str(tmp_path / "model.pt")]) == 0
    out, err = capsys.readouterr()
    cut_from = (runs.tmp / "reference" / "step_000020" / "__1_0.distcp").stat().st_size
    assert err.splitlines() == [
        f"pipeclock export: checkpoint {run / 'step_000020'} is damaged (__1_0.distcp: truncated to 1000 of "
        f"{cut_from} bytes); exporting step_000010",
        f"pipeclock export: checkpoint {run / 'step_000015'} is damaged (pipeclock.json: missing); "
        "exporting step_000010",
    ]
    assert out.startswith(f"exported {run / 'step_000010'} (step 10, ")
    for step in ("step_000010", "step_000005"):
        shutil.rmtree(run / step)
    assert cli.main(["export", str(run), str(tmp_path / "model2.pt")]) == 2
    assert capsys.readouterr().err == (
        f"pipeclock export: error: every checkpoint in {run} is damaged: step_000020 (__1_0.distcp: "
        f"truncated to 1000 of {cut_from} bytes), step_000015 (pipeclock.json: missing)\n"
    )


@pytest.mark.slow
def test_keep_last_keeps_the_newest_sound_checkpoints_and_never_a_partial_save(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs.tmp / "reference", run)
    (run / "step_000030.partial").mkdir()  # another run's save in progress
    truncate(run / "step_000015" / "__1_0.distcp")  # damaged: it does not take one of the places
    newest = run / "step_000020"
    assert checkpoint_choice.prune(run, 2, newest) == [run / "step_000005"]
    assert sorted(p.name for p in run.iterdir()) == [
        "step_000010", "step_000015", "step_000020", "step_000030.partial"
    ]  # fmt: skip
    assert checkpoint_choice.prune(run, 1, newest) == [run / "step_000015", run / "step_000010"]
    assert sorted(p.name for p in run.iterdir()) == ["step_000020", "step_000030.partial"]


@pytest.mark.slow
def test_export_loads_into_the_one_process_model_and_computes_what_the_stages_chained_compute(runs):
    last = runs.reference[-1]
    assert last["export exit code"] == 0
    assert last["export says"].startswith(f"exported {runs.tmp / 'reference' / 'step_000020'} (step 20, ")
    assert torch.equal(torch.from_numpy(last["exported model"]), torch.from_numpy(last["stages chained"]))
    exported = torch.load(runs.tmp / "reference.pt")
    assert exported.keys() == ShardedMLP(MODEL["hidden"], MODEL["layers"]).state_dict().keys()


def test_export_of_a_directory_without_a_checkpoint_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    (tmp_path / "step_000010.partial").mkdir()
    assert cli.main(["export", str(tmp_path), str(tmp_path / "model.pt")]) == 2
    error = capsys.readouterr().err
    assert (
        error
        == f"pipeclock export: error: no checkpoint in {tmp_path}: no complete step_NNNNNN directory in it\n"
    )
    assert not (tmp_path / "model.pt").exists()
