"""Checkpoints that survive crashes: atomic writes, everything needed to continue a run exactly, and
one-line errors for files that cannot be used.

A checkpoint is a dict saved with torch.save:
    epoch, global_step      the last complete epoch and the optimizer steps taken so far
    best_val_acc, epoch_times_s, step_times_s, warmup_epochs, history, overridden   what the run's logs and
                            summaries need
    model, optimizer, scheduler, scaler   state_dicts (scaler: the AMP GradScaler's, None without AMP)
    rng                     every random generator training draws from (see rng_state)
    config                  the run's resolved config, as plain containers
"""
import errno
import os
import random
import shlex
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf

LAST_NAME = "last.pt"  # written after every epoch
BEST_NAME = "best.pt"  # written when val/acc improves
ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins (a zip archive)
REQUIRED_KEYS = ("epoch", "global_step", "model", "optimizer", "scheduler", "rng", "config", "best_val_acc",
                 "epoch_times_s", "history")
# Tags renamed since a checkpoint may have been written, so that its history reads as today's.
RENAMED_TAGS = {"lr": "train/lr", "throughput/train_samples_per_s": "time/train_samples_per_s"}
MISMATCHES_SHOWN = 3  # a few mismatched keys name the problem; all of them would bury it
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message says which file and what to do."""


def save_atomic(state, path):
    """torch.save into a temporary file in the same folder, fsync, then rename over `path`.

    A crash at any moment leaves either the previous file or the new one, never a torn one. A full disk
    raises CheckpointError (the previous file is untouched). A failed or interrupted save removes the
    temporary file; one left by a SIGKILL is overwritten by the next save.

    Example:
        >>> save_atomic({"epoch": 3, ...}, Path("outputs/runs/.../last.pt"))
    """
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:  # also Ctrl-C: never leave a half-written file behind
        temporary.unlink(missing_ok=True)
        if disk_full(error):
            then = f"resume with: {resume_command(path.parent)}" if path.exists() else "start the run again"
            kept = "the previous checkpoint is intact" if path.exists() else "no checkpoint was written yet"
            raise CheckpointError(f"disk full while writing {path}; {kept}; free some space, then {then}") from error
        raise
    folder = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def disk_full(error):
    """Whether `error`, or an error it was raised from or while handling, is a full disk (or quota): torch's
    zip writer, told so by the file, raises a RuntimeError of its own ("unexpected pos ...") over it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        error = error.__cause__ or error.__context__
    return False


def training_state(epoch, global_step, model, optimizer, scheduler, scaler, loader_generator, config, **extra):
    """Everything a run needs to continue exactly after `epoch`; `extra` holds the run's own history.

    Example:
        >>> state = training_state(3, 69, model, optimizer, scheduler, scaler, loader.generator, cfg, best_val_acc=0.9)
    """
    return {
        "epoch": epoch,
        "global_step": global_step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,  # AMP's loss scale (float16 only)
        "rng": rng_state(loader_generator),
        "config": OmegaConf.to_container(config, resolve=True),
        **extra,
    }


def restore(state, path, model, optimizer, scheduler, scaler, loader_generator):
    """Load a checkpoint `state` (read from `path`) into freshly built training objects."""
    load_model_state(model, state["model"], path)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"] is not None and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"], loader_generator)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (kill, timeout, a container stopping), taken as a Ctrl-C: the run stops where it is, says
    what it kept and how to resume, and exits with 143 (128 + 15, as a shell reports a SIGTERM)."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextmanager
def terminate_as_interrupt():
    """Within the block a SIGTERM raises Terminated in the main thread, where by default it ends the
    process at once, without a word. Left as it is off the main thread, and where a launcher handles
    SIGTERM itself (submitit's jobs, on SLURM or local)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupts_deferred():
    """Ctrl-C during the block takes effect when it ends, as a KeyboardInterrupt; so does a SIGTERM that
    terminate_as_interrupt turns into one, as Terminated.

    Raised inside torch.save, the interrupt would unwind through its zip writer, whose own error
    ("unexpected pos") replaces it: the run would end with that error and no resume command. A save
    takes well under a second, so waiting for it costs the user nothing and keeps the epoch.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    received = []
    deferred = [signal.SIGINT]
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        deferred.append(signal.SIGTERM)
    previous = {number: signal.signal(number, lambda signum, frame: received.append(signum)) for number in deferred}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if signal.SIGTERM in received:
        raise Terminated
    if received:
        raise KeyboardInterrupt


def save_epoch(state, run_dir, is_best):
    """Write last.pt, and best.pt when `is_best`, into `run_dir`, each atomically; a Ctrl-C meanwhile
    waits until both are written.

    best.pt is a hard link to the new last.pt renamed into place: no second copy of the bytes is written.
    """
    last = Path(run_dir) / LAST_NAME
    with interrupts_deferred():
        save_atomic(state, last)
        if is_best:
            best = last.with_name(BEST_NAME)
            temporary = best.with_name(BEST_NAME + ".tmp")
            temporary.unlink(missing_ok=True)
            os.link(last, temporary)
            os.replace(temporary, best)


def current_history(history):
    """A checkpoint's per-epoch metrics under today's tag names."""
    return [{RENAMED_TAGS.get(tag, tag): value for tag, value in epoch.items()} for epoch in history]


def resume_command(run_dir):
    """The shell command that continues the run in `run_dir`."""
    return f"python train.py {shlex.quote(f'trainer.resume={Path(run_dir).absolute()}')}"


def rng_state(loader_generator):
    """Every generator a training epoch draws from: Python's, torch's CPU and CUDA ones (dropout, init)
    and the training loader's own (the data order). NumPy's global generator is not used in training."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "loader": loader_generator.get_state(),
    }


def restore_rng(state, loader_generator):
    """Put the generators back as rng_state found them."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    loader_generator.set_state(state["loader"])


def find(path):
    """The checkpoint file for `path`: the file itself, or a run folder's last.pt."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / LAST_NAME).is_file() and not (path / ".hydra").is_dir():
            raise CheckpointError(f"trainer.resume={path} is not a run folder (it has no .hydra/); give a run's "
                                  f"folder (outputs/runs/<date>/<time>_<name>) or a .pt file")
        path = path / LAST_NAME
        if not path.is_file():
            raise CheckpointError(f"no {LAST_NAME} in {path.parent}: the run ended before its first checkpoint was "
                                  "written; start the run again")
    elif not path.is_file():
        raise CheckpointError(f"trainer.resume={path}: no such file or folder; give a run folder or a .pt file")
    return path.resolve()


def load(path):
    """Read the checkpoint at `path` (a .pt file or a run folder) onto the CPU; CheckpointError when it is
    unreadable or not a checkpoint of this trainer.

    Example:
        >>> state = load("outputs/runs/2026-11-22/10-00-00.000_mlp-custom-digits")
        >>> state["epoch"], state["config"]["model"]["name"]
    """
    path = find(path)
    with open(path, "rb") as file:
        if file.read(4) != ZIP_MAGIC:
            raise CheckpointError(f"{path} is not a checkpoint (not a file torch.save wrote); give a run folder or "
                                  f"its {LAST_NAME} or {BEST_NAME}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        if "Weights only load failed" in str(error):  # a torch.save file holding code: not ours (and unsafe)
            raise CheckpointError(f"{path} is not a linear-lab checkpoint: it holds Python objects that "
                                  "torch.load(weights_only=True) refuses to run") from error
        reason = " ".join(str(error).split())[:200]
        raise CheckpointError(
            f"{path} is truncated or corrupt ({reason}); resume from another checkpoint (best.pt, an older run)"
        ) from error
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a linear-lab checkpoint (no {', '.join(missing)})")
    return state


def load_model_state(model, model_state, path):
    """load_state_dict, but a checkpoint of another model fails in one line naming a few mismatched keys."""
    expected = model.state_dict()
    mismatches = [f"missing {key}" for key in expected if key not in model_state]
    mismatches += [f"unexpected {key}" for key in model_state if key not in expected]
    mismatches += [
        f"{key} {tuple(model_state[key].shape)} != {tuple(value.shape)}"
        for key, value in expected.items()
        if key in model_state and model_state[key].shape != value.shape
    ]
    if mismatches:
        shown = "; ".join(mismatches[:MISMATCHES_SHOWN]) + ("; ..." if len(mismatches) > MISMATCHES_SHOWN else "")
        raise CheckpointError(
            f"{path} holds another model than its config builds ({len(mismatches)} mismatched keys: {shown}); "
            "resume from a checkpoint of this model"
        )
    model.load_state_dict(model_state)


# What may differ from the checkpoint's config when a run continues: where it runs and which linear layers and
# convolutions compute it (their weights are interchangeable), not what it computes.
RESUME_OVERRIDES = ("trainer.resume", "trainer.eval_only", "trainer.device", "trainer.threads", "trainer.loss",
                    "linear", "conv", "data.root", "data.download", "data.num_workers")


def plain_value(config, key):
    """config's value at the dotted `key`, interpolations resolved, as plain Python (None if absent)."""
    value = OmegaConf.select(config, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def comparable(key, value):
    """The setting or group `value` at `key` without the settings a resume may change: `data=fake
    data.root=/elsewhere` repeats the run's dataset, which only moved."""
    if isinstance(value, dict):
        return {name: comparable(f"{key}.{name}", entry) for name, entry in value.items()
                if f"{key}.{name}" not in RESUME_OVERRIDES}
    return value


def resumed_config(saved, cfg, overridden_keys):
    """The config a resumed run continues with: the checkpoint's own (`saved`), plus settings it predates
    from `cfg`, plus the command line's `overridden_keys` that RESUME_OVERRIDES allows.

    Example:
        >>> resumed_config(state["config"], cfg, ["trainer.resume", "linear"])
    """
    result = OmegaConf.create(saved)
    for key in cfg:  # settings newer than the checkpoint keep their defaults
        if key not in result:
            result[key] = cfg[key]
    result.trainer = OmegaConf.merge(cfg.trainer, result.trainer)
    # Repeating the run's own command line plus trainer.resume changes nothing, so only other values count;
    # a group (data) that differs only by a refused setting inside it (data.train_size) is not named twice.
    changed = [key for key in dict.fromkeys(overridden_keys) if not any(
        key == allowed or key.startswith(f"{allowed}.") for allowed in RESUME_OVERRIDES
    ) and comparable(key, plain_value(cfg, key)) != comparable(key, plain_value(result, key))]
    refused = [key for key in changed if not any(other.startswith(f"{key}.") for other in changed)]
    if refused:
        raise CheckpointError(
            f"{', '.join(refused)} cannot change when resuming: a run continues with its checkpoint's config "
            f"(changeable: {', '.join(RESUME_OVERRIDES)}); start a new run for other settings"
        )
    for key in overridden_keys:
        OmegaConf.update(result, key, OmegaConf.select(cfg, key), merge=False)
    return result
