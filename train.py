"""Train a network on an image dataset with PyTorch's nn.Linear or our own ext.Linear; log to TensorBoard.

    python train.py                                   # MLP on the bundled digits, linear=custom (offline)
    python train.py model=mlp linear=torch            # the same run on nn.Linear
    python train.py model=resnet18 data=cifar10 optim=sgd trainer.epochs=30
    python train.py -m linear=torch,custom            # both, side by side in `tensorboard --logdir outputs`

Each run writes into its own folder: .hydra/ (config), train.log, TensorBoard events, last.pt, best.pt and
summary.json. This file is the run in the order it happens: main -> fit -> train_one_epoch -> evaluate.
The parts it is built from live in trainer/: config (loading and checking), build (device, data, model,
optimizer, switches), distributed (torchrun), checkpoint, logs (train.log, TensorBoard), summary, timing
(step times, speed ratios), memory.
"""
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from torch.nn import functional as F
from tqdm import tqdm

import data
from trainer import checkpoint, memory, summary
from trainer.build import (StepSettings, build_training, flop_shares, make_deterministic, make_loaders,
                           make_model, pick_device, read_dataset, step_settings, threads_per_process,
                           training_module)
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, check_command_line, fail, overridden_keys, resume_arguments, validate
from trainer.distributed import (join_process_group, step_batch_size, summed_over_processes,
                                 torchrun_arguments, world)
from trainer.logs import (describe, describe_data, file_log, log, logging_to, reporting_interrupts,
                          set_aside_earlier_run, tensorboard_writer, write_hparams, write_scalars)
from trainer.timing import StepClock, mean_interval, synchronize, timed_steps

PROGRESS_EVERY_STEPS = 20  # the progress bar reads the loss (a device sync) only this often


class RunStopped(Exception):
    """The run cannot go on; the message says why, what was kept, and what to try."""


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite at `step` of the epoch."""

    def __init__(self, step, loss):
        super().__init__(f"loss {loss} at step {step}")
        self.step, self.loss = step, loss


def non_finite_loss(step, loss, loss_sum):
    """NonFiniteLoss naming this step's loss, or the epoch's sum where this step's is finite (on a GPU the
    sum is read only now and then, so the step that made it NaN or inf may be an earlier one)."""
    value = loss.item()
    return NonFiniteLoss(step, value if not math.isfinite(value) else loss_sum.item())


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    # a with, not a decorator: joblib and submitit pickle main, and a decorator's context manager holds a generator
    with checkpoint.terminate_as_interrupt():
        return run_job(cfg, run_dir)


def run_job(cfg, run_dir):
    """main's work: the run, or a checkpoint's evaluation; its objective, or None where it failed."""
    try:
        validate(cfg)
        torch.set_num_threads(threads_per_process(cfg.trainer.threads))
        sweep_job = HydraConfig.get().mode == RunMode.MULTIRUN
        if cfg.trainer.resume:
            cfg, resumed_dir = resumed_run(cfg)
            if not sweep_job:  # a run continues (or is evaluated) in its own folder; a sweep's job in the job's
                run_dir = resumed_dir
        if cfg.trainer.eval_only:
            return evaluate_checkpoint(cfg, run_dir, record=sweep_job)
        fit(cfg, run_dir)
        if world()[0] > 0:
            return None  # rank 0 reports the run
        return summary.read_run_summary(run_dir)[cfg.trainer.objective]  # what hydra/sweeper=optuna optimises
    except ConfigError as error:
        return job_failed(str(error), 2, run_dir)
    except KeyboardInterrupt as stop:  # fit has said what was kept and how to resume; it stops a whole sweep too
        sys.exit(143 if isinstance(stop, checkpoint.Terminated) else 130)
    except Exception as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(error, (data.DataError, CheckpointError, RunStopped)):
            return job_failed(str(error), 1, run_dir)
        reason = " ".join(str(error).split())
        return job_failed(f"{type(error).__name__}: {reason} (traceback in {Path(run_dir) / 'train.log'})", 1,
                          run_dir)


def job_failed(message, exit_code, run_dir):
    """A single run ends here with `message`. A sweep's job says it too, leaves it in its folder for the sweep
    summary and returns no objective (an Optuna search records a failed trial), so that the other jobs still
    run: exiting would end the whole sweep, and its summary with it. The sweep then exits with 1
    (trainer/summary.py)."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        fail(message, exit_code)
    print(f"error: job {Path(run_dir).name}: {message}", file=sys.stderr, flush=True)
    summary.write_job_failure(run_dir, message)
    return None


def resumed_run(cfg):
    """(config, run folder) for trainer.resume: the checkpoint's config with the command line's allowed
    overrides (checkpoint.RESUME_OVERRIDES), and the folder the checkpoint is in."""
    path = checkpoint.find(cfg.trainer.resume)
    with logging_to(path.parent / "train.log") if world()[0] == 0 else nullcontext():  # a bad file's traceback
        saved = checkpoint.load(path)["config"]
    try:
        cfg = checkpoint.resumed_config(saved, cfg, overridden_keys())
    except CheckpointError as error:  # a setting the command line may not change: a bad setting, exit code 2
        raise ConfigError(str(error)) from error
    validate(cfg)
    return cfg, path.parent


def fit(cfg, run_dir):
    """Train as `cfg` says, writing train.log, TensorBoard events and last.pt into `run_dir`.

    Returns the final validation accuracy. `python train.py` calls it; so can tests and scripts:

    Example:
        >>> from trainer.config import load_config
        >>> fit(load_config(["trainer.epochs=2"]), "outputs/try")
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = join_process_group(pick_device(cfg.trainer.device))
    if cfg.trainer.deterministic:
        make_deterministic(cfg.seed)
    is_main = world()[0] == 0  # under torchrun rank 0 alone writes train.log, events, checkpoints, summary
    resume_path = checkpoint.find(cfg.trainer.resume) if cfg.trainer.resume else None
    resumed = checkpoint.load(resume_path) if resume_path else None
    first_epoch = resumed["epoch"] + 1 if resumed else 1
    # A run stopped after its last epoch's checkpoint but before its summary resumes to write the summary alone.
    if first_epoch > cfg.trainer.epochs and (run_dir / summary.RUN_SUMMARY_NAME).is_file():
        raise CheckpointError(
            f"{resume_path} already finished all {cfg.trainer.epochs} epochs; "
            "evaluate it with trainer.eval_only=true, or start a new run"
        )
    earlier = set_aside_earlier_run(run_dir) if is_main and not resumed else None
    with (
        logging_to(run_dir / "train.log") if is_main else nullcontext(),
        reporting_interrupts(run_dir) if is_main else nullcontext(),
        ExitStack() as closing,
    ):
        if earlier:
            log.info(f"this folder held an earlier run: its results are now in {earlier}")
        log.info(f"loading {cfg.data.name} ...")
        loading_started_s = time.perf_counter()
        dataset = read_dataset(cfg.data)  # before the events file, as the build: a missing dataset or a refused
        # batch size leaves no empty run behind
        log.info(f"data: {describe_data(cfg.data.name, dataset)} ({time.perf_counter() - loading_started_s:.1f} s)")
        model, optimizer, scheduler, train_loader, val_loader = build_training(cfg, dataset, device)
        purge_step = first_epoch if resumed else None
        writer = closing.enter_context(tensorboard_writer(run_dir, purge_step)) if is_main else None
        step_model = training_module(model, cfg, device)
        settings = step_settings(cfg, device)
        num_params = sum(parameter.numel() for parameter in model.parameters())
        shares = flop_shares(cfg, dataset)  # how much of the work linear=custom and conv=custom swap
        flop_share, conv_share = shares["linear"], shares["conv"]
        description = describe(cfg, device, num_params, flop_share, conv_share)
        log.info(f"run: {description}")
        log.info(f"folder: {run_dir}")
        file_log.info(f"malloc: {memory.set_up()}")  # steps stop faulting their tensors in again

        show_progress = is_main and sys.stderr.isatty()  # bars on a terminal; only the epoch lines in logs and CI
        overridden = overridden_keys()  # the settings this run's command line set: HParams columns
        epoch_times_s = []
        step_times_s = []  # each epoch's list of step times, for the interval around a speed ratio
        warmup_epochs = [0]  # the first epoch of each process that trains the run warms up: not timed
        history = []  # each epoch's metrics, for summary.json
        global_step, best_val_acc = 0, -1.0
        if resumed:
            checkpoint.restore(
                resumed, resume_path, model, optimizer, scheduler, settings.scaler, data.order_generator(train_loader)
            )
            global_step, best_val_acc = resumed["global_step"], resumed["best_val_acc"]
            epoch_times_s, history = resumed["epoch_times_s"], checkpoint.current_history(resumed["history"])
            step_times_s = resumed.get("step_times_s", [])  # checkpoints written before step times: none
            warmup_epochs = [*resumed.get("warmup_epochs", [0]), len(step_times_s)]  # this process warms up too
            overridden = resumed.get("overridden", overridden)  # the run's own command line, not the resume's
            log.info(f"resumed after epoch {resumed['epoch']} from {resume_path}")
            if first_epoch > cfg.trainer.epochs:
                log.info("every epoch was done: writing the run's summary, which the stopped run did not")
        val_acc = history[-1]["val/acc"] if history else None
        for epoch in range(first_epoch, cfg.trainer.epochs + 1):
            lr = optimizer.param_groups[0]["lr"]
            try:
                with tqdm(
                    total=len(dataset.train_labels), desc=f"epoch {epoch}/{cfg.trainer.epochs}", unit="img",
                    unit_scale=True, leave=False, disable=not show_progress,
                ) as bar:
                    stats = train_one_epoch(
                        step_model, train_loader, optimizer, device, bar if show_progress else None, settings
                    )
            except NonFiniteLoss as error:
                kept = f"{run_dir / checkpoint.LAST_NAME} keeps epoch {epoch - 1}" if epoch > 1 else "no epoch finished"
                raise RunStopped(
                    f"loss became {error.loss} in epoch {epoch}, step {error.step} (global step "
                    f"{global_step + error.step}); {kept}; try a lower learning rate (optim.lr={cfg.optim.lr / 10:g}) "
                    "in a new run"
                ) from error
            global_step += len(train_loader)
            val_loss, val_acc = evaluate(model, val_loader, device, settings)
            scheduler.step()
            epoch_times_s.append(stats.epoch_s)
            step_times_s.append(stats.step_times_s)

            metrics = {
                "train/loss": stats.loss,
                "train/acc": stats.acc,
                "val/loss": val_loss,
                "val/acc": val_acc,
                "time/epoch_s": stats.epoch_s,
                "time/train_samples_per_s": stats.samples_per_s,
                "train/lr": lr,  # not "lr": the HParams table shows the configured lr under that name
            }
            history.append(metrics)
            if is_main:
                write_scalars(writer, metrics, epoch)  # on disk before the epoch's checkpoint is
            log.info(
                f"epoch {epoch}/{cfg.trainer.epochs}: train loss {stats.loss:.4f} acc {stats.acc:.2%} | "
                f"val loss {val_loss:.4f} acc {val_acc:.2%} | {stats.epoch_s:.3f} s "
                f"{stats.samples_per_s:,.0f} samples/s | lr {lr:.3g}"
            )
            is_best = val_acc > best_val_acc
            best_val_acc = max(best_val_acc, val_acc)
            state = checkpoint.training_state(
                epoch, global_step, model, optimizer, scheduler, settings.scaler, data.order_generator(train_loader), cfg,
                best_val_acc=best_val_acc, epoch_times_s=epoch_times_s, step_times_s=step_times_s, history=history,
                overridden=overridden, warmup_epochs=warmup_epochs,
            )
            if is_main:
                checkpoint.save_epoch(state, run_dir, is_best)

        epoch_s_mean = sum(epoch_times_s) / len(epoch_times_s)
        step_ms = mean_interval(timed_steps(step_times_s, warmup_epochs), scale=1000)
        log.info(f"final: val acc {val_acc:.2%} | mean epoch {epoch_s_mean:.3f} s, mean step {step_ms} ms | "
                 f"{description}")
        if is_main:
            write_scalars(writer, {"time/epoch_s_mean": epoch_s_mean}, cfg.trainer.epochs)
            write_hparams(writer, cfg, device, num_params, flop_share, overridden, conv_share)
            summary.write_run_summary(run_dir, history, num_params, step_times_s, flop_share, warmup_epochs,
                                      conv_share, device.type, settings.autocast_dtype)
    return val_acc


@dataclass
class EpochStats:
    loss: float
    acc: float
    epoch_s: float
    samples_per_s: float
    step_times_s: list  # every step's time, for the interval around a speed ratio (trainer/timing.py)


class CorrectCount:
    """Correct predictions over an epoch: each step keeps its batch's argmax (and its labels), and they are
    compared and counted once, at the end. Three ops a step fewer than comparing, summing and adding each
    batch: the MLP's epoch 0.6% faster (bench/README.md, "Where the MLP step's time goes")."""

    def __init__(self):
        self.predictions, self.labels = [], []

    def add(self, logits, labels):
        self.predictions.append(logits.argmax(dim=1))
        self.labels.append(labels)

    def total(self):
        if not self.predictions:
            return 0
        return int((torch.cat(self.predictions) == torch.cat(self.labels)).sum())


def train_one_epoch(model, loader, optimizer, device, progress=None, settings=None):
    """One pass over `loader` with one optimizer step per batch; returns EpochStats.

    Loss and correct counts accumulate on the device and are read once at the end: reading them every
    step would make the host wait for the device every step. A NaN or infinite loss raises NonFiniteLoss:
    on the CPU (where reading is free) at its step, on a GPU within PROGRESS_EVERY_STEPS steps.
    """
    settings = settings or StepSettings()
    model.train()
    _, world_size = world()
    # float64: summed in float32, a diverging run's finite losses (1e38 and more) overflowed the sum, and the
    # run stopped on a "loss became 1.1e+38" that never became inf
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = CorrectCount()
    num_samples = 0
    # trainer.loss: ext.cross_entropy (one kernel each way, ext/csrc/loss.cpp) by default, for either linear
    loss_function = settings.loss_function()
    synchronize(device)
    start_s = time.perf_counter()
    clock = StepClock(device)
    clock.mark()
    for step, (images, labels) in enumerate(loader, 1):
        images = images.to(device, non_blocking=True, memory_format=settings.memory_format)
        labels = labels.to(device, non_blocking=True)
        with settings.autocast(device.type):
            logits = model(images)
            # this process's mean; an empty share (a last batch smaller than the processes) adds 0, not 0/0,
            # and still runs the backward that DDP's gradient averaging waits for
            batch_loss = loss_function(logits, labels) if len(labels) else logits.sum() * 0
        loss = batch_loss
        if world_size > 1:
            # the mean over the step's whole batch, of which this process holds a part, times world_size
            # since DDP averages the processes' gradients
            loss = batch_loss * (len(labels) * world_size / step_batch_size(len(labels), device))
        optimizer.zero_grad(set_to_none=True)
        settings.scaler.scale(loss).backward()
        settings.scaler.step(optimizer)
        settings.scaler.update()
        loss_sum.add_(batch_loss.detach(), alpha=len(labels))
        correct.add(logits, labels)
        num_samples += len(labels)
        clock.mark()
        # the sum stays NaN/inf once one loss was; a GPU is only asked now and then (each read syncs)
        if (device.type == "cpu" or step % PROGRESS_EVERY_STEPS == 0) and not math.isfinite(loss_sum.item()):
            raise non_finite_loss(step, loss, loss_sum)
        if progress is not None:
            progress.update(len(labels))
            if step % PROGRESS_EVERY_STEPS == 0:
                progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    synchronize(device)
    epoch_s = time.perf_counter() - start_s
    if not math.isfinite(loss_sum.item()):
        raise non_finite_loss(step, loss, loss_sum)
    loss_sum, correct, num_samples = summed_over_processes([loss_sum.item(), correct.total(), num_samples], device)
    return EpochStats(loss_sum / num_samples, correct / num_samples, epoch_s, num_samples / epoch_s,
                      clock.durations_s())


@torch.no_grad()
def evaluate(model, loader, device, settings=None):
    """(mean loss, accuracy) over `loader`."""
    settings = settings or StepSettings()
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = CorrectCount()
    num_samples = 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=settings.memory_format)
        labels = labels.to(device, non_blocking=True)
        with settings.autocast(device.type):
            logits = model(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        correct.add(logits, labels)
        num_samples += len(labels)
    loss_sum, correct, num_samples = summed_over_processes([loss_sum.item(), correct.total(), num_samples], device)
    return loss_sum / num_samples, correct / num_samples


def evaluate_checkpoint(cfg, run_dir, record=False):
    """Evaluate the checkpoint at cfg.trainer.resume on the validation set, log loss and accuracy to the
    terminal and `run_dir`/train.log, and return the accuracy. Trains nothing. With `record` (a sweep's job)
    the figures also go to `run_dir`/summary.json, for the sweep summary.

    Example:
        >>> run = "outputs/runs/..."
        >>> evaluate_checkpoint(load_config(["trainer.eval_only=true", f"trainer.resume={run}"]), run)
    """
    path = checkpoint.find(cfg.trainer.resume)
    device = join_process_group(pick_device(cfg.trainer.device))  # under torchrun each rank evaluates a part
    with logging_to(Path(run_dir) / "train.log") if world()[0] == 0 else nullcontext():
        state = checkpoint.load(path)
        dataset = read_dataset(cfg.data)
        model = make_model(cfg, dataset, device)
        checkpoint.load_model_state(model, state["model"], path)
        _, val_loader = make_loaders(cfg, dataset, device)
        val_loss, val_acc = evaluate(model, val_loader, device)
        log.info(f"eval: val loss {val_loss:.4f} acc {val_acc:.2%} | epoch {state['epoch']} of {path} | "
                 f"linear={cfg.linear.name} conv={cfg.conv.name}")
    if record and world()[0] == 0:
        summary.write_eval_summary(run_dir, val_loss, val_acc, path, state["epoch"])
    return val_acc


if __name__ == "__main__":
    sys.argv[1:] = resume_arguments(sys.argv[1:])
    check_command_line(sys.argv[1:])
    sys.argv += torchrun_arguments(sys.argv[1:])
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
