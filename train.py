"""Train a network on an image dataset with PyTorch's nn.Linear or our own ext.Linear; log to TensorBoard.

    python train.py                                   # MLP on the bundled digits, linear=custom (offline)
    python train.py model=mlp linear=torch            # the same run on nn.Linear
    python train.py model=resnet18 data=cifar10 optim=sgd trainer.epochs=30
    python train.py -m linear=torch,custom            # both, side by side in `tensorboard --logdir outputs`

Each run writes into its own folder: .hydra/ (config), train.log, TensorBoard events and last.pt.
"""
import difflib
import functools
import hashlib
import inspect
import itertools
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams
from tqdm import tqdm

from checkpoint import CheckpointError, save_atomic

import allocator
import checkpoint
import data
import ext  # builds (or loads the cached) operator now, once, before Hydra launches any job
import models
import sweep_summary

log = logging.getLogger("train")

CONF_DIR = Path(__file__).resolve().parent / "conf"
SMALL_INPUT_MAX_PX = 64  # ResNets keep full resolution (3x3 stride-1 stem, no max-pool) up to this size
PROGRESS_EVERY_STEPS = 20  # the progress bar reads the loss (a device sync) only this often


# --- configuration -----------------------------------------------------------------------------------


class ConfigError(Exception):
    """A setting that cannot work; the message names it and what it should be."""


def run_time():
    """Start time with milliseconds, so that runs started in the same second get their own folders."""
    return datetime.now().strftime("%H-%M-%S.%f")[:-3]


# Longest run name: a file name may have 255 bytes, and the time (13) or job number goes before it.
MAX_RUN_NAME_BYTES = 200


def run_name(*parts):
    """Folder name from model, linear, data and the other overrides: mlp-custom-digits_optim.lr=0.01.

    A name too long for a folder (many overrides, an Optuna trial's long floats) keeps its first
    MAX_RUN_NAME_BYTES bytes, ending in a hash of the whole, so that names stay distinct.
    """
    names, overrides = parts[:-1], parts[-1]
    name = "_".join(filter(None, ["-".join(names), overrides.replace("/", "-")]))
    if len(name.encode()) <= MAX_RUN_NAME_BYTES:
        return name
    digest = "~" + hashlib.sha1(name.encode()).hexdigest()[:10]
    kept = name.encode()[:MAX_RUN_NAME_BYTES - len(digest)].decode(errors="ignore")
    return kept + digest


# cached like Hydra's own `now`, so a sweep's jobs all resolve the same time
OmegaConf.register_new_resolver("run_time", run_time, use_cache=True, replace=True)
OmegaConf.register_new_resolver("run_name", run_name, replace=True)
OmegaConf.register_new_resolver("plus_one", lambda value: int(value) + 1, replace=True)  # conf/sched/onecycle.yaml


def load_config(overrides=()):
    """The config `python train.py <overrides>` runs with (without Hydra's own `hydra` node).

    Example:
        >>> cfg = load_config(["model=resnet18", "data=fake", "trainer.epochs=1"])
    """
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


SLURM_LAUNCHERS = ("slurm", "submitit_slurm")  # conf/hydra/launcher/slurm.yaml and the plugin's own


def check_command_line(argv):
    """Compose and validate the config of every job the command line asks for, before Hydra starts.

    A mistake (model=resnet19, trainer.epochs=-1, a misspelt key) then ends in one line and before any
    run folder exists; Hydra's own report of it spans a dozen lines. Choice sweeps (linear=torch,custom)
    are checked job by job; range and glob sweeps are left to validate() in each job.
    """
    flags = [arg for arg in argv if arg.startswith("-")]
    if set(flags) - {"-m", "--multirun"}:  # --cfg, --config-name, ...: Hydra's business
        return
    arguments = [arg for arg in argv if arg not in flags]
    try:
        overrides = OverridesParser.create().parse_overrides(arguments)
    except HydraException as error:  # malformed: say which argument, in one line (Hydra's report spans four)
        for argument in arguments:
            try:
                OverridesParser.create().parse_override(argument)
            except HydraException:
                fail(f"cannot read {argument!r}: write key=value, with lists as key=[a,b] and quotes around "
                     f"values with spaces or commas ({str(error).splitlines()[0].strip()})")
        fail(" ".join(str(error).split()))
    for override in overrides:
        key = override.get_key_element().lstrip("+~")
        if key == "hydra/launcher" and str(override.value()) in SLURM_LAUNCHERS and not shutil.which("sbatch"):
            # the submitit plugin would fail only once it submits, in a long traceback
            fail(f"hydra/launcher={override.value()} submits to a SLURM cluster, and sbatch is not on this "
                 "machine's PATH: run the sweep from a cluster's login node, or drop hydra/launcher to run it here")
        if override.is_add() and not key.startswith("hydra") and key not in known_settings():
            # +trainer.epoch=3 (Hydra's own advice for a misspelt key) adds a setting nothing reads
            fail(unknown_key_message(f"Could not override '{key}'"))
    jobs = []
    for override in overrides:
        if override.is_choice_sweep():
            key = override.get_key_element()
            jobs.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        elif not override.is_sweep_override():
            jobs.append([override.input_line])
    for job_overrides in itertools.product(*jobs):
        try:
            validate(load_config(job_overrides))
        except MissingConfigException as error:
            group, choice = error.missing_cfg_file.rsplit("/", 1)
            fail(f"{group}={choice} is not an option; choose one of: {', '.join(error.options or [])}")
        except HydraException as error:
            fail(unknown_key_message(str(error)) or " ".join(str(error).split("\n")))
        except ConfigError as error:
            fail(str(error))


def unknown_key_message(hydra_message):
    """For Hydra's "Could not override 'trainer.epoch'": the setting that was probably meant. (Hydra's own
    advice, +trainer.epoch=3, adds a key nothing reads: the run would go on as if it were not given.)"""
    match = re.match(r"Could not override '([^']+)'", hydra_message)
    if not match:
        return None
    key = match.group(1)
    guess = difflib.get_close_matches(key, known_settings(), n=1, cutoff=0.6)
    meant = f"; did you mean {guess[0]}?" if guess else ""
    return f"{key} is not a setting{meant} (python train.py --cfg job lists them all)"


@functools.cache
def known_settings():
    """Every setting's dotted name (see config_keys); read once, as it loads every option's file."""
    return tuple(dotted_keys(config_keys()))


def config_keys():
    """The default config as nested dicts, each group's keys merged over all its options (model.dropout is
    mlp's, model.name every model's): every setting some choice of groups reads."""
    config = OmegaConf.to_container(load_config())
    for group in ("model", "linear", "data", "optim", "sched"):
        for option in sorted((CONF_DIR / group).glob("*.yaml")):
            config[group] = {**OmegaConf.to_container(OmegaConf.load(option)), **config[group]}
    return config


def dotted_keys(node, prefix=""):
    """Every key of a nested dict, dotted: ["data", "data.batch_size", ...]."""
    keys = []
    for key, value in node.items():
        keys.append(prefix + key)
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_device(value):
    if value in ("auto", "cpu"):
        return True
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return device.type == "cuda" and torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()


# (key, test, what it must be); every run needs these keys
RULES = (
    ("seed", is_int, "an integer"),
    ("trainer.epochs", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("trainer.device", is_device, "auto, cpu, or a CUDA device present on this machine (cuda, cuda:0, ...)"),
    ("linear.name", lambda v: v in ("torch", "custom"), "torch or custom"),
    ("data.batch_size", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("data.num_workers", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    ("data.loader", lambda v: v in data.LOADER_KINDS, f"one of {', '.join(data.LOADER_KINDS)}"),
    ("optim.lr", lambda v: is_number(v) and 0 < v < math.inf, "a positive number"),
    ("trainer.resume", lambda v: v is None or isinstance(v, str), "a run folder or checkpoint file"),
    ("trainer.eval_only", lambda v: isinstance(v, bool), "true or false"),
    ("trainer.amp", lambda v: isinstance(v, bool), "true or false"),
    ("trainer.compile", lambda v: isinstance(v, bool), "true or false"),
    ("trainer.channels_last", lambda v: isinstance(v, bool), "true or false"),
    ("trainer.deterministic", lambda v: isinstance(v, bool), "true or false"),
    ("trainer.threads", lambda v: v == "auto" or (is_int(v) and v > 0), "auto or a positive integer"),
    ("trainer.objective", lambda v: v in sweep_summary.OBJECTIVES, f"one of {', '.join(sweep_summary.OBJECTIVES)}"),
)
# the same for keys that only some options have (model.hidden_sizes: mlp only)
OPTION_RULES = (
    ("data.val_fraction", lambda v: is_number(v) and 0 < v < 1, "a number between 0 and 1"),
    ("data.train_size", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("data.val_size", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("data.num_classes", lambda v: is_int(v) and v >= 2, "an integer >= 2"),
    (
        "data.image_size",
        lambda v: isinstance(v, ListConfig) and len(v) == 3 and all(is_int(x) and x > 0 for x in v)
        and 1 <= v[0] <= 4,  # FakeData makes its images through PIL: 1 to 4 channels
        "[channels, height, width] with 1 to 4 channels",
    ),
    ("model.hidden_sizes", lambda v: isinstance(v, ListConfig) and all(is_int(x) and x > 0 for x in v),
     "a list of positive integers"),
    ("model.activation", lambda v: v in models.ACTIVATIONS, f"one of {', '.join(models.ACTIVATIONS)}"),
    ("model.dropout", lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("optim.weight_decay", lambda v: is_number(v) and 0 <= v < math.inf, "a number >= 0"),
    ("optim.momentum", lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    # an override reads only true/false as booleans; another word is a string, which would count as true
    ("linear.fuse_relu", lambda v: isinstance(v, bool), "true or false"),
    ("data.download", lambda v: isinstance(v, bool), "true or false"),
)


def validate(cfg):
    """Raise ConfigError naming the first bad setting, before any work is done."""
    absent = object()
    for rules, required in ((RULES, True), (OPTION_RULES, False)):
        for key, test, expected in rules:
            value = OmegaConf.select(cfg, key, default=absent)
            if value is absent:
                if required:
                    raise ConfigError(f"{key} is missing: it must be {expected}")
                continue
            if not test(value):
                shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
                raise ConfigError(f"{key}={shown} is invalid: it must be {expected}")
    if cfg.trainer.eval_only and not cfg.trainer.resume:
        raise ConfigError("trainer.eval_only=true needs trainer.resume=<run folder or checkpoint file>")
    check_targets_take_their_settings(cfg)


def check_targets_take_their_settings(cfg):
    """Refuse a setting that a group's class does not take (+optim.momentum=0.9 with optim=adamw: another
    option has the key), naming what it takes, rather than fail in its constructor after the data loads."""
    for group, node in cfg.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        parameters = inspect.signature(get_object(node._target_)).parameters
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
            continue  # takes any setting (models.build_model passes them on)
        for key in node:
            if not key.startswith("_") and key not in parameters:  # _target_ and Hydra's other keys
                settings = [name for name, parameter in parameters.items()
                            if parameter.default is not inspect.Parameter.empty]
                raise ConfigError(f"{group}.{key} is not a setting of {node._target_}: it takes "
                                  f"{', '.join(settings)}")


def hydra_quoted(path):
    """`path` as a quoted value of a Hydra override: run folders' names hold '=' and ',' (their
    overrides), which the override grammar would read as syntax."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def resume_arguments(argv):
    """The command line with trainer.resume=<path> made safe for Hydra, continuing in the run's own folder.

    Hydra then writes into that folder rather than a new one, and leaves its .hydra/ (the config the run
    started with) as it is. A path that does not exist fails here, before Hydra creates any folder.
    """
    arguments = []
    for argument in argv:
        key, _, value = argument.partition("=")
        if key.lstrip("+") == "trainer.resume" and value not in ("", "null"):
            path = Path(value.strip("'\"")).expanduser().absolute()
            if not path.exists():
                fail(f"trainer.resume={value}: no such file or folder; give a run folder or a .pt file", 1)
            run_dir = path if path.is_dir() else path.parent
            argument = f"{key}={hydra_quoted(path)}"
            arguments += [f"hydra.run.dir={hydra_quoted(run_dir)}", "hydra.output_subdir=null"]
        arguments.append(argument)
    return arguments


def fail(message, exit_code=2):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


# --- building blocks ---------------------------------------------------------------------------------


def pick_device(name):
    """torch.device for trainer.device: "auto" is the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def threads_per_process(setting):
    """torch's thread count for trainer.threads: "auto" shares the cores among the processes that run at
    once on this machine (a parallel launcher's jobs, torchrun's ranks), so they do not oversubscribe."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0))
    n_jobs = OmegaConf.select(HydraConfig.get(), "launcher.n_jobs") if HydraConfig.initialized() else None
    if n_jobs is not None and n_jobs < 0:  # joblib's convention: -1 is all cores, -2 all but one, ...
        n_jobs = max(1, os.cpu_count() + 1 + n_jobs)
    processes = (n_jobs or 1) * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, cores // processes)


# --- several processes, one run: torchrun + DistributedDataParallel ----------------------------------


def world():
    """(rank, number of processes): (0, 1) unless torchrun started this process among others."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def join_process_group(device):
    """Under torchrun with more than one process, join their group: nccl between GPUs, gloo on the CPU.

    Returns the device this process trains on (on GPUs its own, cuda:LOCAL_RANK). torchrun's environment
    (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) says where the others are.
    """
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def torchrun_arguments(argv):
    """Hydra overrides for torchrun's ranks other than 0: no run folder and no console log of their own
    (rank 0 writes the run's folder and prints its log)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and {"-m", "--multirun"} & set(argv):
        fail("torchrun trains one run on several processes; start sweeps (-m) without torchrun")
    if int(os.environ.get("RANK", 0)) == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]


def step_batch_size(local_size, device):
    """The number of samples in this step's batch over all processes (each holds a part of it)."""
    if world()[1] == 1:
        return local_size
    size = torch.tensor(local_size, device=device)
    dist.all_reduce(size)
    return size


def summed_over_processes(values, device):
    """Each of `values` (numbers) summed over all processes: metrics of the whole dataset, not one shard."""
    if world()[1] == 1:
        return values
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return totals.tolist()


def training_module(model, cfg, device):
    """What the training steps call: `model` (in channels_last memory for trainer.channels_last), in
    DistributedDataParallel under torchrun (which averages the processes' gradients), compiled for
    trainer.compile. Checkpoints keep saving `model` itself, so their keys do not change."""
    if cfg.trainer.channels_last:
        model.to(memory_format=torch.channels_last)  # in place
    if world()[1] > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.trainer.compile:
        model = torch.compile(model)
    return model


# --- switches: mixed precision, memory format, determinism --------------------------------------------


@dataclass
class StepSettings:
    """How training and evaluation steps run: under autocast to `autocast_dtype` (None: no autocast), with
    `scaler` (a GradScaler; it scales only for float16) and images in `memory_format`."""

    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    memory_format: torch.memory_format = torch.preserve_format


def step_settings(cfg, device):
    """StepSettings for trainer.amp and trainer.channels_last on `device`.

    AMP is bfloat16 on the CPU and on GPUs that have it; older GPUs get float16, whose small range needs
    the loss scaled (GradScaler). Our op runs in float32 under CPU autocast and in the autocast dtype on GPUs.
    """
    dtype = None
    if cfg.trainer.amp:
        dtype = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    return StepSettings(
        autocast_dtype=dtype,
        scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        memory_format=torch.channels_last if cfg.trainer.channels_last else torch.preserve_format,
    )


def make_deterministic(seed):
    """trainer.deterministic: the same run gives the same bits. Deterministic kernels only (an op without
    one raises), and every generator seeded: Python's, NumPy's and torch's (CPU and CUDA)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with it
    torch.use_deterministic_algorithms(True)  # cuDNN included (torch.backends.cudnn.benchmark stays off)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dataset_options(data_cfg):
    """The data config minus the loader's own settings: what data.load_data takes."""
    loader_keys = ("batch_size", "num_workers", "loader")
    options = OmegaConf.to_container(data_cfg, resolve=True)
    return {key: value for key, value in options.items() if key not in loader_keys}


def read_dataset(data_cfg):
    """data.load_data for the data config; any failure to read it becomes one DataError line."""
    root = Path(data_cfg.root).expanduser()
    if data_cfg.download:  # downloads write into data.root: find out now, not halfway through one
        try:
            root.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=root).close()
        except OSError as error:
            raise data.DataError(
                f"data.root={root} cannot be written ({error.strerror}); set data.root to a writable folder"
            ) from error
    try:
        return data.load_data(**dataset_options(data_cfg))
    except data.DataError:
        raise
    except Exception as error:  # truncated IDX files, bad pickles...: each reader fails its own way
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise data.DataError(
            f"dataset {data_cfg.name} in {root} is corrupt ({reason}); replace its files "
            "(data.download=true fetches fresh ones)"
        ) from error


def make_loaders(cfg, dataset, device):
    """(train, val) loaders; only the training one shuffles, in an order set by the seed. Under torchrun
    each process gets its part of every batch."""
    rank, world_size = world()
    return tuple(
        data.make_loader(
            images, labels, cfg.data.batch_size, shuffle, cfg.data.loader, device, cfg.data.num_workers, cfg.seed,
            rank, world_size,
        )
        for images, labels, shuffle in (
            (dataset.train_images, dataset.train_labels, True),
            (dataset.val_images, dataset.val_labels, False),
        )
    )


def make_model(cfg, dataset, device):
    """Build the network with nn.Linear, then swap in ext.Linear for linear=custom.

    The swap keeps the weights, so for one seed both choices start from identical parameters.
    """
    channels, height, width = dataset.image_shape
    model = instantiate(
        cfg.model,
        num_classes=dataset.num_classes,
        in_channels=channels,
        image_size=(height, width),
        small_input=max(height, width) <= SMALL_INPUT_MAX_PX,
    )
    if cfg.linear.name == "custom":
        model = ext.replace_linears(model, fuse_relu=cfg.linear.fuse_relu)
    return model.to(device)


def build_training(cfg, dataset, device):
    """(model, optimizer, scheduler, train loader, val loader) for `cfg`, all seeded by cfg.seed."""
    torch.manual_seed(cfg.seed)
    train_loader, val_loader = make_loaders(cfg, dataset, device)
    model = make_model(cfg, dataset, device)
    optimizer = instantiate(cfg.optim, params=model.parameters())
    scheduler = instantiate(cfg.sched, optimizer=optimizer)
    return model, optimizer, scheduler, train_loader, val_loader


def synchronize(device):
    """Wait for queued GPU work, so wall-clock times measure the work and not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class EpochStats:
    loss: float
    acc: float
    epoch_s: float
    samples_per_s: float


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite at `step` of the epoch."""

    def __init__(self, step, loss):
        super().__init__(f"loss {loss} at step {step}")
        self.step, self.loss = step, loss


class RunStopped(Exception):
    """The run cannot go on; the message says why, what was kept, and what to try."""


def train_one_epoch(model, loader, optimizer, device, progress=None, settings=None):
    """One pass over `loader` with one optimizer step per batch; returns EpochStats.

    Loss and correct counts accumulate on the device and are read once at the end: reading them every
    step would make the host wait for the device every step. A NaN or infinite loss raises NonFiniteLoss:
    on the CPU (where reading is free) at its step, on a GPU within PROGRESS_EVERY_STEPS steps.
    """
    settings = settings or StepSettings()
    model.train()
    _, world_size = world()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    num_samples = 0
    synchronize(device)
    start_s = time.perf_counter()
    for step, (images, labels) in enumerate(loader, 1):
        images = images.to(device, non_blocking=True, memory_format=settings.memory_format)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, settings.autocast_dtype, enabled=settings.autocast_dtype is not None):
            logits = model(images)
            batch_loss_sum = F.cross_entropy(logits, labels, reduction="sum")
        # the mean over the step's whole batch; under torchrun this process holds a part of it and DDP
        # averages the processes' gradients, hence the factor world_size
        loss = batch_loss_sum / step_batch_size(len(labels), device) * world_size
        optimizer.zero_grad(set_to_none=True)
        settings.scaler.scale(loss).backward()
        settings.scaler.step(optimizer)
        settings.scaler.update()
        loss_sum += batch_loss_sum.detach()
        correct += (logits.argmax(dim=1) == labels).sum()
        num_samples += len(labels)
        # the sum stays NaN/inf once one loss was; a GPU is only asked now and then (each read syncs)
        if (device.type == "cpu" or step % PROGRESS_EVERY_STEPS == 0) and not math.isfinite(loss_sum.item()):
            raise NonFiniteLoss(step, loss.item())
        if progress is not None:
            progress.update(len(labels))
            if step % PROGRESS_EVERY_STEPS == 0:
                progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    synchronize(device)
    epoch_s = time.perf_counter() - start_s
    if not math.isfinite(loss_sum.item()):
        raise NonFiniteLoss(step, loss.item())
    loss_sum, correct, num_samples = summed_over_processes([loss_sum.item(), correct.item(), num_samples], device)
    return EpochStats(loss_sum / num_samples, correct / num_samples, epoch_s, num_samples / epoch_s)


@torch.no_grad()
def evaluate(model, loader, device, settings=None):
    """(mean loss, accuracy) over `loader`."""
    settings = settings or StepSettings()
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    num_samples = 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=settings.memory_format)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, settings.autocast_dtype, enabled=settings.autocast_dtype is not None):
            logits = model(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(dim=1) == labels).sum()
        num_samples += len(labels)
    loss_sum, correct, num_samples = summed_over_processes([loss_sum.item(), correct.item(), num_samples], device)
    return loss_sum / num_samples, correct / num_samples


def class_name(node):
    """AdamW for a config built from `_target_: torch.optim.AdamW`."""
    return node._target_.rsplit(".", 1)[-1]


def counted(count, noun):
    """'1 thread', '2 threads'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def processes_text():
    """' each, 2 processes (gloo)' under torchrun, else ''."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return f" each, {dist.get_world_size()} processes ({dist.get_backend()})"


def describe(cfg, device, num_params):
    """The run in one line: what trains on what, how, and where."""
    return (
        f"{cfg.model.name} linear={cfg.linear.name} on {cfg.data.name} | "
        f"{class_name(cfg.optim)} lr={cfg.optim.lr} {class_name(cfg.sched)} | "
        f"batch {cfg.data.batch_size} x {counted(cfg.trainer.epochs, 'epoch')} | seed {cfg.seed} | "
        f"{device}, {counted(torch.get_num_threads(), 'thread')}{processes_text()} | "
        f"{num_params:,} parameters"
    )


def hparams_of(cfg, device, num_params):
    """The run's settings for TensorBoard's HParams dashboard: the headline choices first, then every
    other setting under its dotted key (lists as text)."""
    headline = {
        "model": cfg.model.name,
        "linear": cfg.linear.name,
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
    in_headline = {"model.name", "linear.name", "data.name", "optim.lr", "data.batch_size", "trainer.epochs",
                   "seed", "trainer.device"}
    others = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif key != "_target_" and name not in in_headline:
                others[name] = value if isinstance(value, (bool, int, float, str)) else str(value)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return headline | others


@contextmanager
def logging_to(path):
    """Copy this module's log lines, with timestamps, into `path` (appending) while the block runs."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    except Exception as error:  # the traceback goes to the file only; the terminal gets main's one line
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, f"error: {error}", None, sys.exc_info()))
        raise
    finally:
        log.removeHandler(handler)
        handler.close()


@contextmanager
def reporting_interrupts(run_dir):
    """On Ctrl-C, say what was kept and the command that resumes, then let the interrupt end the run."""
    try:
        yield
    except KeyboardInterrupt:
        if (run_dir / checkpoint.LAST_NAME).is_file():
            log.info(f"stopped: {run_dir / checkpoint.LAST_NAME} keeps the last complete epoch; "
                     f"resume with: {checkpoint.resume_command(run_dir)}")
        else:
            log.info("stopped before the first epoch ended: nothing to resume")
        raise


# --- the run -----------------------------------------------------------------------------------------


def fit(cfg, run_dir):
    """Train as `cfg` says, writing train.log, TensorBoard events and last.pt into `run_dir`.

    Returns the final validation accuracy. `python train.py` calls it; so can tests and scripts:

    Example:
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
    if first_epoch > cfg.trainer.epochs:
        raise CheckpointError(
            f"{resume_path} already finished all {cfg.trainer.epochs} epochs; "
            "evaluate it with trainer.eval_only=true, or start a new run"
        )
    with (
        logging_to(run_dir / "train.log") if is_main else nullcontext(),
        reporting_interrupts(run_dir),
        ExitStack() as closing,
    ):
        dataset = read_dataset(cfg.data)  # before the events file: a missing dataset leaves no empty run behind
        # purge_step: TensorBoard drops what the interrupted run logged after its checkpoint
        writer = closing.enter_context(
            SummaryWriter(run_dir, purge_step=first_epoch if resumed else None)) if is_main else None
        model, optimizer, scheduler, train_loader, val_loader = build_training(cfg, dataset, device)
        step_model = training_module(model, cfg, device)
        settings = step_settings(cfg, device)
        num_params = sum(parameter.numel() for parameter in model.parameters())
        description = describe(cfg, device, num_params)
        log.info(f"run: {description}")
        log.info(f"folder: {run_dir}")
        log.info(f"malloc: {allocator.set_up()}")  # steps stop faulting their tensors in again

        show_progress = is_main and sys.stderr.isatty()  # bars on a terminal; only the epoch lines in logs and CI
        epoch_times_s = []
        history = []  # each epoch's metrics, for summary.json
        global_step, best_val_acc = 0, -1.0
        if resumed:
            checkpoint.restore(
                resumed, resume_path, model, optimizer, scheduler, settings.scaler, data.order_generator(train_loader)
            )
            global_step, best_val_acc = resumed["global_step"], resumed["best_val_acc"]
            epoch_times_s, history = resumed["epoch_times_s"], resumed["history"]
            log.info(f"resumed after epoch {resumed['epoch']} from {resume_path}")
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

            metrics = {
                "train/loss": stats.loss,
                "train/acc": stats.acc,
                "val/loss": val_loss,
                "val/acc": val_acc,
                "time/epoch_s": stats.epoch_s,
                "throughput/train_samples_per_s": stats.samples_per_s,
                "lr": lr,
            }
            history.append(metrics)
            if is_main:
                for tag, value in metrics.items():
                    writer.add_scalar(tag, value, epoch)
                writer.flush()  # the epoch's events are on disk before its checkpoint is
            log.info(
                f"epoch {epoch}/{cfg.trainer.epochs}: train loss {stats.loss:.4f} acc {stats.acc:.2%} | "
                f"val loss {val_loss:.4f} acc {val_acc:.2%} | {stats.epoch_s:.3f} s "
                f"{stats.samples_per_s:,.0f} samples/s | lr {lr:.3g}"
            )
            is_best = val_acc > best_val_acc
            best_val_acc = max(best_val_acc, val_acc)
            state = checkpoint.training_state(
                epoch, global_step, model, optimizer, scheduler, settings.scaler, data.order_generator(train_loader), cfg,
                best_val_acc=best_val_acc, epoch_times_s=epoch_times_s, history=history,
            )
            if is_main:
                checkpoint.save_epoch(state, run_dir, is_best)

        epoch_s_mean = sum(epoch_times_s) / len(epoch_times_s)
        log.info(f"final: val acc {val_acc:.2%} | mean epoch {epoch_s_mean:.3f} s | {description}")
        if is_main:
            writer.add_scalar("time/epoch_s_mean", epoch_s_mean, cfg.trainer.epochs)
            # Only the session's hparams, no per-run "experiment": TensorBoard then builds the HParams table
            # from every run's hparams (runs of different models have different keys) and shows each scalar
            # tag's last value as a metric column: final val/acc, time/epoch_s_mean, ...
            _, session_start, session_end = hparams(hparams_of(cfg, device, num_params), {})
            writer.file_writer.add_summary(session_start)
            writer.file_writer.add_summary(session_end)
            sweep_summary.write_run_summary(run_dir, history, num_params)
    return val_acc


def evaluate_checkpoint(cfg, run_dir):
    """Evaluate the checkpoint at cfg.trainer.resume on the validation set, log loss and accuracy to the
    terminal and `run_dir`/train.log, and return the accuracy. Trains nothing.

    Example:
        >>> evaluate_checkpoint(load_config(["trainer.eval_only=true", "trainer.resume=outputs/runs/..."]), "outputs/runs/...")
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
                 f"linear={cfg.linear.name}")
    return val_acc


def resumed_run(cfg):
    """(config, run folder) for trainer.resume: the checkpoint's config with the command line's allowed
    overrides (checkpoint.RESUME_OVERRIDES), and the folder the checkpoint is in."""
    path = checkpoint.find(cfg.trainer.resume)
    overridden = [override.split("=", 1)[0].lstrip("+~") for override in HydraConfig.get().overrides.task]
    saved = checkpoint.load(path)["config"]
    try:
        cfg = checkpoint.resumed_config(saved, cfg, overridden)
    except CheckpointError as error:  # a setting the command line may not change: a bad setting, exit code 2
        raise ConfigError(str(error)) from error
    validate(cfg)
    return cfg, path.parent


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        validate(cfg)
        torch.set_num_threads(threads_per_process(cfg.trainer.threads))
        if cfg.trainer.resume:
            cfg, run_dir = resumed_run(cfg)
        if cfg.trainer.eval_only:
            return evaluate_checkpoint(cfg, run_dir)
        fit(cfg, run_dir)
        if world()[0] > 0:
            return None  # rank 0 reports the run
        return sweep_summary.read_run_summary(run_dir)[cfg.trainer.objective]  # what hydra/sweeper=optuna optimises
    except ConfigError as error:
        return job_failed(str(error), 2, run_dir)
    except KeyboardInterrupt:
        sys.exit(130)  # fit has said what was kept and how to resume; Ctrl-C stops a whole sweep too
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
    (sweep_summary.py)."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        fail(message, exit_code)
    print(f"error: job {Path(run_dir).name}: {message}", file=sys.stderr, flush=True)
    sweep_summary.write_job_failure(run_dir, message)
    return None


if __name__ == "__main__":
    sys.argv[1:] = resume_arguments(sys.argv[1:])
    check_command_line(sys.argv[1:])
    sys.argv += torchrun_arguments(sys.argv[1:])
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
