"""One run on several processes: torchrun starts them, DistributedDataParallel averages their gradients.

Outside torchrun every helper here is a no-op for a single process, so the training loop reads the same
either way.
"""
import os

import torch
import torch.distributed as dist

from trainer.config import fail


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


def syncs_batchnorm(device):
    """Whether BatchNorm normalizes each step's whole batch across the processes (SyncBatchNorm): under
    torchrun on GPUs. torch's SyncBatchNorm takes GPU tensors only, so on CPUs each process normalizes its
    own share of the batch."""
    return world()[1] > 1 and device.type == "cuda"


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


def processes_text():
    """' each, 2 processes (gloo)' under torchrun, else ''."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return f" each, {dist.get_world_size()} processes ({dist.get_backend()})"
