"""The trainer's parts; train.py, the entry point and the training loop, puts them together.

    config        loading the config, its resolvers, and checking it (one-line errors before any run folder)
    build         device and threads, data, model, optimizer and scheduler; AMP, channels_last, compile
    distributed   torchrun and DistributedDataParallel helpers (no-ops in a single process)
    checkpoint    atomic checkpoints, resume, and their one-line errors
    logs          the run's description, train.log, TensorBoard's HParams
    summary       summary.json per run, summary.md/.csv per sweep (`python -m trainer.summary <sweep folder>`)
    memory        glibc malloc settings that keep freed memory in the process
"""
