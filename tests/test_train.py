"""train.py end to end: accuracy on digits, TensorBoard and train.log contents, checkpoints, multirun."""
import csv
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import num_threads
import ext
import models
import train
from trainer import build, checkpoint, config, logs, memory, summary

REPO = Path(__file__).resolve().parents[1]
EPOCH_TAGS = ["train/loss", "train/acc", "val/loss", "val/acc", "time/epoch_s", "time/train_samples_per_s",
              "train/lr"]
EPOCHS = 4


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The default run (MLP on digits) for a few epochs with each linear, from the same seed."""
    runs = {}
    for linear in ("custom", "torch"):
        run_dir = tmp_path_factory.mktemp(linear)
        val_acc = train.fit(config.load_config([f"linear={linear}", f"trainer.epochs={EPOCHS}"]), run_dir)
        runs[linear] = run_dir, val_acc
    return runs


def events(run_dir):
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return accumulator


def test_digits_reaches_90_percent_and_both_linears_agree(digits_runs):
    custom_acc, torch_acc = digits_runs["custom"][1], digits_runs["torch"][1]
    assert custom_acc >= 0.90
    assert abs(custom_acc - torch_acc) <= 0.01


@pytest.mark.parametrize("linear", ["custom", "torch"])
def test_tensorboard_holds_every_tag_once_per_epoch(digits_runs, linear):
    run_dir, val_acc = digits_runs[linear]
    accumulator = events(run_dir)
    assert set(accumulator.Tags()["scalars"]) == {*EPOCH_TAGS, "time/epoch_s_mean"}
    for tag in EPOCH_TAGS:
        assert [event.step for event in accumulator.Scalars(tag)] == list(range(1, EPOCHS + 1)), tag
    assert accumulator.Scalars("val/acc")[-1].value == pytest.approx(val_acc)
    epoch_s = [event.value for event in accumulator.Scalars("time/epoch_s")]
    assert all(value > 0 for value in epoch_s)
    assert accumulator.Scalars("time/epoch_s_mean")[0].value == pytest.approx(sum(epoch_s) / EPOCHS, rel=1e-5)
    lrs = [event.value for event in accumulator.Scalars("train/lr")]
    assert lrs[0] == pytest.approx(1e-3) and lrs == sorted(lrs, reverse=True)  # cosine decay
    assert not [path for path in run_dir.iterdir() if path.is_dir()]  # hparams live in the run's own folder


def test_hparams_dashboard_has_the_runs_choices_and_final_metrics(digits_runs):
    content = events(digits_runs["custom"][0]).PluginTagToContent("hparams")
    # no per-run experiment summary: TensorBoard then unites the hparams of all runs it shows
    assert set(content) == {"_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {key: value.string_value or value.number_value for key, value in start.session_start_info.hparams.items()}
    expected_params = sum(p.numel() for p in models.build_model("mlp", 10, 1, image_size=(8, 8)).parameters())
    assert {key: hparams[key] for key in ("model", "linear", "data", "optimizer", "scheduler")} == {
        "model": "mlp", "linear": "custom", "data": "digits", "optimizer": "AdamW", "scheduler": "CosineAnnealingLR"
    }
    assert hparams["lr"] == 1e-3 and hparams["batch_size"] == "64" and hparams["epochs"] == str(EPOCHS)
    assert hparams["num_params"] == str(expected_params) and hparams["linear_flop_share"] == 1.0  # all in its linears
    assert "model.hidden_sizes" not in hparams  # no command line set it: the same in every run, no column


def test_hparams_add_what_the_command_line_set_readably():
    cfg = config.load_config(["model.hidden_sizes=[64,32]", "linear.fuse_relu=false", "optim=sgd"])
    hparams = logs.hparams_of(cfg, torch.device("cpu"), 1000, 1.0,
                              ["model.hidden_sizes", "linear.fuse_relu", "optim", "trainer.epochs"])
    assert hparams["model.hidden_sizes"] == "[64, 32]" and hparams["linear.fuse_relu"] == "false"
    assert hparams["optimizer"] == "SGD" and "optim" not in hparams  # a group's choice is in the headline
    assert "trainer.epochs" not in hparams and hparams["epochs"] == "20"  # already a headline column
    assert "data.root" not in hparams  # settings nobody set stay out of the table


def test_run_summary_keeps_every_step_time_and_the_flop_share(digits_runs):
    run_summary = summary.read_run_summary(digits_runs["custom"][0])
    steps_per_epoch = 23  # ceil(1,438 training images / batch 64)
    assert [len(epoch) for epoch in run_summary["time/step_s"]] == [steps_per_epoch] * EPOCHS
    assert all(step > 0 for epoch in run_summary["time/step_s"] for step in epoch)
    # the steps account for the epoch (the epoch's own time adds only the loop around them)
    assert sum(run_summary["time/step_s"][-1]) == pytest.approx(run_summary["time/epoch_s"], rel=0.2)
    assert run_summary["linear_flop_share"] == 1.0
    assert run_summary["device"] == "cpu" and run_summary["autocast"] is None  # where it ran, for the sweep's notes


def test_train_log_has_one_line_per_epoch_and_a_summary(digits_runs):
    run_dir, val_acc = digits_runs["custom"]
    text = (run_dir / "train.log").read_text()
    epochs = re.findall(r"epoch (\d+)/\d+: train loss [\d.]+ acc [\d.]+% \| val loss [\d.]+ acc ([\d.]+)%", text)
    assert [int(epoch) for epoch, _ in epochs] == list(range(1, EPOCHS + 1))
    final = re.findall(r"final: val acc ([\d.]+)% \| mean epoch [\d.]+ s, mean step [\d.e+]+ "
                       r"\(95% interval [\d.e+]+-[\d.e+]+\) ms \| (.*)", text)
    assert " final: val acc " in text.splitlines()[-1]  # the log ends with it
    assert len(final) == 1 and float(final[0][0]) == pytest.approx(100 * val_acc, abs=0.005)
    assert final[0][1].startswith("mlp linear=custom on digits | AdamW lr=0.001")
    assert final[0][1].endswith("85,002 parameters | linear layers: 100% of its FLOPs")  # what the swap covers
    if memory.glibc() and not memory.user_chose_malloc():
        assert "malloc: freed memory kept for reuse (trainer/memory.py)" in text  # steps stop faulting pages in


def test_last_checkpoint_holds_the_final_state(digits_runs):
    run_dir, _ = digits_runs["custom"]
    checkpoint = torch.load(run_dir / "last.pt", weights_only=False)
    assert checkpoint["epoch"] == EPOCHS and checkpoint["config"]["linear"]["name"] == "custom"
    plain = models.build_model("mlp", 10, 1, image_size=(8, 8))
    plain.load_state_dict(checkpoint["model"])  # a custom run's weights load into nn.Linear layers
    assert {"optimizer", "scheduler"} <= set(checkpoint) and not list(run_dir.glob("*.tmp"))
    assert "scaler" in checkpoint and checkpoint["scaler"] is None  # AMP's loss scale; none without AMP
    assert set(checkpoint["rng"]) == {"python", "torch", "cuda", "loader"}  # every generator, the data order's too
    # the resolved config: a resume elsewhere (another $LINEAR_LAB_DATA_DIR, say) reads the run's own values
    assert "${" not in repr(checkpoint["config"]) and checkpoint["config"]["data"]["root"].endswith("datasets")


def test_ctrl_c_before_the_first_epoch_marks_the_folder_as_never_trained(tmp_path):
    with pytest.raises(KeyboardInterrupt), logs.reporting_interrupts(tmp_path):
        raise KeyboardInterrupt  # while the data loads, say
    assert (tmp_path / "failed.txt").read_text().strip() == logs.NOT_STARTED
    assert summary.job_error(tmp_path) == logs.NOT_STARTED  # a sweep summary lists it with that reason
    (tmp_path / "failed.txt").unlink()
    (tmp_path / "last.pt").write_bytes(b"an epoch")  # after an epoch the folder keeps training: no mark
    with pytest.raises(KeyboardInterrupt), logs.reporting_interrupts(tmp_path):
        raise KeyboardInterrupt
    assert not (tmp_path / "failed.txt").exists()


def test_save_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"epoch": 1}, path)
    with pytest.raises((pickle.PicklingError, AttributeError), match="[Cc]an.t pickle"):  # as torch.save raises it
        checkpoint.save_atomic({"epoch": 2, "broken": lambda: None}, path)  # lambdas cannot be pickled
    assert torch.load(path)["epoch"] == 1
    checkpoint.save_atomic({"epoch": 3}, path)
    assert torch.load(path)["epoch"] == 3 and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def run_train(args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_single_run_folder_is_dated_and_named_after_its_choices(tmp_path):
    result = run_train(["trainer.epochs=1", "optim.lr=0.002"], cwd=tmp_path)
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", run_dir.parent.name)
    assert re.fullmatch(r"\d\d-\d\d-\d\d\.\d{3}_mlp-custom-digits_optim\.lr=0\.002,trainer\.epochs=1", run_dir.name)
    # the README's list: .hydra/ (config and overrides), train.log, the events, last.pt, best.pt, summary.json
    assert {"train.log", "last.pt", "best.pt", "summary.json", ".hydra"} <= {path.name for path in run_dir.iterdir()}
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").optim.lr == 0.002
    assert list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == ["trainer.epochs=1", "optim.lr=0.002"]
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert "\r" not in result.stderr + result.stdout  # not a terminal: plain lines, no progress bars
    assert re.search(r"^epoch 1/1: train loss", result.stdout, re.MULTILINE)
    # the data says what it is, and how long it took to load, before the first epoch
    assert re.search(r"^loading digits \.\.\.\ndata: digits, 1,438 training and 359 validation images of 1x8x8, "
                     r"10 classes \([\d.]+ s\)$", result.stdout, re.MULTILINE)
    # the malloc setting is for whoever reads the log later, not for the terminal
    assert "malloc:" not in result.stdout + result.stderr and "malloc:" in (run_dir / "train.log").read_text()


def test_multirun_writes_one_folder_per_job(tmp_path):
    result = run_train(["-m", "linear=torch,custom", "trainer.epochs=1"], cwd=tmp_path)
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", sweep_dir.parent.name) and re.fullmatch(r"\d\d-\d\d-\d\d\.\d{3}", sweep_dir.name)
    assert (sweep_dir / "summary.md").read_text() in result.stdout  # the summary is printed too
    with open(sweep_dir / "summary.csv") as file:
        assert [row["job"] for row in csv.DictReader(file)] == [
            "0_mlp-torch-digits_trainer.epochs=1", "1_mlp-custom-digits_trainer.epochs=1"]
    folders = sorted(path.name for path in sweep_dir.iterdir() if path.is_dir())
    job_dirs = ["0_mlp-torch-digits_trainer.epochs=1", "1_mlp-custom-digits_trainer.epochs=1"]
    # and no speedup curve: digits' epochs are too short to time (test_sweep_summary draws curves)
    assert folders == job_dirs and "too short to time" in (sweep_dir / "summary.md").read_text()
    for name in job_dirs:
        assert events(sweep_dir / name).Scalars("val/acc")[0].step == 1


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, capsys, terminal):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    train.fit(config.load_config(["trainer.epochs=1", "linear=torch"]), tmp_path)
    shown = capsys.readouterr().err
    assert ("epoch 1/1" in shown and "img/s" in shown) == terminal


def test_long_run_names_are_cut_with_a_hash_that_keeps_them_distinct():
    overrides = ",".join(f"optim.lr=0.00228811366847552{i},model.dropout=0.1808290128214931{i}" for i in range(4))
    names = {config.run_name("mlp", "custom", "fake", overrides + f",seed={seed}") for seed in (1, 2)}
    assert len(names) == 2
    assert all(len(name.encode()) == config.MAX_RUN_NAME_BYTES and name.startswith("mlp-custom-fake_optim.lr=")
               for name in names)


def test_run_names_are_cut_by_bytes_not_characters_the_same_way_every_time():
    # 200 bytes fit as they are; one more is cut, and a name of 2-byte characters counts its bytes
    fits = config.run_name("mlp", "custom", "fake", "x" * (config.MAX_RUN_NAME_BYTES - len("mlp-custom-fake_")))
    assert len(fits.encode()) == config.MAX_RUN_NAME_BYTES and fits.endswith("x" * 50)
    longer = config.run_name("mlp", "custom", "fake", "x" * (config.MAX_RUN_NAME_BYTES + 1 - len("mlp-custom-fake_")))
    assert len(longer.encode()) == config.MAX_RUN_NAME_BYTES and not longer.endswith("x" * 50)
    accented = "data.root=-" + "é" * 120  # 131 characters, 251 bytes
    whole = f"mlp-custom-fake_{accented}"
    cut = config.run_name("mlp", "custom", "fake", accented)
    assert len(cut.encode()) <= config.MAX_RUN_NAME_BYTES and cut.startswith(whole[:100])
    # a hash of the whole name: the same name every time (Hydra resolves it more than once), distinct tails apart
    assert cut == config.run_name("mlp", "custom", "fake", accented)
    assert cut != config.run_name("mlp", "custom", "fake", accented + "é")


def test_a_run_with_many_overrides_gets_a_folder(tmp_path):
    many = ["optim.lr=0.0022881136684755237", "optim.weight_decay=0.007257005721594277",
            "model.dropout=0.18082901282149316", "model.hidden_sizes=[512,256,128]", "sched=onecycle",
            "trainer.deterministic=true", "data.loader=dataloader", "data.batch_size=128", "trainer.threads=1",
            "seed=12345678"]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "trainer.epochs=1", *many],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert (run_dir / "summary.json").is_file()
    _, name = run_dir.name.split("_", 1)  # after the time: the name, cut to MAX_RUN_NAME_BYTES
    assert len(name.encode()) == config.MAX_RUN_NAME_BYTES and "trainer.threads" not in name
    assert "cpu, 1 thread |" in (run_dir / "train.log").read_text()  # trainer.threads=1 took effect


def test_run_names_stay_single_folders():
    assert config.run_name("mlp", "custom", "digits", "") == "mlp-custom-digits"
    assert config.run_name("mlp", "torch", "fake", "data.image_size=[1,28,28],x=/a/b") == (
        "mlp-torch-fake_data.image_size=[1,28,28],x=-a-b"
    )
    assert re.fullmatch(r"\d\d-\d\d-\d\d\.\d{3}", config.run_time())


def test_run_description_counts_in_words():
    with num_threads(1):
        one = logs.describe(config.load_config(["trainer.epochs=1"]), torch.device("cpu"), 1234)
    with num_threads(2):
        two = logs.describe(config.load_config(["trainer.epochs=2"]), torch.device("cpu"), 1234)
    assert "x 1 epoch |" in one and "cpu, 1 thread |" in one and "1,234 parameters" in one
    assert "x 2 epochs |" in two and "cpu, 2 threads |" in two


def test_correct_count_counts_each_batchs_argmax_against_its_labels():
    count = train.CorrectCount()
    assert count.total() == 0  # an epoch without batches
    batches = [(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])),
               (torch.tensor([[2.0, -1.0]]), torch.tensor([0]))]
    for logits, labels in batches:
        count.add(logits, labels)
    assert count.total() == 3 and isinstance(count.total(), int)


def test_evaluate_reports_the_mean_loss_and_the_accuracy_over_all_batches():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    loader = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in (5, 7, 1)]
    loss, accuracy = train.evaluate(model, loader, torch.device("cpu"))
    with torch.no_grad():
        logits = torch.cat([model(images) for images, _ in loader])
    labels = torch.cat([labels for _, labels in loader])
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    assert accuracy == (logits.argmax(dim=1) == labels).sum().item() / 13


@pytest.mark.parametrize("loss", ["ext", "torch"])
def test_trainer_loss_picks_the_training_steps_loss(loss, monkeypatch):
    calls = {"ext": 0, "torch": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(ext, "cross_entropy", counted("ext", ext.cross_entropy))
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", counted("torch", torch.nn.functional.cross_entropy))
    cfg = config.load_config([f"trainer.loss={loss}"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    loader = [(torch.randn(n, 1, 2, 2), torch.randint(0, 3, (n,))) for n in (5, 7)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train.train_one_epoch(model, loader, optimizer, torch.device("cpu"),
                                  settings=build.step_settings(cfg, torch.device("cpu")))
    assert calls == {"ext": 2 if loss == "ext" else 0, "torch": 2 if loss == "torch" else 0}
    assert math.isfinite(stats.loss)


def test_huge_finite_losses_do_not_overflow_the_epochs_sum(monkeypatch):
    # a diverging run's losses of 1e38 summed in float32 overflowed, and the run stopped on a finite loss
    cross_entropy = ext.cross_entropy
    monkeypatch.setattr(ext, "cross_entropy", lambda logits, labels: cross_entropy(logits, labels) * 0 + 1e38)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    loader = [(torch.randn(8, 1, 2, 2), torch.randint(0, 3, (8,))) for _ in range(4)]
    stats = train.train_one_epoch(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    assert stats.loss == pytest.approx(1e38, rel=1e-6)


def test_a_non_finite_loss_names_the_steps_loss_or_else_the_sums():
    nan, inf = float("nan"), float("inf")
    assert math.isinf(train.non_finite_loss(3, torch.tensor(inf), torch.tensor(inf)).loss)
    # a GPU reads the sum now and then: the step that made it NaN may be an earlier one than this finite one
    assert math.isnan(train.non_finite_loss(3, torch.tensor(2.0), torch.tensor(nan, dtype=torch.float64)).loss)
