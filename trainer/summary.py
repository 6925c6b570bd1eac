"""Run summaries and the sweep summary.

Every run writes `summary.json` into its folder when it ends: the final value of every per-epoch tag,
the best val/acc, mean and fastest epoch time, throughput, every step's time, the parameter count and the
share of the network's FLOPs in its linear layers. At the end of every multirun the Hydra callback
`SweepSummary` (registered in conf/hydra/default.yaml) gathers the jobs' summaries into `summary.csv` and
`summary.md` in the sweep folder, one row per job, and compares every pair of jobs that differ only in
`linear`: the speedup of custom over torch with its 95% interval and a verdict (trainer/timing.py), the
share of the work it covers, and the difference in val/acc. It prints the markdown at the end of the sweep.
A job that failed (or was stopped before its first epoch ended) leaves `failed.txt` (its error) instead of
`summary.json`; the other jobs still run, the summary lists it with its error, and the sweep exits with 1.

    python train.py -m linear=torch,custom model.hidden_sizes=[256],[1024]
    # -> outputs/multirun/<date>/<time>/summary.md
"""
import argparse
import csv
import io
import json
import os
import shutil
import sys
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter

from trainer import timing

RUN_SUMMARY_NAME = "summary.json"
JOB_FAILURE_NAME = "failed.txt"
CSV_NAME = "summary.csv"
MARKDOWN_NAME = "summary.md"
STEP_TIMES_KEY = "time/step_s"  # each epoch's list of step times
WARMUP_EPOCHS_KEY = "time/warmup_epochs"  # which of them warmed a process up (timing.timed_steps leaves them out)
SPEEDUP_RUNS = "speedup"  # the sweep folder's TensorBoard runs of custom's speedup over torch, one per pair
SPEEDUP_TAGS = ("time/step_speedup", "time/step_speedup_low", "time/step_speedup_high")  # value, 95% interval
# Below this share of the FLOPs in the linear layers, a custom/torch ratio mostly times the rest of the network.
KERNEL_COMPARISON_MIN_SHARE = 0.5
# summary.json keys a run can report as its result (trainer.objective: what hydra/sweeper=optuna optimises),
# each with the direction in which it improves
OBJECTIVES = {
    "val/acc": "maximize", "val/acc_best": "maximize", "val/loss": "minimize", "train/acc": "maximize",
    "train/loss": "minimize", "time/epoch_s_mean": "minimize", "time/epoch_s_min": "minimize",
    "time/train_samples_per_s_mean": "maximize",
}
EVALUATED_KEY = "evaluated"  # in an evaluation's summary.json: the checkpoint it evaluated
# (column, key in summary.json or job row, format for summary.md)
JOB_COLUMNS = (
    ("job", "job", "{}"),
    ("overrides", "overrides", "{}"),
    ("linear", "linear", "{}"),
    ("conv", "conv", "{}"),
    ("val_acc", "val/acc", "{:.2%}"),
    ("val_acc_best", "val/acc_best", "{:.2%}"),
    ("epoch_s_mean", "time/epoch_s_mean", "{:.3f}"),
    ("epoch_s_min", "time/epoch_s_min", "{:.3f}"),
    ("train_samples_per_s", "time/train_samples_per_s_mean", "{:,.0f}"),
    ("num_params", "num_params", "{:,}"),
)


def write_text_atomic(path, text):
    """Write into a temporary file beside `path`, fsync, then rename: readers see the old or the new text."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def write_run_summary(run_dir, history, num_params, step_times_s=None, linear_flop_share=None, warmup_epochs=(0,),
                      conv_flop_share=None, device_type=None, autocast_dtype=None):
    """summary.json for a finished run, from its per-epoch metrics (a list of {tag: value}, one per epoch),
    each epoch's step times (a list of lists, for the interval around a speed ratio) with the epochs that
    warmed a process up, the shares of the network's FLOPs in its linear layers and its convolutions, and
    where it ran: the device type and the autocast dtype (None: none).

    Example:
        >>> write_run_summary("outputs/try", [{"val/acc": 0.9, "time/epoch_s": 0.5, ...}], 200_000)
    """
    summary = {
        **history[-1],
        "val/acc_best": max(epoch["val/acc"] for epoch in history),
        "time/epoch_s_mean": sum(epoch["time/epoch_s"] for epoch in history) / len(history),
        "time/epoch_s_min": min(epoch["time/epoch_s"] for epoch in history),
        "time/train_samples_per_s_mean": (
            sum(epoch["time/train_samples_per_s"] for epoch in history) / len(history)
        ),
        "num_params": num_params,
        "epochs": len(history),
    }
    if linear_flop_share is not None:
        summary["linear_flop_share"] = linear_flop_share
    if conv_flop_share is not None:
        summary["conv_flop_share"] = conv_flop_share
    if device_type is not None:
        summary["device"] = device_type
        summary["autocast"] = None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch.")
    if step_times_s is not None:
        summary[STEP_TIMES_KEY] = step_times_s
        summary[WARMUP_EPOCHS_KEY] = list(warmup_epochs)
    write_text_atomic(Path(run_dir) / RUN_SUMMARY_NAME, json.dumps(summary, indent=1) + "\n")
    return summary


def write_eval_summary(run_dir, val_loss, val_acc, checkpoint_path, epoch):
    """summary.json for a sweep's job that evaluated a checkpoint (trainer.eval_only): its validation figures
    and which checkpoint, at which epoch, they are of."""
    summary = {"val/loss": val_loss, "val/acc": val_acc, EVALUATED_KEY: str(checkpoint_path), "epochs": epoch}
    write_text_atomic(Path(run_dir) / RUN_SUMMARY_NAME, json.dumps(summary, indent=1) + "\n")


def read_run_summary(run_dir):
    """The dict write_run_summary wrote for `run_dir`."""
    return json.loads((Path(run_dir) / RUN_SUMMARY_NAME).read_text())


def job_results(job_dir):
    """A job's summary.json, or {"error": why it has none} (its failed.txt, killed, or unreadable). A failed.txt
    newer than the summary.json is the job's latest word: a rerun that failed before it set the earlier run
    aside (a bad setting, a SLURM job cancelled while pending)."""
    results, failure = job_dir / RUN_SUMMARY_NAME, job_dir / JOB_FAILURE_NAME
    if not results.is_file() or (failure.is_file() and failure.stat().st_mtime_ns >= results.stat().st_mtime_ns):
        return {"error": job_error(job_dir)}
    try:
        return read_run_summary(job_dir)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return {"error": f"{RUN_SUMMARY_NAME} cannot be read ({error}); rerun the job"}


def write_job_failure(job_dir, message):
    """failed.txt in a sweep job's folder: why the job failed, for the sweep summary."""
    write_text_atomic(Path(job_dir) / JOB_FAILURE_NAME, message + "\n")


def job_error(job_dir):
    """Why a job has no summary.json: its failed.txt, or that it never got to the end (killed)."""
    failure = Path(job_dir) / JOB_FAILURE_NAME
    return failure.read_text().strip() if failure.is_file() else "did not finish (no summary.json)"


def job_rows(sweep_dir):
    """One dict per job folder under `sweep_dir` (any folder with a .hydra/ below it), in job order: its
    summary.json, or "error" if it has none.

    Every job folder there counts, whenever it ran: a job rerun by hand, a sweep run again into the same
    folder, a copy. A rerun in a job's own folder set its earlier results aside (logs.set_aside_earlier_run),
    so a job is never reported with another run's figures.
    """
    sweep_dir = Path(sweep_dir)
    rows = []
    for hydra_dir in job_hydra_dirs(sweep_dir):
        job_dir = hydra_dir.parent
        overrides = OmegaConf.to_container(OmegaConf.load(hydra_dir / "overrides.yaml"))
        config = OmegaConf.load(hydra_dir / "config.yaml")
        num = OmegaConf.select(OmegaConf.load(hydra_dir / "hydra.yaml"), "hydra.job.num", default=None)
        rows.append({
            "num": num if isinstance(num, int) else None,  # a single run (hydra.run.dir) has none
            "job": job_dir.relative_to(sweep_dir).as_posix(), "overrides": " ".join(overrides),
            "override_list": overrides, "linear": config.linear.name,
            "conv": config.get("conv", {}).get("name", "torch"), **job_results(job_dir),
        })
    rows = sorted(rows, key=lambda row: (row["num"] is None, row["num"] or 0, row["job"]))
    return rows + jobs_not_started(sweep_dir, rows)


NOT_STARTED = "did not start (the sweep stopped before it, or has not reached it yet)"


def jobs_not_started(sweep_dir, rows):
    """A row for each job the latest sweep asked for (multirun.yaml: its overrides, through Hydra's own basic
    sweeper) that has no folder: a sweep killed early, still running, or stopped by a failed launch. Other
    sweepers (Optuna) choose their jobs as they go: none are listed."""
    jobs = expected_jobs(sweep_dir)
    if jobs is None:
        return []
    present = {job_key(row["override_list"]) for row in rows}
    return [{"num": None, "job": f"({' '.join(job)})", "overrides": " ".join(job), "override_list": job,
             "linear": "-", "conv": "-", "error": NOT_STARTED} for job in jobs if job_key(job) not in present]


def expected_jobs(sweep_dir):
    """The override lists of the jobs the latest sweep into `sweep_dir` asked for, or None where that cannot be
    known: no multirun.yaml, another sweeper than Hydra's basic one, a glob sweep, or job folders without
    .hydra/ (hydra.output_subdir=null), which job_rows cannot see."""
    try:
        config = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
        if (not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("BasicSweeper")
                or OmegaConf.select(config, "hydra.output_subdir", default=".hydra") is None):
            return None
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
        arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
        (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)
    except Exception:  # no multirun.yaml, or one this cannot expand (a glob sweep): nothing to compare with
        return None
    return jobs


def job_hydra_dirs(sweep_dir):
    """The .hydra/ folders of the jobs below `sweep_dir`, at any depth (hydra.sweep.subdir may nest them)."""
    return sorted(path for path in Path(sweep_dir).glob("**/.hydra")
                  if path.parent != Path(sweep_dir) and (path / "overrides.yaml").is_file())


def job_key(overrides):
    """One key for a job's override list, whatever order its overrides were given in."""
    return tuple(sorted(overrides))


def override_key(override):
    return override.split("=", 1)[0].lstrip("+~")


def choice_pairs(rows, group="linear"):
    """(torch row, custom row) for every two finished jobs whose overrides differ only in `group` (linear or
    conv)."""
    groups = {}
    for row in rows:
        if "error" in row:
            continue
        rest = job_key(o for o in row["override_list"] if override_key(o) != group)
        groups.setdefault(rest, {}).setdefault(row[group], row)
    return [(group["torch"], group["custom"]) for group in groups.values() if {"torch", "custom"} <= set(group)]


def repeated_jobs(rows):
    """(row, first row) for every finished job whose overrides are those of an earlier finished job
    (-m linear=torch,custom,custom): choice_pairs compares the first only."""
    first_with = {}
    repeats = []
    for row in rows:
        if "error" not in row:
            first = first_with.setdefault(job_key(row["override_list"]), row)
            if first is not row:
                repeats.append((row, first))
    return repeats


def speedup(torch_row, custom_row):
    """custom's timing.Speedup over torch from the two jobs' step times (interval and verdict); None for
    summaries written before step times were recorded."""
    if STEP_TIMES_KEY not in torch_row or STEP_TIMES_KEY not in custom_row:
        return None
    torch_steps, custom_steps = (timing.timed_steps(row[STEP_TIMES_KEY], row.get(WARMUP_EPOCHS_KEY, [0]))
                                 for row in (torch_row, custom_row))
    return timing.speedup(torch_steps, custom_steps, sequential=True)  # a sweep's jobs: one after the other


def share_text(share):
    """0.5 -> '50%', 9.2e-06 -> '0.00092%': small shares keep two significant digits."""
    return f"{share:.0%}" if share >= 0.01 else f"{100 * share:.2g}%"


def coverage_note(custom_row, group="linear"):
    """What a pair's ratio can say about the kernel: the share of the network's FLOPs the swapped layers do."""
    share = custom_row.get(f"{group}_flop_share")
    if share is None:
        return "-"
    note = f"{share_text(share)} of the FLOPs"
    if share < KERNEL_COMPARISON_MIN_SHARE:
        note += ": this ratio is not a kernel comparison"
    return note


def others_text(override_list, group="linear"):
    """A pair's overrides besides `group`, as markdown code, or '(none)'."""
    others = " ".join(o for o in override_list if override_key(o) != group)
    return f"`{others}`" if others else "(none)"


def format_or_dash(fmt, value):
    return "-" if value is None else fmt.format(value)


def val_acc_diff_points(torch_row, custom_row):
    return 100 * (custom_row["val/acc"] - torch_row["val/acc"])


# summary.csv's columns for a custom job's comparison with its torch partner: the pairs that differ only in
# linear, then those that differ only in conv (a job of a linear x conv grid can have both partners)
PAIR_CSV_COLUMNS = {
    "linear": ("speedup_vs_torch", "speedup_low", "speedup_high", "verdict", "linear_flop_share",
               "val_acc_diff_points_vs_torch"),
    "conv": ("conv_speedup_vs_torch", "conv_speedup_low", "conv_speedup_high", "conv_verdict", "conv_flop_share",
             "conv_val_acc_diff_points_vs_torch"),
}


def pair_csv_cells(pair, group):
    """PAIR_CSV_COLUMNS[group] for a custom job and its torch partner: speedup, interval, verdict, the share of
    the FLOPs the swapped layers do, and the accuracy difference; empty cells for a job without a partner."""
    if pair is None:
        return [""] * len(PAIR_CSV_COLUMNS[group])
    ratio = speedup(*pair)
    if ratio is None:
        cells = ["", "", "", untimed_reason(*pair)]
    else:  # no interval from too few steps: empty cells, not a point
        bounds = [f"{ratio.low:.4f}", f"{ratio.high:.4f}"] if ratio.has_interval else ["", ""]
        cells = [f"{ratio.value:.4f}", *bounds, ratio.verdict]
    return cells + [pair[1].get(f"{group}_flop_share", ""), f"{val_acc_diff_points(*pair):.2f}"]


def to_csv(rows, pairs_by_group):
    """One line per job; custom jobs with a torch partner also carry the speedup (with its interval and
    verdict), the share of FLOPs it covers and the accuracy difference (PAIR_CSV_COLUMNS), and failed jobs
    their error instead of any figure. pairs_by_group: {"linear": pairs, "conv": pairs} (choice_pairs)."""
    partners = {group: {id(custom): (torch_row, custom) for torch_row, custom in pairs_by_group[group]}
                for group in PAIR_CSV_COLUMNS}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([column for column, _, _ in JOB_COLUMNS] +
                    [column for columns in PAIR_CSV_COLUMNS.values() for column in columns] + ["error"])
    for row in rows:
        cells = [cell for group in PAIR_CSV_COLUMNS for cell in pair_csv_cells(partners[group].get(id(row)), group)]
        writer.writerow([row.get(key, "") for _, key, _ in JOB_COLUMNS] + cells + [row.get("error", "")])
    return out.getvalue()


def markdown_table(header, lines):
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(line) + " |" for line in lines]
    )


def untimed_reason(torch_row, custom_row):
    """Why a pair has no speed ratio (speedup gave None)."""
    if EVALUATED_KEY in torch_row or EVALUATED_KEY in custom_row:
        return "evaluations of a checkpoint: nothing timed"
    return "no step times recorded (a summary from an older version)"


def comparison_cells(torch_row, custom_row, group="linear"):
    ratio = speedup(torch_row, custom_row)
    figures = [f"{ratio.value:.2f}x", ratio.interval_text(), ratio.verdict] if ratio else [
        "-", "-", untimed_reason(torch_row, custom_row)]
    return [others_text(custom_row["override_list"], group), *figures, coverage_note(custom_row, group),
            f"{val_acc_diff_points(torch_row, custom_row):+.2f} points"]


def to_markdown(sweep_dir, rows, pairs, conv_pairs=()):
    finished = [row for row in rows if "error" not in row]
    failed = [row for row in rows if "error" in row]
    jobs = markdown_table(
        [column for column, _, _ in JOB_COLUMNS],
        [[format_or_dash(fmt, row.get(key)) if key != "overrides" else f"`{row[key]}`"
          for _, key, fmt in JOB_COLUMNS]
         for row in finished],
    )
    text = f"# Sweep {sweep_dir}\n\n{len(rows)} jobs" + (f", {len(failed)} failed" if failed else "") + f"\n\n{jobs}\n"
    if failed:
        errors = markdown_table(["job", "overrides", "error"],
                                [[row["job"], f"`{row['overrides']}`", row["error"]] for row in failed])
        text += f"\n## Failed jobs\n\n{errors}\n"
    if pairs:
        comparisons = markdown_table(
            ["overrides besides linear", "speedup custom/torch", "95% interval", "verdict", "linear layers do",
             "val_acc custom - torch"],
            [comparison_cells(torch_row, custom) for torch_row, custom in pairs],
        )
        text += (f"\n## linear=custom vs linear=torch (mean step time ratios)\n\n{comparisons}\n\n"
                 "The interval is a block bootstrap over each job's training steps (the first epoch left out "
                 "where there are more; trainer/timing.py). It covers the noise within the two jobs, not a "
                 "disturbance that lasts a whole job: they ran one after the other or beside other jobs. For a "
                 "fair measurement interleave the two linears' epochs in one process (`python -m bench.train`).\n")
    repeats = repeated_jobs(rows)
    if repeats and (pairs or conv_pairs):
        text += ("\nJobs with the same settings as an earlier job are not compared (each pair takes the first): "
                 + ", ".join(f"{row['job']} (as {first['job']})" for row, first in repeats) + ".\n")
    if conv_pairs:
        comparisons = markdown_table(
            ["overrides besides conv", "speedup custom/torch", "95% interval", "verdict", "convolutions do",
             "val_acc custom - torch"],
            [comparison_cells(torch_row, custom, "conv") for torch_row, custom in conv_pairs],
        )
        text += (f"\n## conv=custom vs conv=torch (mean step time ratios)\n\n{comparisons}\n\n"
                 "The interval is computed as for the linear pairs above, with the same caveat.\n")
    mixed = {custom["job"]: torch_row["autocast"] for torch_row, custom in [*pairs, *conv_pairs]
             if on_cpu_under_autocast(torch_row) and on_cpu_under_autocast(custom)}
    if mixed:
        text += (f"\nUnder trainer.amp on the CPU torch's layers compute in {' or '.join(sorted(set(mixed.values())))}"
                 " and ours in float32 (ext has no 16-bit CPU kernels): the speed and accuracy of these pairs "
                 f"compare precisions as well as kernels: {', '.join(mixed)}.\n")
    return text


def on_cpu_under_autocast(row):
    return row.get("device") == "cpu" and row.get("autocast") is not None


def summarize_sweep(sweep_dir, rows=None):
    """Write summary.csv and summary.md into `sweep_dir` from `rows` (job_rows(sweep_dir) unless given);
    return the markdown.

    Example:
        >>> print(summarize_sweep("outputs/multirun/2026-11-22/10-00-00.000"))
    """
    rows = job_rows(sweep_dir) if rows is None else rows
    pairs = choice_pairs(rows)
    conv_pairs = choice_pairs(rows, "conv")
    markdown = to_markdown(sweep_dir, rows, pairs, conv_pairs)
    write_text_atomic(Path(sweep_dir) / CSV_NAME, to_csv(rows, {"linear": pairs, "conv": conv_pairs}))
    write_text_atomic(Path(sweep_dir) / MARKDOWN_NAME, markdown)
    write_speedup_curves(sweep_dir, pairs, conv_pairs)
    return markdown


def write_speedup_curves(sweep_dir, pairs, conv_pairs=()):
    """For TensorBoard: each pair's speedup of custom over torch, epoch by epoch with its 95% interval, as a
    run of its own in the sweep folder (rewritten whole each time): speedup/<custom job> for a linear pair,
    speedup/conv_<custom job> for a conv pair. Only epochs the summary's ratio uses and its verdict could
    judge: none that warmed a process up, none too short to time (timing.MIN_TIMED_STEPS and MIN_TIMED_S)."""
    folder = Path(sweep_dir) / SPEEDUP_RUNS
    shutil.rmtree(folder, ignore_errors=True)
    for prefix, group_pairs in (("", pairs), ("conv_", conv_pairs)):
        for torch_row, custom_row in group_pairs:
            if STEP_TIMES_KEY not in torch_row or STEP_TIMES_KEY not in custom_row:
                continue
            points = list(epoch_speedups(torch_row, custom_row))
            if not points:  # no epoch long enough to time: no curve
                continue
            with SummaryWriter(folder / f"{prefix}{custom_row['job']}") as writer:
                for epoch, ratio in points:
                    for tag, value in zip(SPEEDUP_TAGS, (ratio.value, ratio.low, ratio.high)):
                        writer.add_scalar(tag, value, epoch)


def epoch_speedups(torch_row, custom_row):
    """(epoch, timing.Speedup) for each epoch both jobs timed, numbered as the runs number them (a run resumed
    from a checkpoint written before step times were recorded has step times for its later epochs only)."""
    count = min(len(torch_row[STEP_TIMES_KEY]), len(custom_row[STEP_TIMES_KEY]))
    first_epoch = custom_row["epochs"] - count + 1
    warm_ups = set()
    for row in (torch_row, custom_row):  # as timing.timed_steps: a job's warm-ups left out if it has other epochs
        cold = set(row.get(WARMUP_EPOCHS_KEY, [0]))
        if set(range(len(row[STEP_TIMES_KEY]))) - cold:
            warm_ups |= {first_epoch + index - len(row[STEP_TIMES_KEY]) + count for index in cold}
    epochs = zip(torch_row[STEP_TIMES_KEY][-count:], custom_row[STEP_TIMES_KEY][-count:])
    for epoch, (torch_steps, custom_steps) in enumerate(epochs, first_epoch):
        ratio = timing.speedup(torch_steps, custom_steps, sequential=True)
        if epoch not in warm_ups and ratio is not None and ratio.is_timed:
            yield epoch, ratio


def main(argv=None):
    """`python -m trainer.summary <sweep folder>`: (re)write its summary.csv and summary.md, and print the markdown."""
    parser = argparse.ArgumentParser(prog="python -m trainer.summary", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun folder, e.g. outputs/multirun/<date>/<time>")
    sweep_dir = parser.parse_args(argv).sweep_dir
    if not sweep_dir.is_dir():
        parser.error(f"{sweep_dir} is not a folder; give a multirun folder, e.g. outputs/multirun/<date>/<time>")
    if not job_hydra_dirs(sweep_dir):
        parser.error(f"{sweep_dir} holds no job folders (<n>_<name>/.hydra/); give a multirun folder")
    end_sweep(sweep_dir)


def end_sweep(sweep_dir):
    """Summarize `sweep_dir`, print the summary, and exit with 1 after one error line if a job of the latest
    sweep into it failed (or did not start)."""
    rows = job_rows(sweep_dir)
    print(summarize_sweep(sweep_dir, rows), flush=True)
    # the latest sweep's jobs decide: an earlier sweep's failed job in this folder is listed, but does not fail it
    latest = expected_jobs(sweep_dir)
    latest = None if latest is None else {job_key(job) for job in latest}
    failed = [row["job"] for row in rows
              if "error" in row and (latest is None or job_key(row["override_list"]) in latest)]
    if failed:
        print(f"error: {len(failed)} job(s) failed: {', '.join(failed)} (their errors are in "
              f"{Path(sweep_dir) / MARKDOWN_NAME})", file=sys.stderr, flush=True)
        sys.exit(1)


class SweepSummary(Callback):
    """Hydra callback: summarize the sweep folder when a multirun ends; exit with 1 if a job failed."""

    def on_multirun_end(self, config, **kwargs):
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            end_sweep(sweep_dir)


if __name__ == "__main__":
    main()
