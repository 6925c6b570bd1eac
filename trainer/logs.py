"""What a run tells: its one-line description, its TensorBoard scalars and hyperparameters (the HParams
dashboard), and train.log (the console's lines with timestamps, plus tracebacks and lines for the file alone)."""
import logging
import sys
import time
from contextlib import contextmanager

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from trainer import checkpoint, summary
from trainer.distributed import processes_text

log = logging.getLogger("train")
file_log = logging.getLogger("train.file")  # train.log only, not the terminal
file_log.propagate = False
NOT_STARTED = "stopped (Ctrl-C) before the first epoch ended: nothing was trained"
NOT_STARTED_BY_SIGTERM = NOT_STARTED.replace("Ctrl-C", "SIGTERM")
EARLIER_RUNS = "earlier"  # where a new run in a used folder puts the earlier run's results


def set_aside_earlier_run(run_dir):
    """A new run in a folder that holds an earlier run's results (a sweep run again into its hydra.sweep.dir,
    a job rerun by hand) moves them into earlier/<their time>/ first: kept, and never read as the new run's
    (its summary.json would make a rerun stopped early count as finished, with the earlier figures; its
    events would put each epoch twice on the curves). Returns that folder, or None."""
    names = (summary.RUN_SUMMARY_NAME, summary.JOB_FAILURE_NAME, checkpoint.LAST_NAME, checkpoint.BEST_NAME,
             "train.log")
    results = [run_dir / name for name in names if (run_dir / name).is_file()]
    results += sorted(run_dir.glob("events.out.tfevents.*"))
    if not results:
        return None
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(max(path.stat().st_mtime for path in results)))
    destination, copy = run_dir / EARLIER_RUNS / stamp, 1
    while destination.exists():
        copy += 1
        destination = run_dir / EARLIER_RUNS / f"{stamp}_{copy}"
    destination.mkdir(parents=True)
    for path in results:
        path.rename(destination / path.name)
    return destination


def class_name(node):
    """AdamW for a config built from `_target_: torch.optim.AdamW`."""
    return node._target_.rsplit(".", 1)[-1]


def counted(count, noun):
    """'1 thread', '2 threads'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def describe(cfg, device, num_params, flop_share=None, conv_share=None):
    """The run in one line: what trains on what, how, and where, and (given `flop_share`, and `conv_share` for
    a network with convolutions) how much of the network's work the linear layers and the convolutions do."""
    coverage = f" | linear layers: {summary.share_text(flop_share)} of its FLOPs" if flop_share is not None else ""
    if conv_share:
        coverage += f", convolutions: {summary.share_text(conv_share)}"
    # The conv choice where it matters: a network with convolutions, or conv=custom asked for.
    conv = f" conv={cfg.conv.name}" if conv_share or cfg.conv.name != "torch" else ""
    return (
        f"{cfg.model.name} linear={cfg.linear.name}{conv} on {cfg.data.name} | "
        f"{class_name(cfg.optim)} lr={cfg.optim.lr} {class_name(cfg.sched)} | "
        f"batch {cfg.data.batch_size} x {counted(cfg.trainer.epochs, 'epoch')} | seed {cfg.seed} | "
        f"{device}, {counted(torch.get_num_threads(), 'thread')}{processes_text()} | "
        f"{num_params:,} parameters{coverage}"
    )


def describe_data(name, dataset):
    """'digits, 1,438 training and 359 validation images of 1x8x8, 10 classes'."""
    shape = "x".join(str(size) for size in dataset.image_shape)
    return (f"{name}, {len(dataset.train_labels):,} training and {len(dataset.val_labels):,} validation images of "
            f"{shape}, {dataset.num_classes} classes")


def hparams_of(cfg, device, num_params, flop_share=None, overridden=(), conv_share=None):
    """The run's settings for TensorBoard's HParams dashboard: the headline choices, then each setting the
    command line set (`overridden`, dotted keys: what a sweep varies). Every other setting is the same in
    every run of a sweep, and as columns would push the metrics off-screen. Booleans show as true/false and
    integers as their digits (TensorBoard shows every number with four decimals: 0.0000, 64.0000), lists as
    text; TensorBoard then gives each of these a discrete domain of the values the runs have."""
    headline = {
        "model": cfg.model.name,
        "linear": cfg.linear.name,
        "conv": cfg.conv.name,
        "data": cfg.data.name,
        "optimizer": class_name(cfg.optim),
        "scheduler": class_name(cfg.sched),
        "lr": cfg.optim.lr,
        "batch_size": cfg.data.batch_size,
        "epochs": cfg.trainer.epochs,
        "seed": cfg.seed,
        "device": str(device),
        "num_params": num_params,
    }
    headline = {key: readable(value) for key, value in headline.items()}
    if flop_share is not None:
        headline["linear_flop_share"] = flop_share
    if conv_share is not None:
        headline["conv_flop_share"] = conv_share
    in_headline = {"model.name", "linear.name", "conv.name", "data.name", "optim.lr", "data.batch_size", "trainer.epochs",
                   "seed", "trainer.device"}
    chosen = {}
    for key in overridden:
        value = OmegaConf.select(cfg, key, default=None)
        if key in in_headline or isinstance(value, DictConfig) or value is None:  # a group's choice: in the headline
            continue
        if isinstance(value, ListConfig):
            value = str(OmegaConf.to_container(value))
        chosen[key] = readable(value)
    return headline | chosen


def readable(value):
    """A setting as the HParams table should show it: true/false, digits for integers, numbers as numbers."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, int) else value


# TensorBoard's Custom Scalars dashboard: the headline curves of every run shown, one chart each, and a
# sweep's speedup of custom over torch with its interval, epoch by epoch (trainer/summary.py writes it).
COMPARISON_LAYOUT = {"torch vs custom": {
    **{tag: ["Multiline", [f"^{tag}$"]] for tag in ("val/acc", "train/loss", "time/epoch_s")},
    "custom's speedup over torch (95% interval)": ["Margin", list(summary.SPEEDUP_TAGS)],
}}


def tensorboard_writer(run_dir, purge_step=None):
    """The run's TensorBoard writer, with the comparison layout. purge_step (a resumed run's first epoch):
    TensorBoard drops what the interrupted run logged from that step on, after its checkpoint."""
    writer = SummaryWriter(run_dir, purge_step=purge_step)
    writer.add_custom_scalars(COMPARISON_LAYOUT)
    return writer


def write_scalars(writer, scalars, step):
    """Each of `scalars` ({tag: value}) at `step`, flushed: on disk before anything that follows."""
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)
    writer.flush()


def write_hparams(writer, cfg, device, num_params, flop_share=None, overridden=(), conv_share=None):
    """The run's settings to the HParams dashboard. Only the session's hparams, no per-run "experiment":
    TensorBoard then builds the table from every run's hparams (runs of different models have different
    keys) and shows each scalar tag's last value as a metric column: final val/acc, time/epoch_s_mean, ..."""
    _, session_start, session_end = hparams(hparams_of(cfg, device, num_params, flop_share, overridden, conv_share), {})
    writer.file_writer.add_summary(session_start)
    writer.file_writer.add_summary(session_end)


@contextmanager
def logging_to(path):
    """Copy `log`'s lines, with timestamps, into `path` (appending) while the block runs; `file_log`'s go
    there alone."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    for logger in (log, file_log):
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    except Exception as error:  # the traceback goes to the file only; the terminal gets main's one line
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, f"error: {error}", None, sys.exc_info()))
        raise
    finally:
        for logger in (log, file_log):
            logger.removeHandler(handler)
        handler.close()


@contextmanager
def reporting_interrupts(run_dir):
    """On Ctrl-C (or a SIGTERM, checkpoint.Terminated), say what was kept and the command that resumes, then
    let the interrupt end the run. A run stopped before its first epoch ended leaves failed.txt saying so: its
    folder holds no training."""
    try:
        yield
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, checkpoint.Terminated)
        stopped = "stopped by SIGTERM" if terminated else "stopped"
        if (run_dir / checkpoint.LAST_NAME).is_file():
            log.info(f"{stopped}: {run_dir / checkpoint.LAST_NAME} keeps the last complete epoch; "
                     f"resume with: {checkpoint.resume_command(run_dir)}")
        else:  # the folder holds no training: marked so, for the user and the sweep summary
            summary.write_job_failure(run_dir, NOT_STARTED_BY_SIGTERM if terminated else NOT_STARTED)
            log.info(f"{stopped} before the first epoch ended: nothing to resume "
                     f"({summary.JOB_FAILURE_NAME} says so)")
        raise
