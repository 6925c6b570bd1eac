"""Hostile input gets one clear line, a non-zero exit and loses nothing: NaN loss, full disk, bad
checkpoints, missing or corrupt datasets, an unwritable data.root."""
import errno
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ext
import train
from trainer import checkpoint, config
from test_resume import STEPS_PER_EPOCH, error_lines, scalars, train_command

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A finished two-epoch run: the checkpoint every test below must leave usable."""
    run_dir = tmp_path_factory.mktemp("good")
    train.fit(config.load_config(["trainer.epochs=2"]), run_dir)
    return run_dir


def assert_one_line_error(result, *phrases, exit_code=1):
    lines = error_lines(result)
    assert result.returncode == exit_code, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert all(phrase in lines[0] for phrase in phrases), lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def assert_loads(path, epoch):
    state = checkpoint.load(path)
    assert state["epoch"] == epoch and all(value.isfinite().all() for value in state["model"].values())


def test_nan_loss_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = train_command(["trainer.epochs=3", f"hydra.run.dir={run_dir}"], tmp_path,
                           hooked=("nan-loss", STEPS_PER_EPOCH + 5))
    assert_one_line_error(
        result, f"loss became nan in epoch 2, step 5 (global step {STEPS_PER_EPOCH + 5})",
        f"{run_dir / 'last.pt'} keeps epoch 1", "try a lower learning rate (optim.lr=0.0001)",
    )
    assert_loads(run_dir / "last.pt", epoch=1)
    assert [step for step, _ in scalars(run_dir)["val/acc"]] == [1]
    log_text = (run_dir / "train.log").read_text()
    assert "Traceback" in log_text and "NonFiniteLoss" in log_text  # the details are kept, off the terminal


def test_a_failed_sweep_job_is_reported_and_the_others_still_run(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = train_command(["-m", "optim.lr=1e9,0.001", "trainer.epochs=1", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    failed, finished = sorted(path for path in sweep_dir.iterdir() if path.is_dir())
    assert "loss became nan" in (failed / "failed.txt").read_text() and not (failed / "summary.json").exists()
    assert (finished / "summary.json").is_file()  # the job after the failed one ran to its end
    errors = error_lines(result)
    assert errors[0].startswith(f"error: job {failed.name}: loss became nan") and len(errors) == 2
    assert errors[1].startswith(f"error: 1 job(s) failed: {failed.name}")
    markdown = (sweep_dir / "summary.md").read_text()
    assert "2 jobs, 1 failed" in markdown and "## Failed jobs" in markdown
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("full_error", [False, True])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, full_error):
    run_dir = tmp_path / "run"
    result = train_command(["trainer.epochs=3", f"hydra.run.dir={run_dir}"], tmp_path, hooked=("disk-full", 2),
                           env={"HYDRA_FULL_ERROR": "1"} if full_error else {})
    if full_error:  # the user asked for the traceback on the terminal
        assert result.returncode == 1 and "Traceback" in result.stderr and "No space left" in result.stderr
    else:
        assert_one_line_error(
            result, f"disk full while writing {run_dir / 'last.pt'}; the previous checkpoint is intact",
            "free some space, then resume with: python train.py trainer.resume=",
        )
        assert "Traceback" in (run_dir / "train.log").read_text()
    assert_loads(run_dir / "last.pt", epoch=1)
    assert not list(run_dir.glob("*.tmp"))


def test_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"epoch": 1}, path)

    def fail_halfway(error):
        def save(state, file):
            file.write(b"half a checkpoint")
            raise error
        return save

    monkeypatch.setattr(torch, "save", fail_halfway(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(checkpoint.CheckpointError, match="disk full while writing .*; the previous checkpoint is intact"):
        checkpoint.save_atomic({"epoch": 2}, path)
    monkeypatch.setattr(torch, "save", fail_halfway(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_atomic({"epoch": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["epoch"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


class FillsUp(io.RawIOBase):
    """A file on a disk that fills up after `room` bytes, as the OS answers: errno ENOSPC."""

    def __init__(self, file, room):
        super().__init__()
        self.file, self.room = file, room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)


def test_a_disk_that_fills_up_under_torchs_own_writer_is_called_full(tmp_path, monkeypatch):
    # torch's zip writer, told ENOSPC by the file, raises a RuntimeError of its own ("unexpected pos ...") over it
    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"epoch": 1}, path)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda state, file: real_save(state, FillsUp(file, room=20_000)))
    with pytest.raises(checkpoint.CheckpointError, match="disk full while writing .*; the previous checkpoint is intact"):
        checkpoint.save_atomic({"epoch": 2, "weights": torch.zeros(100_000)}, path)
    monkeypatch.undo()
    assert torch.load(path)["epoch"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_truncated_checkpoint_is_refused_in_one_line(tmp_path, good_run):
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    content = (good_run / "last.pt").read_bytes()
    (bad_dir / "last.pt").write_bytes(content[: len(content) // 2])
    result = train_command([f"trainer.resume={bad_dir}"], tmp_path)
    assert_one_line_error(result, f"{bad_dir / 'last.pt'} is truncated or corrupt", "resume from another checkpoint")
    assert (bad_dir / "last.pt").read_bytes() == content[: len(content) // 2]  # left as it was
    assert_loads(good_run / "last.pt", epoch=2)


@pytest.mark.parametrize("write, message", [
    (lambda path: path.write_bytes(os.urandom(4096)), "is not a checkpoint (not a file torch.save wrote)"),
    (lambda path: path.write_text("# README\n"), "is not a checkpoint (not a file torch.save wrote)"),
    (lambda path: torch.save({"weights": torch.zeros(3)}, path), "is not a linear-lab checkpoint (no epoch"),
    (lambda path: torch.save({"epoch": shutil.rmtree}, path),  # code, not data
     "is not a linear-lab checkpoint: it holds Python objects that torch.load(weights_only=True) refuses to run"),
    (lambda path: path.write_bytes(b"PK\x03\x04" + os.urandom(4096)), "is truncated or corrupt"),
])
def test_unusable_checkpoint_files_are_named(tmp_path, write, message):
    write(tmp_path / "some.pt")
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(message)):
        checkpoint.load(tmp_path / "some.pt")


def test_checkpoint_of_another_model_lists_mismatched_keys(tmp_path, good_run):
    state = checkpoint.load(good_run)
    state["config"]["model"]["hidden_sizes"] = [32]  # what a changed model definition looks like
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    checkpoint.save_atomic(state, other_dir / "last.pt")
    result = train_command(["trainer.eval_only=true", f"trainer.resume={other_dir}"], tmp_path)
    assert_one_line_error(result, f"{other_dir / 'last.pt'} holds another model than its config builds",
                          "mismatched keys: ", "(256, 64) != (32, 64)")
    assert_loads(good_run / "last.pt", epoch=2)


def test_missing_checkpoint_path_fails_before_any_folder_exists(tmp_path):
    result = train_command([f"trainer.resume={tmp_path / 'no_such_run'}"], tmp_path)
    assert_one_line_error(result, f"trainer.resume={tmp_path / 'no_such_run'}: no such file or folder", exit_code=2)
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "no_such_run").exists()


def test_eval_only_needs_a_checkpoint():
    with pytest.raises(config.ConfigError, match=r"trainer.eval_only=true needs trainer.resume="):
        config.validate(config.load_config(["trainer.eval_only=true"]))


@pytest.mark.parametrize("files, message", [
    ({}, "dataset files missing in"),
    ({"data_batch_1": b"\x80\x04 not a pickle"}, "dataset cifar10 in {root} is corrupt (UnpicklingError"),
])
def test_missing_or_corrupt_dataset_files(tmp_path, files, message):
    root = tmp_path / "datasets"
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    if files:  # every file present, one of them damaged
        for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
            (folder / name).write_bytes(files.get(name, b""))
    result = train_command(["data=cifar10", f"data.root={root}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_line_error(result, message.format(root=root))
    assert "Traceback" in (tmp_path / "run" / "train.log").read_text()
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))  # no empty run for TensorBoard to list


def test_a_dataset_too_large_for_memory_says_so_not_that_it_is_corrupt(tmp_path):
    result = train_command(["data=fake", "data.image_size=[100000,1000,1000]", f"hydra.run.dir={tmp_path / 'run'}"],
                           tmp_path)
    assert_one_line_error(result, "dataset fake does not fit in memory (", "make it smaller (data.train_size")


def test_unwritable_data_root_is_named_before_any_download(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where data.root wants a folder")  # unwritable even for root, unlike chmod
    result = train_command(["data=mnist", "data.download=true", f"data.root={blocker / 'datasets'}"], tmp_path)
    assert_one_line_error(result, f"data.root={blocker / 'datasets'} cannot be written (", "set data.root to a writable folder")


def test_an_infinite_loss_stops_the_run_like_a_nan(tmp_path, monkeypatch):
    cross_entropy = ext.cross_entropy

    def infinite(*args, **kwargs):  # the training step's loss (evaluation's is torch's)
        return cross_entropy(*args, **kwargs) + math.inf

    monkeypatch.setattr(ext, "cross_entropy", infinite)
    with pytest.raises(train.RunStopped, match=r"^loss became inf in epoch 1, step 1 .*no epoch finished"):
        train.fit(config.load_config(["trainer.epochs=1"]), tmp_path)
    assert not (tmp_path / "last.pt").exists()


# train.py with an error nobody foresaw in its first training step
UNFORESEEN = """
import runpy, sys
import torch

repo = sys.argv[1]
sys.argv = [repo + "/train.py", *sys.argv[2:]]
sys.path.insert(0, repo)

def broken(*args, **kwargs):
    raise RuntimeError("something\\nunforeseen")

import ext  # the training step's loss
ext.cross_entropy = broken
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_an_unforeseen_error_is_one_line_exit_1_with_the_traceback_in_train_log(tmp_path):
    script, run_dir = tmp_path / "broken_train.py", tmp_path / "run"
    script.write_text(UNFORESEEN)
    result = subprocess.run([sys.executable, str(script), str(REPO), "trainer.epochs=1", f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, "RuntimeError: something unforeseen", f"(traceback in {run_dir / 'train.log'})")
    log_text = (run_dir / "train.log").read_text()
    assert "Traceback" in log_text and "RuntimeError: something" in log_text


def test_a_bad_value_in_a_range_sweep_fails_its_job_and_the_sweep_goes_on(tmp_path):
    # range sweeps are checked in each job, not before the sweep: both jobs run, fail, and are listed
    sweep_dir = tmp_path / "sweep"
    result = train_command(["-m", "trainer.epochs=range(-1,1)", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    jobs = sorted(path for path in sweep_dir.iterdir() if path.is_dir())
    assert [(job / "failed.txt").read_text().strip() for job in jobs] == [
        f"trainer.epochs={epochs} is invalid: it must be a positive integer" for epochs in (-1, 0)]
    errors = error_lines(result)
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)  # one line per job, one for the sweep
    assert errors[0] == f"error: job {jobs[0].name}: trainer.epochs=-1 is invalid: it must be a positive integer"
    assert errors[2].startswith("error: 2 job(s) failed") and "2 jobs, 2 failed" in (sweep_dir / "summary.md").read_text()


def test_a_truncated_checkpoints_traceback_is_in_the_runs_train_log(tmp_path, good_run):
    run_dir = tmp_path / "run"
    shutil.copytree(good_run, run_dir)
    content = (run_dir / "last.pt").read_bytes()
    (run_dir / "last.pt").write_bytes(content[: len(content) // 2])
    result = train_command([f"trainer.resume={run_dir}"], tmp_path)
    assert_one_line_error(result, f"{run_dir / 'last.pt'} is truncated or corrupt")
    assert "Traceback" in (run_dir / "train.log").read_text()


def test_a_folder_that_is_no_run_says_so_and_what_to_do(tmp_path):
    result = train_command([f"trainer.resume={tmp_path}"], tmp_path)
    assert_one_line_error(result, f"trainer.resume={tmp_path} is not a run folder (it has no .hydra/)",
                          "give a run's folder", exit_code=2)


def test_a_folder_with_no_checkpoint_says_so_and_what_to_do(tmp_path):
    (tmp_path / ".hydra").mkdir()  # a run's folder
    (tmp_path / "last.pt.tmp").write_bytes(b"cut short by a kill during the first save")
    with pytest.raises(checkpoint.CheckpointError, match=r"^no last.pt in .*: the run ended before its first "
                                                         r"checkpoint was written; start the run again$"):
        checkpoint.find(tmp_path)
