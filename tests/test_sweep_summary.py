"""trainer.summary: run summaries, and the sweep summary built from a sweep folder's jobs."""
import csv
import random
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import config, summary, timing

REPO = Path(__file__).resolve().parents[1]


def epoch(val_acc, epoch_s, samples_per_s):
    return {"train/loss": 0.5, "train/acc": 0.8, "val/loss": 0.4, "val/acc": val_acc, "time/epoch_s": epoch_s,
            "time/train_samples_per_s": samples_per_s, "train/lr": 0.001}


def steps(mean_s, epochs=3, per_epoch=200, seed=0):
    """Per-epoch step times around `mean_s`, with 10% noise."""
    rng = random.Random(seed)
    return [[mean_s * rng.uniform(0.9, 1.1) for _ in range(per_epoch)] for _ in range(epochs)]


def make_job(sweep_dir, num, overrides, linear, history, finished=True, error=None, step_times_s=None,
             flop_share=None, conv="torch", conv_share=None, device_type="cpu", autocast=None):
    """A job folder as a Hydra multirun leaves it: .hydra/ files and, if it finished, summary.json; if it
    failed, its failed.txt (a job killed outside our control leaves neither)."""
    job_dir = sweep_dir / f"{num}_job"
    (job_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"linear": {"name": linear}, "conv": {"name": conv}}),
                   job_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": num}}}), job_dir / ".hydra" / "hydra.yaml")
    if finished:
        summary.write_run_summary(job_dir, history, 1000 + num, step_times_s, flop_share, (0,), conv_share,
                                  device_type, autocast)
    elif error:
        summary.write_job_failure(job_dir, error)


def test_run_summary_holds_final_best_and_means(tmp_path):
    run_summary = summary.write_run_summary(tmp_path, [epoch(0.9, 2.0, 100.0), epoch(0.8, 4.0, 50.0)], 1234)
    assert summary.read_run_summary(tmp_path) == run_summary
    assert run_summary["val/acc"] == 0.8 and run_summary["val/acc_best"] == 0.9 and run_summary["epochs"] == 2
    assert run_summary["time/epoch_s_mean"] == 3.0 and run_summary["time/train_samples_per_s_mean"] == 75.0
    assert run_summary["time/epoch_s_min"] == 2.0
    assert run_summary["num_params"] == 1234 and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert set(summary.OBJECTIVES) <= set(run_summary)


def test_sweep_summary_has_a_row_per_job_and_compares_linear_pairs(tmp_path):
    # jobs 0/1 and 2/3 differ only in linear; job 4 has no partner; job 5 failed, job 6 was killed
    make_job(tmp_path, 0, ["linear=torch", "model.hidden_sizes=[64]"], "torch", [epoch(0.90, 2.0, 10.0)],
             step_times_s=steps(0.02, seed=0), flop_share=1.0)
    make_job(tmp_path, 1, ["linear=custom", "model.hidden_sizes=[64]"], "custom", [epoch(0.92, 1.0, 20.0)],
             step_times_s=steps(0.01, seed=1), flop_share=1.0)
    make_job(tmp_path, 2, ["linear=torch", "model.hidden_sizes=[128]"], "torch",
             [epoch(0.95, 3.0, 10.0), epoch(0.95, 3.0, 10.0)], step_times_s=steps(0.02, seed=2), flop_share=1.0)
    make_job(tmp_path, 3, ["linear=custom", "model.hidden_sizes=[128]"], "custom",
             [epoch(0.94, 2.0, 20.0), epoch(0.94, 6.0, 20.0)], step_times_s=steps(0.02, seed=3), flop_share=1.0)
    make_job(tmp_path, 4, ["optim.lr=0.1"], "custom", [epoch(0.5, 1.0, 20.0)])
    make_job(tmp_path, 5, ["optim.lr=9"], "custom", [], finished=False, error="loss became nan in epoch 1")
    make_job(tmp_path, 6, ["optim.lr=8"], "torch", [], finished=False)

    markdown = summary.summarize_sweep(tmp_path)

    with open(tmp_path / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["job"] for row in rows] == ["0_job", "1_job", "2_job", "3_job", "4_job", "5_job", "6_job"]
    assert rows[5]["error"] == "loss became nan in epoch 1" and rows[5]["val_acc"] == ""
    assert rows[6]["error"] == "did not finish (no summary.json)" and rows[4]["error"] == ""
    assert rows[1]["overrides"] == "linear=custom model.hidden_sizes=[64]" and rows[1]["num_params"] == "1001"
    # the speedup comes from the step times (the first epoch left out), with its interval and verdict
    assert float(rows[1]["speedup_vs_torch"]) == pytest.approx(2.0, rel=0.02)
    assert float(rows[1]["speedup_low"]) < float(rows[1]["speedup_vs_torch"]) < float(rows[1]["speedup_high"])
    assert float(rows[1]["speedup_low"]) > 1.9 and rows[1]["verdict"] == "custom is faster"
    assert float(rows[1]["val_acc_diff_points_vs_torch"]) == pytest.approx(2.0)
    assert float(rows[3]["speedup_low"]) < 1 < float(rows[3]["speedup_high"])
    assert rows[3]["verdict"] == "no measurable difference" and rows[3]["linear_flop_share"] == "1.0"
    assert rows[3]["epoch_s_mean"] == "4.0" and rows[3]["epoch_s_min"] == "2.0"
    assert float(rows[3]["val_acc_diff_points_vs_torch"]) == pytest.approx(-1.0)
    assert rows[0]["speedup_vs_torch"] == rows[4]["speedup_vs_torch"] == ""
    assert (tmp_path / "summary.md").read_text() == markdown
    assert "| `model.hidden_sizes=[64]` | 1.99x | 1.98-2.01 | custom is faster | 100% of the FLOPs | +2.00 points |" in markdown
    assert "| no measurable difference | 100% of the FLOPs | -1.00 points |" in markdown
    assert "not a disturbance that lasts a whole job" in markdown and "bench.train" in markdown
    assert markdown.count("_job |") == 7 and "7 jobs, 2 failed" in markdown
    assert "| 5_job | `optim.lr=9` | loss became nan in epoch 1 |" in markdown.split("## Failed jobs")[1]


def test_the_sweep_folder_gets_each_pairs_speedup_curve_for_tensorboard(tmp_path):
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.9, 4.0, 10.0)] * 3, step_times_s=steps(0.02, seed=6))
    make_job(tmp_path, 1, ["linear=custom"], "custom", [epoch(0.9, 2.0, 20.0)] * 3, step_times_s=steps(0.01, seed=7))
    for _ in range(2):  # rewriting the summary rewrites the curve, not a second copy of it
        summary.summarize_sweep(tmp_path)
    (run,) = (tmp_path / "speedup").iterdir()
    assert run.name == "1_job"
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    value, low, high = ([event.value for event in accumulator.Scalars(tag)] for tag in summary.SPEEDUP_TAGS)
    # the epochs the summary's ratio uses: not the first, which warmed the process up
    assert [event.step for event in accumulator.Scalars("time/step_speedup")] == [2, 3]
    assert all(lo < v < hi for v, lo, hi in zip(value, low, high, strict=True)) and all(1.9 < v < 2.1 for v in value)


def curve_epochs(run):
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars("time/step_speedup")]


def test_conv_pairs_get_curves_too_and_no_curve_shows_an_epoch_too_short_to_time(tmp_path):
    make_job(tmp_path, 0, ["conv=torch"], "custom", [epoch(0.9, 4.0, 10.0)] * 2, step_times_s=steps(0.02, 2, seed=6),
             conv="torch")
    make_job(tmp_path, 1, ["conv=custom"], "custom", [epoch(0.9, 2.0, 20.0)] * 2, step_times_s=steps(0.01, 2, seed=7),
             conv="custom")
    # epoch 2: too few steps for an interval; 3: enough of both; 4: 50 steps, but 0.5 s of them (a verdict's
    # "too short to time", and a curve's noise: a digits epoch's 25 ms once read 1.08-1.25x, epoch to epoch)
    few = [[0.1] * 3, [0.1] * (timing.MIN_TIMED_STEPS - 1), [0.1] * timing.MIN_TIMED_STEPS,
           [timing.MIN_TIMED_S / 100] * 50]
    make_job(tmp_path, 2, ["linear=torch", "seed=1"], "torch", [epoch(0.9, 0.1, 10.0)] * 4, step_times_s=few)
    make_job(tmp_path, 3, ["linear=custom", "seed=1"], "custom", [epoch(0.9, 0.1, 10.0)] * 4, step_times_s=few)
    summary.summarize_sweep(tmp_path)
    assert sorted(run.name for run in (tmp_path / "speedup").iterdir()) == ["3_job", "conv_1_job"]
    assert curve_epochs(tmp_path / "speedup" / "conv_1_job") == [2]
    assert curve_epochs(tmp_path / "speedup" / "3_job") == [3]


def test_a_pair_with_too_few_steps_shows_no_interval(tmp_path):
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.9, 5.4, 10.0)], step_times_s=[[5.4]])
    make_job(tmp_path, 1, ["linear=custom"], "custom", [epoch(0.9, 2.4, 20.0)], step_times_s=[[2.4]])
    markdown = summary.summarize_sweep(tmp_path)
    assert "| 2.25x | - | too few steps to time (1 timed step per side, under 20) |" in markdown
    with open(tmp_path / "summary.csv") as file:
        row = list(csv.DictReader(file))[1]
    assert row["speedup_vs_torch"] == "2.2500" and row["speedup_low"] == row["speedup_high"] == ""
    assert not (tmp_path / "speedup").exists() or not any((tmp_path / "speedup").iterdir())  # no curve of a point


def test_a_short_comparison_says_so_and_a_small_flop_share_says_what_it_measured(tmp_path):
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.9, 0.4, 10.0)], step_times_s=steps(0.002, seed=4),
             flop_share=9.2e-6)
    make_job(tmp_path, 1, ["linear=custom"], "custom", [epoch(0.9, 0.2, 20.0)], step_times_s=steps(0.001, seed=5),
             flop_share=9.2e-6)
    markdown = summary.summarize_sweep(tmp_path)
    assert "too short to time (0.4 s of timed steps per side, under 1 s)" in markdown
    assert "0.00092% of the FLOPs: this ratio is not a kernel comparison" in markdown


def test_a_linear_and_conv_sweep_compares_each_choice_with_the_other_held(tmp_path):
    """-m linear=torch,custom conv=torch,custom: two linear pairs (one per conv) and two conv pairs, each with
    the share of the FLOPs its swapped layers do."""
    for num, (linear, conv) in enumerate([("torch", "torch"), ("custom", "torch"), ("torch", "custom"),
                                          ("custom", "custom")]):
        make_job(tmp_path, num, [f"linear={linear}", f"conv={conv}", "model=resnet18"], linear,
                 [epoch(0.9, 2.0, 10.0)] * 2, step_times_s=steps(0.02 if conv == "torch" else 0.01, seed=num),
                 flop_share=9.2e-6, conv=conv, conv_share=0.9999)
    markdown = summary.summarize_sweep(tmp_path)
    linear_part, conv_part = markdown.split("## conv=custom vs conv=torch")
    assert linear_part.count("`conv=torch model=resnet18`") == 1 and linear_part.count("`conv=custom model=resnet18`") == 1
    assert "not a kernel comparison" in linear_part
    assert conv_part.count("`linear=torch model=resnet18`") == 1 and conv_part.count("`linear=custom model=resnet18`") == 1
    assert conv_part.count("2.00x") == 2 or conv_part.count("1.9") + conv_part.count("2.0") >= 2
    assert "100% of the FLOPs" in conv_part and "not a kernel comparison" not in conv_part
    with open(tmp_path / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["conv"] for row in rows] == ["torch", "torch", "custom", "custom"]
    # each custom side carries its own partner's comparison: linear (jobs 1, 3) and conv (jobs 2, 3)
    assert [row["speedup_vs_torch"] != "" for row in rows] == [False, True, False, True]
    assert [row["conv_speedup_vs_torch"] != "" for row in rows] == [False, False, True, True]
    assert float(rows[1]["speedup_low"]) < 1 < float(rows[1]["speedup_high"])  # same conv, same step times
    for row in rows[2:]:  # conv=custom's steps take half the time of conv=torch's
        assert float(row["conv_speedup_vs_torch"]) == pytest.approx(2.0, rel=0.02)
        assert float(row["conv_speedup_low"]) < float(row["conv_speedup_vs_torch"]) < float(row["conv_speedup_high"])
        assert row["conv_verdict"] == "custom is faster" and row["conv_flop_share"] == "0.9999"
        assert float(row["conv_val_acc_diff_points_vs_torch"]) == pytest.approx(0.0)
    assert rows[3]["linear_flop_share"] == "9.2e-06" and rows[2]["linear_flop_share"] == ""


def test_sweep_without_linear_pairs_has_no_comparison(tmp_path):
    make_job(tmp_path, 0, ["optim.lr=0.1"], "custom", [epoch(0.5, 1.0, 20.0)])
    make_job(tmp_path, 1, ["optim.lr=0.2"], "custom", [epoch(0.6, 1.0, 20.0)])
    assert "speedup" not in summary.summarize_sweep(tmp_path)


def test_callback_is_registered_for_every_multirun():
    with config.initialize_config_dir(str(config.CONF_DIR), version_base="1.3"):
        cfg = config.compose("train", return_hydra_config=True)
    assert cfg.hydra.callbacks.sweep_summary._target_ == "trainer.summary.SweepSummary"


def test_objective_must_be_a_summary_value():
    with pytest.raises(config.ConfigError, match="trainer.objective=val/accuracy is invalid"):
        config.validate(config.load_config(["trainer.objective=val/accuracy"]))


def test_command_line_rewrites_a_sweeps_summary(tmp_path, capsys):
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.90, 2.0, 10.0)], step_times_s=steps(0.02))
    make_job(tmp_path, 1, ["linear=custom"], "custom", [epoch(0.92, 1.0, 20.0)], step_times_s=steps(0.02))
    summary.main([str(tmp_path)])
    assert "| (none) | 1.00x |" in capsys.readouterr().out
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "summary.md").is_file()
    with pytest.raises(SystemExit):
        summary.main([str(tmp_path / "0_job")])  # a job folder, not a sweep
    assert "holds no job folders" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main([str(tmp_path / "no_such_sweep")])
    assert f"{tmp_path / 'no_such_sweep'} is not a folder; give a multirun folder" in capsys.readouterr().err
    make_job(tmp_path, 2, ["linear=custom", "optim.lr=9"], "custom", [], finished=False, error="loss became nan")
    with pytest.raises(SystemExit) as ended:  # as a sweep that ends with a failed job: exit code 1, one line
        summary.main([str(tmp_path)])
    assert ended.value.code == 1
    assert capsys.readouterr().err.strip() == f"error: 1 job(s) failed: 2_job (their errors are in {tmp_path / 'summary.md'})"


def test_every_job_folder_counts_whenever_and_however_deep_it_ran(tmp_path):
    make_job(tmp_path, 0, ["optim.lr=0.1"], "custom", [epoch(0.5, 1.0, 20.0)])
    make_job(tmp_path, 1, ["optim.lr=0.2"], "custom", [epoch(0.6, 1.0, 20.0)])
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # newer than the jobs: a sweep run again here, or cp -r
    make_job(tmp_path / "custom", 2, ["optim.lr=0.3"], "custom", [epoch(0.7, 1.0, 20.0)])  # hydra.sweep.subdir nests
    make_job(tmp_path, 3, ["optim.lr=0.4"], "custom", [epoch(0.8, 1.0, 20.0)])
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": "???"}}}), tmp_path / "3_job" / ".hydra" / "hydra.yaml")
    make_job(tmp_path, 4, ["optim.lr=0.5"], "custom", [epoch(0.9, 1.0, 20.0)])
    (tmp_path / "4_job" / "summary.json").write_text('{"val/acc": 0.')  # cut short: a full disk, a copy stopped
    rows = summary.job_rows(tmp_path)
    # a job rerun by hand with hydra.run.dir has no job number: it comes last
    assert [row["job"] for row in rows] == ["0_job", "1_job", "custom/2_job", "4_job", "3_job"]
    assert rows[4]["val/acc"] == 0.8 and rows[2]["val/acc"] == 0.7
    assert rows[3]["error"].startswith("summary.json cannot be read (") and rows[3]["error"].endswith("rerun the job")
    assert "5 jobs, 1 failed" in summary.summarize_sweep(tmp_path)


def test_jobs_a_killed_sweep_never_started_are_listed_as_such(tmp_path):
    # -m linear=torch,custom seed=0,1, killed during its second job: two jobs have no folder at all
    OmegaConf.save(OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["linear=torch,custom", "seed=0,1"]}}}), tmp_path / "multirun.yaml")
    make_job(tmp_path, 0, ["linear=torch", "seed=0"], "torch", [epoch(0.90, 2.0, 10.0)])
    make_job(tmp_path, 1, ["linear=torch", "seed=1"], "torch", [], finished=False)
    rows = summary.job_rows(tmp_path)
    assert [(row["job"], row["overrides"]) for row in rows] == [
        ("0_job", "linear=torch seed=0"), ("1_job", "linear=torch seed=1"),
        ("(linear=custom seed=0)", "linear=custom seed=0"), ("(linear=custom seed=1)", "linear=custom seed=1")]
    assert rows[2]["error"] == rows[3]["error"] == summary.NOT_STARTED
    assert "4 jobs, 3 failed" in summary.summarize_sweep(tmp_path)


def write_multirun_yaml(sweep_dir, task, output_subdir=".hydra"):
    OmegaConf.save(OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "output_subdir": output_subdir, "overrides": {"task": task}}}), sweep_dir / "multirun.yaml")


def test_only_the_latest_sweeps_failures_fail_it(tmp_path, capsys):
    # an earlier sweep into this folder left a failed job; the latest one, -m optim.lr=0.01,0.001, went well
    make_job(tmp_path, 0, ["optim.lr=10"], "custom", [], finished=False, error="loss became nan in epoch 1")
    make_job(tmp_path, 1, ["optim.lr=0.01"], "custom", [epoch(0.9, 1.0, 20.0)])
    make_job(tmp_path, 2, ["optim.lr=0.001"], "custom", [epoch(0.8, 1.0, 20.0)])
    write_multirun_yaml(tmp_path, ["optim.lr=0.01,0.001"])
    summary.end_sweep(tmp_path)  # no SystemExit
    assert "3 jobs, 1 failed" in capsys.readouterr().out  # the earlier failure is still listed
    write_multirun_yaml(tmp_path, ["optim.lr=10,0.01"])
    with pytest.raises(SystemExit):
        summary.end_sweep(tmp_path)
    assert capsys.readouterr().err.startswith("error: 1 job(s) failed: 0_job (")


def test_job_folders_hydra_cannot_show_are_not_called_unstarted(tmp_path):
    # hydra.output_subdir=null: the jobs have no .hydra/ to read, so nothing says which of them ran
    write_multirun_yaml(tmp_path, ["linear=torch,custom"], output_subdir=None)
    assert summary.jobs_not_started(tmp_path, []) == [] and summary.expected_jobs(tmp_path) is None


def test_a_failure_newer_than_a_summary_is_the_jobs_latest_word(tmp_path):
    # a rerun stopped by a bad setting (or a SLURM job cancelled while pending) before it set the earlier run aside
    make_job(tmp_path, 0, ["optim.lr=0.1"], "custom", [epoch(0.9, 1.0, 20.0)])
    assert "error" not in summary.job_rows(tmp_path)[0]
    summary.write_job_failure(tmp_path / "0_job", "optim.lr=-1 is invalid")
    assert summary.job_rows(tmp_path)[0]["error"] == "optim.lr=-1 is invalid"


def test_a_repeated_job_is_named_as_not_compared(tmp_path):
    # -m linear=torch,custom,custom: the pair takes the first custom job; the summary says so of the second
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.90, 2.0, 10.0)], step_times_s=steps(0.02, seed=0))
    for num in (1, 2):
        make_job(tmp_path, num, ["linear=custom"], "custom", [epoch(0.92, 1.0, 20.0)], step_times_s=steps(0.01, seed=num))
    markdown = summary.summarize_sweep(tmp_path)
    assert markdown.count("custom is faster") == 1
    assert "Jobs with the same settings as an earlier job are not compared (each pair takes the first): 2_job (as 1_job)." in markdown


def test_summaries_written_before_step_times_were_recorded_still_summarise(tmp_path):
    for num, linear, epoch_s in ((0, "torch", 2.0), (1, "custom", 1.0)):
        make_job(tmp_path, num, [f"linear={linear}"], linear, [epoch(0.9, epoch_s, 10.0)])  # no step times
    markdown = summary.summarize_sweep(tmp_path)
    assert "| (none) | - | - | no step times recorded (a summary from an older version) | - | +0.00 points |" in markdown
    with open(tmp_path / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert rows[1]["speedup_vs_torch"] == "" and rows[1]["verdict"] == "no step times recorded (a summary from an older version)"


def test_python_m_trainer_summary_rewrites_a_killed_sweeps_summary(tmp_path):
    # the sweep was killed during job 1, then job 1 was rerun by hand: the command brings the summary up to date
    make_job(tmp_path, 0, ["linear=torch"], "torch", [epoch(0.90, 2.0, 10.0)], step_times_s=steps(0.02, seed=0))
    make_job(tmp_path, 1, ["linear=custom"], "custom", [], finished=False)
    assert "2 jobs, 1 failed" in summary.summarize_sweep(tmp_path)
    summary.write_run_summary(tmp_path / "1_job", [epoch(0.92, 1.0, 20.0)], 1001, steps(0.01, seed=1))
    result = subprocess.run([sys.executable, "-m", "trainer.summary", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    markdown = (tmp_path / "summary.md").read_text()
    assert "2 jobs\n" in markdown and "## Failed jobs" not in markdown and "custom is faster" in markdown
    assert result.stdout.strip() == markdown.strip()  # and printed
    with open(tmp_path / "summary.csv") as file:
        assert [row["error"] for row in csv.DictReader(file)] == ["", ""]


@pytest.mark.parametrize("device_type, autocast, noted", [("cpu", "bfloat16", True), ("cpu", None, False),
                                                         ("cuda", "bfloat16", False)])
def test_pairs_under_cpu_autocast_are_noted_as_comparing_precisions(tmp_path, device_type, autocast, noted):
    for num, linear in enumerate(["torch", "custom"]):
        make_job(tmp_path, num, [f"linear={linear}", "trainer.amp=true"], linear, [epoch(0.9, 2.0, 10.0)] * 2,
                 step_times_s=steps(0.02, 2, seed=num), device_type=device_type, autocast=autocast)
    markdown = summary.summarize_sweep(tmp_path)
    note = ("Under trainer.amp on the CPU torch's layers compute in bfloat16 and ours in float32 (ext has no 16-bit "
            "CPU kernels): the speed and accuracy of these pairs compare precisions as well as kernels: 1_job.")
    assert (note in markdown) == noted, markdown
