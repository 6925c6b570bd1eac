"""A run's parts, built from its config: device and threads, data, model, optimizer and scheduler, and the
switches that change how steps run (AMP, channels_last, torch.compile, determinism)."""
import contextlib
import logging
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

import data
import ext  # builds (or loads the cached) operator now, once, before Hydra launches any job
from trainer.config import ConfigError
from trainer.distributed import syncs_batchnorm, world

log = logging.getLogger("train")

SMALL_INPUT_MAX_PX = 64  # ResNets keep full resolution (3x3 stride-1 stem, no max-pool) up to this size


def pick_device(name):
    """torch.device for trainer.device: "auto" is the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def threads_per_process(setting):
    """torch's thread count for trainer.threads: "auto" shares the cores this process may use (in a SLURM job,
    the CPUs the job was given) among the processes that run at once on this machine (a parallel launcher's
    jobs, torchrun's ranks), so they do not oversubscribe."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0))
    if "SLURM_CPUS_PER_TASK" in os.environ:  # a SLURM job: its CPUs, also where the cluster does not pin them
        cores = min(cores, int(os.environ["SLURM_CPUS_PER_TASK"]))
    n_jobs = OmegaConf.select(HydraConfig.get(), "launcher.n_jobs") if HydraConfig.initialized() else None
    if n_jobs is not None and n_jobs < 0:  # joblib's convention: -1 is all cores, -2 all but one, ...
        n_jobs = max(1, os.cpu_count() + 1 + n_jobs)
    processes = (n_jobs or 1) * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, cores // processes)


def training_module(model, cfg, device):
    """What the training steps call: `model` (in channels_last memory for trainer.channels_last), in
    DistributedDataParallel under torchrun (which averages the processes' gradients), compiled for
    trainer.compile. Checkpoints keep saving `model` itself, so their keys do not change."""
    if cfg.trainer.channels_last:
        model.to(memory_format=torch.channels_last)  # in place
    if syncs_batchnorm(device):
        # BatchNorm over the whole batch, as one process has it: the same steps. The layers below `model` are
        # swapped in place and keep their parameters and buffers: the optimizer's, and the checkpoints' keys.
        nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if world()[1] > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.trainer.compile:
        model = torch.compile(model)
    return model


@dataclass
class StepSettings:
    """How training and evaluation steps run: under autocast to `autocast_dtype` (None: no autocast), with
    `scaler` (a GradScaler; it scales only for float16), images in `memory_format`, and the training step's
    loss (`loss`: "ext", ext.cross_entropy, or "torch", F.cross_entropy)."""

    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    memory_format: torch.memory_format = torch.preserve_format
    loss: str = "ext"

    def loss_function(self):
        """trainer.loss's function, looked up now (so that a test's or user's patch of it applies)."""
        return ext.cross_entropy if self.loss == "ext" else torch.nn.functional.cross_entropy

    def autocast(self, device_type):
        """The forward's context: autocast to autocast_dtype, or nothing. Entering a disabled
        torch.autocast costs 2.9 us a step (a nullcontext 0.1), with the same effect outside autocast."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, self.autocast_dtype)


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
        loss=cfg.trainer.get("loss", "ext"),
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
        if isinstance(error, MemoryError) or "can't allocate memory" in str(error):  # torch's CPU allocator
            raise data.DataError(
                f"dataset {data_cfg.name} does not fit in memory ({reason}); make it smaller (data.train_size, "
                "data.val_size, data.image_size)") from error
        raise data.DataError(
            f"dataset {data_cfg.name} in {root} is corrupt ({reason}); replace its files "
            "(data.download=true fetches fresh ones)"
        ) from error


def make_loaders(cfg, dataset, device, min_train_batch=1):
    """(train, val) loaders; only the training one shuffles, in an order set by the seed. Under torchrun
    each process gets its part of every batch. A last training batch of fewer than `min_train_batch`
    samples joins the one before it; validation batches stay as cut (BatchNorm in eval mode takes 1 sample)."""
    rank, world_size = world()
    return tuple(
        data.make_loader(
            images, labels, cfg.data.batch_size, shuffle, cfg.data.loader, device, cfg.data.num_workers, cfg.seed,
            rank, world_size, min_last_batch,
        )
        for images, labels, shuffle, min_last_batch in (
            (dataset.train_images, dataset.train_labels, True, min_train_batch),
            (dataset.val_images, dataset.val_labels, False, 1),
        )
    )


def min_training_batch(model, device):
    """The fewest samples a training step may give `model`: 1, but 2 for a model with BatchNorm, which cannot
    train on one sample (torch raises at a 1x1 map), and 2 per process under torchrun on CPUs, where each
    process normalizes its own share (trainer.distributed.syncs_batchnorm)."""
    if not any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        return 1
    return 2 if syncs_batchnorm(device) else 2 * world()[1]


def check_batch_size(cfg, num_samples, min_batch):
    """Refuse a data.batch_size (or a training set) that would give the model's BatchNorm too few samples in
    every step: only a last, smaller batch can join the one before it."""
    if min(cfg.data.batch_size, num_samples) >= min_batch:
        return
    processes = world()[1]
    need = "2 samples a step"
    if min_batch > 2:
        need += f" on each of the {processes} processes (on CPUs each normalizes its own share)"
    if cfg.data.batch_size < min_batch:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is too small: model={cfg.model.name}'s BatchNorm "
                          f"needs {need}; set data.batch_size to {min_batch} or more")
    raise ConfigError(f"{num_samples} training samples are too few: model={cfg.model.name}'s BatchNorm needs {need}; "
                      f"use a dataset of {min_batch} or more")


def network(cfg, dataset):
    """The network `cfg.model` names, sized for `dataset`, with nn.Linear layers."""
    channels, height, width = dataset.image_shape
    return instantiate(
        cfg.model,
        num_classes=dataset.num_classes,
        in_channels=channels,
        image_size=(height, width),
        small_input=max(height, width) <= SMALL_INPUT_MAX_PX,
    )


def make_model(cfg, dataset, device):
    """Build the network with torch's layers, then swap in ext.Linear for linear=custom and ext.Conv2d for
    conv=custom.

    The swap keeps the weights, so for one seed both choices start from identical parameters.
    """
    model = network(cfg, dataset)
    if cfg.linear.name == "custom":
        model = ext.replace_linears(model, fuse_relu=cfg.linear.fuse_relu)
    if cfg.conv.name == "custom":
        left = ext.replace_convs(model)
        if left:
            log.info(f"conv=custom: {len(left)} convolution(s) stay torch's: {', '.join(left)}")
    return model.to(device)


def linear_flop_share(cfg, dataset):
    """The share of the network's forward FLOPs done in its nn.Linear layers: the work linear=custom swaps,
    and so the most a speed ratio between the two linears can say about our kernel.

    Counted on a copy built on the meta device (shapes only: no memory, no arithmetic, no random numbers
    drawn) for one image; every layer's FLOPs grow alike with the batch. None for a network that cannot run
    on the meta device (one that reads its data, say): the figure informs, and must not stop a run.
    """
    return flop_shares(cfg, dataset)["linear"]


def conv_flop_share(cfg, dataset):
    """The share of the network's forward FLOPs done in the convolutions conv=custom swaps (nn.Conv2d with
    groups=1), counted as linear_flop_share is; None where that cannot be counted."""
    return flop_shares(cfg, dataset)["conv"]


def flop_shares(cfg, dataset):
    """{"linear": share, "conv": share} of the forward FLOPs (see linear_flop_share), or both None."""
    flops = {"linear": 0, "conv": 0}

    def counter_for(kind):
        def count(module, inputs, output):
            per_output = module.in_features if kind == "linear" else module.weight[0].numel()
            flops[kind] += 2 * output.numel() * per_output
        return count

    try:
        with torch.device("meta"):
            model = network(cfg, dataset).eval()
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(counter_for("linear"))
            elif isinstance(module, nn.Conv2d) and module.groups == 1:
                module.register_forward_hook(counter_for("conv"))
        with FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, *dataset.image_shape, device="meta"))
    except Exception:  # noqa: BLE001 (whatever a network does on the meta device, the run goes on)
        return {"linear": None, "conv": None}
    total = max(counter.get_total_flops(), 1)
    return {kind: count / total for kind, count in flops.items()}


def build_training(cfg, dataset, device):
    """(model, optimizer, scheduler, train loader, val loader) for `cfg`, all seeded by cfg.seed."""
    torch.manual_seed(cfg.seed)
    model = make_model(cfg, dataset, device)
    min_batch = min_training_batch(model, device)
    check_batch_size(cfg, len(dataset.train_labels), min_batch)
    train_loader, val_loader = make_loaders(cfg, dataset, device, min_batch)  # they draw from no global generator
    optimizer = instantiate(cfg.optim, params=model.parameters(), _convert_="all")  # betas as a list, not a ListConfig
    scheduler = instantiate(cfg.sched, optimizer=optimizer)
    return model, optimizer, scheduler, train_loader, val_loader
