"""Never lose a run: killed (SIGKILL, SIGTERM, Ctrl-C) at any moment and resumed, a run ends exactly like one left
alone; checkpoints are atomic, move between linear=custom and linear=torch, and evaluate on their own."""
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import data
import train
from trainer import build, checkpoint, config, logs, summary

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 3
STEPS_PER_EPOCH = 23  # digits: 1,438 training images in batches of 64
# dropout draws from torch's RNG every step: an exact resume must restore it, not only the data order
RUN = [f"trainer.epochs={EPOCHS}", "model.dropout=0.2"]
EXACT_TAGS = ["train/loss", "train/acc", "val/loss", "val/acc", "train/lr"]  # all but the timings

# Runs train.py as `python train.py ...` does, with one event injected at the N-th call of a function:
#   python HOOKED_TRAIN <event> <N> <train.py arguments>
HOOKED_TRAIN = """
import errno, os, runpy, signal, sys
import torch

repo, event, at_call = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.argv = [os.path.join(repo, "train.py"), *sys.argv[4:]]
# Ctrl-C as a terminal's foreground process gets it: a test runner started in the background
# (`cmd &` in a script) passes SIGINT on ignored, and Python then installs no handler for it.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, repo)
calls = 0

def hook(owner, name, action, counts=lambda *args, **kwargs: True):
    original = getattr(owner, name)
    def hooked(*args, **kwargs):
        global calls
        if counts(*args, **kwargs):
            calls += 1
            if calls == at_call:
                return action(original, *args, **kwargs)
        return original(*args, **kwargs)
    setattr(owner, name, hooked)

def kill(signal_number):
    def action(original, *args, **kwargs):
        os.kill(os.getpid(), signal_number)
        return original(*args, **kwargs)
    return action

def disk_full(original, state, file):
    file.write(b"half a checkpoint")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

class InterruptedWrites:  # a file whose second write gets a signal: Ctrl-C (or kill) in the middle of torch.save
    def __init__(self, file, signal_number):
        self.file, self.writes, self.signal_number = file, 0, signal_number
    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            os.kill(os.getpid(), self.signal_number)
        return self.file.write(data)
    def flush(self):
        return self.file.flush()

def mid_save(signal_number):
    def action(original, state, file):
        return original(state, InterruptedWrites(file, signal_number))
    return action

def nan_loss(original, *args, **kwargs):
    return original(*args, **kwargs) * float("nan")

if event == "sigkill-in-step":
    hook(torch.Tensor, "backward", kill(signal.SIGKILL))
elif event == "sigint-in-step":
    hook(torch.Tensor, "backward", kill(signal.SIGINT))
elif event == "sigterm-in-step":
    hook(torch.Tensor, "backward", kill(signal.SIGTERM))
elif event == "sigint-in-save":
    hook(torch, "save", mid_save(signal.SIGINT))
elif event == "sigterm-in-save":
    hook(torch, "save", mid_save(signal.SIGTERM))
elif event == "sigkill-before-rename":
    hook(os, "replace", kill(signal.SIGKILL), counts=lambda source, target: str(target).endswith("last.pt"))
elif event == "disk-full":
    hook(torch, "save", disk_full)
elif event == "nan-loss":
    import ext  # the training step's loss (evaluation's is torch's)
    hook(ext, "cross_entropy", nan_loss)
else:
    raise SystemExit(f"unknown event {event}")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def train_command(args, cwd, hooked=None, env=None):
    """Run train.py (through HOOKED_TRAIN when `hooked` = (event, call)); returns the CompletedProcess."""
    if hooked:
        script = Path(cwd) / "hooked_train.py"
        script.write_text(HOOKED_TRAIN)
        command = [sys.executable, str(script), str(REPO), hooked[0], str(hooked[1]), *args]
    else:
        command = [sys.executable, str(REPO / "train.py"), *args]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=environment)


def error_lines(result):
    """stderr without torch's CUDA notice and the extension's build notices (only when its sources changed)."""
    return [line for line in result.stderr.splitlines()
            if "No CUDA runtime" not in line and not line.startswith("linear-lab: ")]


def scalars(run_dir):
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def epoch_lines(text):
    """A train.log's per-epoch figures, without the timings."""
    return re.findall(r"(epoch \d+/\d+: train loss .* acc .*% \| val loss .* acc .*%) \|", text)


def epochs_kept(run_dir):
    """The per-epoch lines of a resumed run's train.log that its checkpoints kept: a killed run may have
    logged an epoch whose checkpoint never landed, and the resumed run logs that epoch again."""
    before, _, after = (run_dir / "train.log").read_text().rpartition("resumed after epoch ")
    return epoch_lines(before)[: int(re.match(r"\d+", after).group())] + epoch_lines(after)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run left alone."""
    cwd = tmp_path_factory.mktemp("reference")
    result = train_command([*RUN, f"hydra.run.dir={cwd / 'run'}"], cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return cwd / "run"


def assert_same_run(run_dir, reference_dir):
    resumed, alone = (torch.load(path / "last.pt", weights_only=True) for path in (run_dir, reference_dir))
    assert resumed["epoch"] == alone["epoch"] == EPOCHS and resumed["global_step"] == EPOCHS * STEPS_PER_EPOCH
    for key, value in alone["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    assert all(torch.equal(resumed["optimizer"]["state"][p]["exp_avg"], state["exp_avg"])
               for p, state in alone["optimizer"]["state"].items())
    assert resumed["best_val_acc"] == alone["best_val_acc"]
    best, best_alone = (torch.load(path / "best.pt", weights_only=True) for path in (run_dir, reference_dir))
    assert best["epoch"] == best_alone["epoch"]
    assert all(torch.equal(best["model"][key], value) for key, value in best_alone["model"].items())
    logged, logged_alone = scalars(run_dir), scalars(reference_dir)
    for tag in logged_alone:  # one value per epoch per tag, nothing duplicated or missing
        assert [step for step, _ in logged[tag]] == [step for step, _ in logged_alone[tag]], tag
    for tag in EXACT_TAGS:
        assert logged[tag] == logged_alone[tag], tag
    assert epochs_kept(run_dir) == epoch_lines((reference_dir / "train.log").read_text())  # train.log appended
    assert not list(run_dir.glob("*.tmp"))


@pytest.mark.parametrize("event, at_call, epochs_logged", [
    ("sigkill-in-step", STEPS_PER_EPOCH + 10, [1]),  # in epoch 2's 10th step; last.pt: epoch 1
    ("sigkill-before-rename", 2, [1, 2]),  # epoch 2 logged, its last.pt never renamed into place
])
def test_killed_run_resumes_to_the_same_weights_and_metrics(tmp_path, reference, event, at_call, epochs_logged):
    run_dir = tmp_path / "run"
    killed = train_command([*RUN, f"hydra.run.dir={run_dir}"], tmp_path, hooked=(event, at_call))
    assert killed.returncode == -9
    assert torch.load(run_dir / "last.pt", weights_only=True)["epoch"] == 1
    assert [step for step, _ in scalars(run_dir)["val/acc"]] == epochs_logged

    resumed = train_command([f"trainer.resume={run_dir}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed after epoch 1 from {run_dir / 'last.pt'}" in resumed.stdout
    assert_same_run(run_dir, reference)
    # the step times leave out each process's first epoch: the run's, and the resumed process's
    assert summary.read_run_summary(run_dir)[summary.WARMUP_EPOCHS_KEY] == [0, 1]
    assert summary.read_run_summary(reference)[summary.WARMUP_EPOCHS_KEY] == [0]
    assert not (tmp_path / "outputs").exists()  # the run went on in its own folder


def test_ctrl_c_keeps_the_last_epoch_and_prints_the_command_that_resumes(tmp_path, reference):
    # the run folder's name has the characters Hydra's grammar reads as syntax
    run_dir = tmp_path / "mlp_optim.lr=0.001,trainer.epochs=3"
    stopped = train_command([*RUN, f"hydra.run.dir='{run_dir}'"], tmp_path, hooked=("sigint-in-step", 2 * STEPS_PER_EPOCH + 5))
    assert stopped.returncode == 130
    assert torch.load(run_dir / "last.pt", weights_only=True)["epoch"] == 2
    assert [step for step, _ in scalars(run_dir)["val/acc"]] == [1, 2]  # the logs were flushed
    (command,) = re.findall(r"resume with: (.*)", stopped.stdout)
    assert f"resume with: {command}" in (run_dir / "train.log").read_text()

    program, script, *args = shlex.split(command)
    assert (program, script) == ("python", "train.py")
    resumed = train_command(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run_dir, reference)


@pytest.mark.parametrize("signal_name, exit_code", [("sigint", 130), ("sigterm", 143)])
def test_ctrl_c_or_sigterm_during_a_save_finishes_it_then_stops(tmp_path, signal_name, exit_code):
    run_dir = tmp_path / "run"
    stopped = train_command([*RUN, f"hydra.run.dir={run_dir}"], tmp_path, hooked=(f"{signal_name}-in-save", 2))
    assert stopped.returncode == exit_code, stopped.stderr[-2000:]
    assert torch.load(run_dir / "last.pt", weights_only=True)["epoch"] == 2  # the save it interrupted
    assert "resume with: " in stopped.stdout and not error_lines(stopped)
    assert not (run_dir / "last.pt.tmp").exists()


def test_sigterm_stops_a_run_as_ctrl_c_does_and_says_so(tmp_path, reference):
    # kill, timeout or a container stopping: the default would end the process without a word
    run_dir = tmp_path / "run"
    stopped = train_command([*RUN, f"hydra.run.dir={run_dir}"], tmp_path, hooked=("sigterm-in-step", STEPS_PER_EPOCH + 5))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert torch.load(run_dir / "last.pt", weights_only=True)["epoch"] == 1
    (command,) = re.findall(r"stopped by SIGTERM: .* resume with: (.*)", stopped.stdout)
    assert "stopped by SIGTERM" in (run_dir / "train.log").read_text() and not error_lines(stopped)
    resumed = train_command(shlex.split(command)[2:], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run_dir, reference)


def test_sigterm_before_the_first_epoch_leaves_a_folder_that_says_so(tmp_path):
    run_dir = tmp_path / "run"
    stopped = train_command([*RUN, f"hydra.run.dir={run_dir}"], tmp_path, hooked=("sigterm-in-step", 3))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert summary.job_error(run_dir) == logs.NOT_STARTED_BY_SIGTERM
    assert "stopped by SIGTERM before the first epoch ended" in stopped.stdout


def test_sigterm_is_left_to_a_launcher_that_handles_it():
    # submitit's jobs (SLURM, local) install their own SIGTERM handler before the job runs
    def launcher_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, launcher_handler)
    try:
        with checkpoint.terminate_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is launcher_handler
            with checkpoint.interrupts_deferred():  # a save defers only Ctrl-C then
                assert signal.getsignal(signal.SIGTERM) is launcher_handler
        assert signal.getsignal(signal.SIGTERM) is launcher_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with checkpoint.terminate_as_interrupt():  # the default: taken as an interrupt, and given back after
        with pytest.raises(checkpoint.Terminated):  # called, not sent: were it not installed, pytest would die
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_best_checkpoint_is_the_epoch_with_the_best_val_acc(reference):
    val_accs = [value for _, value in scalars(reference)["val/acc"]]
    best = torch.load(reference / "best.pt", weights_only=True)
    assert best["epoch"] == 1 + val_accs.index(max(val_accs))
    assert best["best_val_acc"] == pytest.approx(max(val_accs))


def test_best_checkpoint_keeps_an_earlier_epoch_across_a_stop_and_resume(tmp_path, monkeypatch):
    # val/acc scripted so the best epoch comes before the stop and later epochs are worse: a resumed
    # run that forgot the best so far would overwrite best.pt with epoch 2
    val_accs = iter([0.9, 0.5, 0.6])
    evaluate = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda *args, **kwargs: (evaluate(*args, **kwargs)[0], next(val_accs)))
    interrupted_run(tmp_path, ["trainer.epochs=3"], at_epoch=2, monkeypatch=monkeypatch)
    best_before = torch.load(tmp_path / "best.pt", weights_only=True)
    resume_in_process(tmp_path, [])
    best, last = (torch.load(tmp_path / name, weights_only=True) for name in ("best.pt", "last.pt"))
    assert last["epoch"] == 3 and last["best_val_acc"] == best["best_val_acc"] == 0.9
    assert best["epoch"] == 1
    assert all(torch.equal(best["model"][key], value) for key, value in best_before["model"].items())


def test_eval_only_reproduces_the_final_val_acc_and_trains_nothing(tmp_path, reference):
    before = {path.name: path.stat().st_mtime_ns for path in reference.iterdir()}
    result = train_command(["trainer.eval_only=true", f"trainer.resume={reference / 'last.pt'}"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    (evaluated,) = re.findall(r"eval: (val loss \S+ acc \S+%)", result.stdout)
    assert epoch_lines((reference / "train.log").read_text())[-1].endswith(evaluated)
    assert f"eval: {evaluated}" in (reference / "train.log").read_text()
    assert {path.name: path.stat().st_mtime_ns for path in reference.iterdir() if path.name != "train.log"} == {
        name: mtime for name, mtime in before.items() if name != "train.log"
    }


def interrupted_run(run_dir, overrides, at_epoch, monkeypatch):
    """A run in this process stopped by Ctrl-C at the start of epoch `at_epoch`."""
    train_one_epoch, epochs = train.train_one_epoch, []

    def interrupt_at_epoch(*args, **kwargs):
        epochs.append(None)
        if len(epochs) == at_epoch:
            raise KeyboardInterrupt
        return train_one_epoch(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(train, "train_one_epoch", interrupt_at_epoch)
        with pytest.raises(KeyboardInterrupt):
            train.fit(config.load_config(overrides), run_dir)


def resume_in_process(run_dir, overrides):
    """What `python train.py trainer.resume=<run_dir> <overrides>` runs."""
    overrides = [f"trainer.resume={run_dir}", *overrides]
    cfg = config.load_config(overrides)
    state = checkpoint.load(run_dir)
    cfg = checkpoint.resumed_config(state["config"], cfg, [override.split("=")[0] for override in overrides])
    config.validate(cfg)
    return train.fit(cfg, run_dir)


@pytest.mark.parametrize("saved, resumed", [("custom", "torch"), ("torch", "custom")])
def test_checkpoint_moves_between_linear_implementations(tmp_path, monkeypatch, saved, resumed):
    interrupted_run(tmp_path, [f"linear={saved}", "trainer.epochs=2"], at_epoch=2, monkeypatch=monkeypatch)
    state = checkpoint.load(tmp_path)
    assert state["epoch"] == 1 and state["config"]["linear"]["name"] == saved

    cfg = config.load_config([f"linear={resumed}"])
    dataset = build.read_dataset(cfg.data)
    model = build.make_model(cfg, dataset, torch.device("cpu"))
    checkpoint.load_model_state(model, state["model"], tmp_path / "last.pt")
    saved_model = build.make_model(config.load_config([f"linear={saved}"]), dataset, torch.device("cpu"))
    saved_model.load_state_dict(state["model"])
    model.eval(), saved_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(dataset.val_images), saved_model(dataset.val_images))

    val_acc = resume_in_process(tmp_path, [f"linear={resumed}"])
    final = torch.load(tmp_path / "last.pt", weights_only=True)
    assert final["epoch"] == 2 and final["config"]["linear"]["name"] == resumed and val_acc >= 0.85


def test_resume_refuses_settings_that_would_change_the_run(tmp_path, monkeypatch):
    interrupted_run(tmp_path, ["trainer.epochs=2"], at_epoch=2, monkeypatch=monkeypatch)
    with pytest.raises(checkpoint.CheckpointError, match=r"^optim.lr cannot change when resuming"):
        resume_in_process(tmp_path, ["optim.lr=0.1", "trainer.epochs=2"])


def test_resume_that_would_change_a_setting_is_a_bad_setting_one_line_exit_2(tmp_path, reference):
    refused = train_command([f"trainer.resume={reference}", "optim.lr=0.1"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = error_lines(refused)
    assert line.startswith("error: optim.lr cannot change when resuming")


def test_resume_with_the_runs_own_command_line_is_accepted():
    # `python train.py <the run's overrides> trainer.resume=<run>`: nothing changes, nothing is refused
    run = ["data=fake", "data.train_size=64", "model.hidden_sizes=[32]", "trainer.epochs=2", "sched=onecycle"]
    saved = OmegaConf.to_container(config.load_config(run), resolve=True)
    again = [*run, "trainer.resume=somewhere"]
    cfg = checkpoint.resumed_config(saved, config.load_config(again), [o.split("=")[0] for o in again])
    assert OmegaConf.to_container(cfg, resolve=True)["data"] == saved["data"]
    changed = [*again[:1], "data.train_size=128", *again[2:]]
    with pytest.raises(checkpoint.CheckpointError, match=r"^data.train_size cannot change"):
        checkpoint.resumed_config(saved, config.load_config(changed), [o.split("=")[0] for o in changed])


@pytest.mark.parametrize("loader", ["memory", "dataloader", "dataloader with 2 workers"])
def test_rng_state_restores_the_data_order_of_either_loader(loader):
    kind, *workers = loader.split(" with ")
    cfg = config.load_config([f"data.loader={kind}", f"data.num_workers={2 if workers else 0}"])
    dataset = build.read_dataset(cfg.data)
    orders = []
    for restore in (False, True):
        train_loader, _ = build.make_loaders(cfg, dataset, torch.device("cpu"))
        list(train_loader)  # epoch 1
        state = checkpoint.rng_state(data.order_generator(train_loader))
        if restore:  # a fresh loader, as a resumed run builds it
            train_loader, _ = build.make_loaders(cfg, dataset, torch.device("cpu"))
            checkpoint.restore_rng(state, data.order_generator(train_loader))
        orders.append([labels for _, labels in train_loader])  # epoch 2
    assert all(torch.equal(a, b) for a, b in zip(*orders, strict=True))


def test_the_data_order_is_the_same_with_or_without_loader_workers():
    dataset = build.read_dataset(config.load_config([]).data)
    orders = []
    for kind, workers in (("memory", 0), ("dataloader", 0), ("dataloader", 2)):
        cfg = config.load_config([f"data.loader={kind}", f"data.num_workers={workers}"])
        train_loader, _ = build.make_loaders(cfg, dataset, torch.device("cpu"))
        orders.append([labels for _ in range(2) for _, labels in train_loader])  # two epochs
    assert all(torch.equal(a, b) for a, b in zip(orders[0], orders[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(orders[1], orders[2], strict=True))


def test_a_run_with_loader_workers_resumes_to_the_same_weights_as_one_left_alone(tmp_path, monkeypatch):
    overrides = ["data.loader=dataloader", "data.num_workers=2", "trainer.epochs=2", "model.dropout=0.2"]
    alone, stopped = tmp_path / "alone", tmp_path / "stopped"
    train.fit(config.load_config(overrides), alone)
    interrupted_run(stopped, overrides, at_epoch=2, monkeypatch=monkeypatch)
    assert checkpoint.load(stopped)["epoch"] == 1
    resume_in_process(stopped, [])
    resumed, left_alone = (torch.load(path / "last.pt", weights_only=True) for path in (stopped, alone))
    assert resumed["epoch"] == left_alone["epoch"] == 2
    assert all(torch.equal(resumed["model"][key], value) for key, value in left_alone["model"].items())
    assert scalars(stopped)["val/acc"] == scalars(alone)["val/acc"]


def test_amp_loss_scale_survives_a_checkpoint():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale starts at the first step
    scaler.update(new_scale=256.0)  # what a few overflowing float16 steps leave behind
    loader_generator = torch.Generator().manual_seed(0)
    state = checkpoint.training_state(1, 10, model, optimizer, scheduler, scaler, loader_generator, config.load_config())
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0)
    checkpoint.restore(state, "last.pt", model, optimizer, scheduler, fresh, loader_generator)
    assert fresh.get_scale() == 256.0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert checkpoint.training_state(1, 10, model, optimizer, scheduler, disabled, loader_generator,
                                     config.load_config())["scaler"] is None


def test_a_checkpoint_from_before_the_tags_were_renamed_reads_as_today():
    old = [{"lr": 0.1, "throughput/train_samples_per_s": 5.0, "val/acc": 0.9}]
    assert checkpoint.current_history(old) == [{"train/lr": 0.1, "time/train_samples_per_s": 5.0, "val/acc": 0.9}]


# README: "A resume may change only linear, trainer.device, trainer.threads, data.root, data.download and
# data.num_workers; changing another setting is refused in one line."
RESUMED_RUN = ["trainer.epochs=2"]


def resumed_with(overrides):
    """resumed_config for `python train.py trainer.resume=<a RESUMED_RUN run> <overrides>`."""
    saved = OmegaConf.to_container(config.load_config(RESUMED_RUN), resolve=True)
    command_line = ["trainer.resume=somewhere", *overrides]
    return checkpoint.resumed_config(saved, config.load_config(command_line), [o.split("=")[0] for o in command_line])


@pytest.mark.parametrize("override, key, value", [
    ("linear=torch", "linear.name", "torch"),
    ("conv=custom", "conv.name", "custom"),
    ("trainer.device=cpu", "trainer.device", "cpu"),
    ("trainer.threads=1", "trainer.threads", 1),
    ("data.root=/elsewhere", "data.root", "/elsewhere"),
    ("data.download=true", "data.download", True),
    ("data.num_workers=2", "data.num_workers", 2),
])
def test_a_resume_may_change_where_it_runs_and_which_linear(override, key, value):
    assert OmegaConf.select(resumed_with([override]), key) == value


@pytest.mark.parametrize("override", [
    "seed=1", "trainer.epochs=3", "trainer.amp=true", "trainer.compile=true", "trainer.channels_last=true",
    "trainer.deterministic=true", "trainer.objective=val/loss", "model=resnet18", "model.hidden_sizes=[32]",
    "model.dropout=0.1", "data=fake", "data.batch_size=32", "data.loader=dataloader", "data.val_fraction=0.5",
    "optim=sgd", "optim.weight_decay=0.5", "sched=none",
])
def test_a_resume_refuses_every_other_change(override):
    key = override.split("=")[0]
    with pytest.raises(checkpoint.CheckpointError, match=rf"^{re.escape(key)} cannot change when resuming.*changeable: "):
        resumed_with([override])


def test_a_resume_repeating_the_runs_dataset_may_still_move_data_root():
    run = ["data=fake", "data.train_size=64", "trainer.epochs=2"]
    saved = OmegaConf.to_container(config.load_config(run), resolve=True)
    command_line = [*run, "data.root=/elsewhere", "trainer.resume=somewhere"]
    cfg = checkpoint.resumed_config(saved, config.load_config(command_line), [o.split("=")[0] for o in command_line])
    assert cfg.data.root == "/elsewhere"


def test_a_checkpoint_restores_every_random_generator(monkeypatch):
    # Python's, torch's CPU and CUDA generators (the CUDA one faked: settings only, no GPU) and the data order's
    import io
    import random

    cuda_states = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state.clone() for state in cuda_states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: cuda_states.__setitem__(slice(None), states))
    loader_generator = torch.Generator().manual_seed(5)

    def draws():
        return random.random(), torch.rand(3), torch.rand(3, generator=loader_generator)

    file = io.BytesIO()
    torch.save(checkpoint.rng_state(loader_generator), file)  # as a checkpoint holds it, and loads it back
    drawn = draws()
    cuda_states[:] = [torch.tensor([9], dtype=torch.uint8)]
    file.seek(0)
    checkpoint.restore_rng(torch.load(file, weights_only=True), loader_generator)
    again = draws()
    assert again[0] == drawn[0] and torch.equal(again[1], drawn[1]) and torch.equal(again[2], drawn[2])
    assert [state.tolist() for state in cuda_states] == [[1, 2, 3]]


def test_eval_only_writes_nothing_but_train_log(tmp_path, reference):
    # not even .hydra/ (the config the run started with), nor a folder where it was started
    def files():
        return {path.relative_to(reference): (path.stat().st_mtime_ns, path.stat().st_size)
                for path in reference.rglob("*") if path.is_file()}

    before = files()
    result = train_command(["trainer.eval_only=true", f"trainer.resume={reference / 'best.pt'}"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    after = files()
    assert {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)} == {Path("train.log")}
    assert not list(tmp_path.iterdir())


def test_a_sweep_of_evaluations_records_each_in_its_job_folder_and_compares_them(tmp_path, reference):
    def files():
        return {path: path.stat().st_mtime_ns for path in reference.rglob("*") if path.is_file()}

    before, sweep_dir = files(), tmp_path / "sweep"
    result = train_command(["-m", "trainer.eval_only=true", f"trainer.resume={reference / 'best.pt'}",
                            "linear=torch,custom", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert files() == before  # the evaluated run's folder is left as it was, train.log too
    printed = [float(acc) / 100 for acc in re.findall(r"eval: val loss \S+ acc (\S+)%", result.stdout)]
    rows = summary.job_rows(sweep_dir)
    assert [row["linear"] for row in rows] == ["torch", "custom"] and len(printed) == 2
    for row, acc in zip(rows, printed, strict=True):
        assert "error" not in row and row["val/acc"] == pytest.approx(acc, abs=5e-5)
        assert row[summary.EVALUATED_KEY] == str((reference / "best.pt").resolve())
        assert "eval: val loss" in (sweep_dir / row["job"] / "train.log").read_text()
    markdown = (sweep_dir / summary.MARKDOWN_NAME).read_text()
    assert "2 jobs\n" in markdown and "| evaluations of a checkpoint: nothing timed |" in markdown


def test_a_new_run_in_a_used_folder_first_sets_the_earlier_runs_results_aside(tmp_path, monkeypatch):
    # a sweep run again into its hydra.sweep.dir, or a job rerun by hand, starts in a folder an earlier run filled
    train.fit(config.load_config(["trainer.epochs=1"]), tmp_path)
    earlier_files = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    assert {"summary.json", "last.pt", "best.pt", "train.log"} <= set(earlier_files)
    interrupted_run(tmp_path, ["trainer.epochs=3"], at_epoch=1, monkeypatch=monkeypatch)
    # the rerun stopped before its first epoch: the folder says so, and holds no figure of the earlier run
    assert summary.job_error(tmp_path) == logs.NOT_STARTED and not (tmp_path / "summary.json").exists()
    assert not (tmp_path / checkpoint.LAST_NAME).exists()
    assert "this folder held an earlier run: its results are now in" in (tmp_path / "train.log").read_text()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the rerun's own
    (kept,) = (tmp_path / logs.EARLIER_RUNS).iterdir()
    assert {path.name: path.read_bytes() for path in kept.iterdir()} == earlier_files  # all of it, unchanged
    train.fit(config.load_config(["trainer.epochs=1"]), tmp_path)  # and again: the stopped rerun's failed.txt too
    assert sorted(path.name for path in (tmp_path / logs.EARLIER_RUNS).iterdir())[0] == kept.name
    assert len(list((tmp_path / logs.EARLIER_RUNS).iterdir())) == 2
    assert not (tmp_path / summary.JOB_FAILURE_NAME).exists() and summary.read_run_summary(tmp_path)["epochs"] == 1


def test_a_run_stopped_after_its_last_checkpoint_resumes_to_write_its_summary(tmp_path, monkeypatch):
    # Ctrl-C (or a kill) after the last epoch's checkpoint, before the summary: the resume it prints finishes it
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(summary, "write_run_summary", stopped)
        with pytest.raises(KeyboardInterrupt):
            train.fit(config.load_config(["trainer.epochs=2"]), tmp_path)
    state = checkpoint.load(tmp_path)
    assert state["epoch"] == 2 and not (tmp_path / summary.RUN_SUMMARY_NAME).exists()
    assert resume_in_process(tmp_path, []) == state["history"][-1]["val/acc"]
    written = summary.read_run_summary(tmp_path)
    assert written["epochs"] == 2 and written["val/acc"] == state["history"][-1]["val/acc"]
    assert "every epoch was done: writing the run's summary" in (tmp_path / "train.log").read_text()
    with pytest.raises(checkpoint.CheckpointError, match="already finished all 2 epochs"):
        resume_in_process(tmp_path, [])
