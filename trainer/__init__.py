"""The trainer's parts; train.py, the entry point and the training loop, puts them together.

    config        loading the config, its resolvers, and checking it (one-line errors before any run folder)
    build         device and threads, data, model, optimizer and scheduler; AMP, channels_last, compile;
                  the share of the network's FLOPs in its linear layers
    distributed   torchrun and DistributedDataParallel helpers (no-ops in a single process)
    checkpoint    atomic checkpoints, resume, and their one-line errors
    logs          the run's description, train.log, TensorBoard's scalars, HParams and Custom Scalars layout
    summary       summary.json per run, summary.md/.csv per sweep (`python -m trainer.summary <sweep folder>`)
    timing        step times, and the interval and verdict of a speed ratio
    memory        glibc malloc settings that keep freed memory in the process
    slurm         sweeps on a SLURM cluster: requests checked before submitting, killed jobs summarised
                  (the launcher class Hydra loads is hydra_plugins/linear_lab/slurm_launcher.py)
"""
