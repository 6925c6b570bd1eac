"""The whole training step, linear=torch against linear=custom: model=mlp on fake MNIST-size data.

    python -m bench.train                      # 60,000 x 1x28x28, batch 128, 1 warm-up + 5 timed epochs each
    python -m bench.train --epochs 3 --train-size 10000 --threads 1
    python -m bench.train --epochs 2 --train-size 2560 model=resnet18   # any model; add --malloc-defaults
    python -m bench.train --threads 2 --markdown bench_train.md         # the results as a markdown table too

Both models start from the same weights and train on the same in-memory batches through the trainer's own
train_one_epoch; their epochs alternate (torch, custom, torch, ...) so that a busy moment on the machine
hits both alike. Epoch times are the trainer's time/epoch_s.
"""
import argparse
import statistics

import sys

import torch

import data
from bench.machine import describe_cpu
import train
from trainer import build, config, logs, memory

LINEARS = ("torch", "custom")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=5, help="timed epochs per linear (after one warm-up)")
    parser.add_argument("--train-size", type=positive_int, default=60_000)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                        help="torch threads (default: all)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc's malloc as it is (by default freed memory is kept, as the trainer does)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the results as a markdown table")
    parser.add_argument("overrides", nargs="*",
                        help="more trainer overrides, e.g. model.hidden_sizes=[512,512] or model=resnet18")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    malloc = memory.set_up(keep=not args.malloc_defaults)  # as the trainer runs, unless --malloc-defaults

    overrides = {
        linear: ["model=mlp", f"linear={linear}", "data=fake", "data.image_size=[1,28,28]",
                 f"data.train_size={args.train_size}", "data.val_size=16", f"data.batch_size={args.batch_size}",
                 "data.loader=memory", *args.overrides]
        for linear in LINEARS
    }
    for linear_overrides in overrides.values():
        config.check_command_line(linear_overrides)  # a bad override ends in one line, as with train.py
    configs = {linear: config.load_config(linear_overrides) for linear, linear_overrides in overrides.items()}
    device = build.pick_device(configs["torch"].trainer.device)
    print(f"loading fake data: {args.train_size:,} x 1x28x28 ...", flush=True)
    dataset = data.load_data(**build.dataset_options(configs["torch"].data))
    runs = {}
    for linear, cfg in configs.items():
        model, optimizer, _, train_loader, _ = build.build_training(cfg, dataset, device)
        runs[linear] = model, train_loader, optimizer

    epoch_times_s = {linear: [] for linear in LINEARS}
    steps_per_epoch = len(runs["torch"][1])
    for epoch in range(args.epochs + 1):
        for linear in LINEARS:
            model, loader, optimizer = runs[linear]
            faults_before = memory.minor_page_faults()
            stats = train.train_one_epoch(model, loader, optimizer, device)
            faults_per_step = (memory.minor_page_faults() - faults_before) / steps_per_epoch
            if epoch > 0:  # the first epoch warms up caches and allocators
                epoch_times_s[linear].append(stats.epoch_s)
            print(f"epoch {epoch}{' (warm-up)' if epoch == 0 else ''} linear={linear}: "
                  f"{stats.epoch_s:.3f} s, loss {stats.loss:.4f}, page faults per step {faults_per_step:,.0f}",
                  flush=True)

    model_cfg = configs["torch"].model
    model_text = f"mlp {list(model_cfg.hidden_sizes)}" if model_cfg.name == "mlp" else model_cfg.name
    setup = (f"model={model_text}, {args.train_size:,} x 1x28x28, batch {args.batch_size}, {device}, "
             f"{logs.counted(args.threads, 'thread')}, {logs.counted(args.epochs, 'timed epoch')} each; "
             f"malloc: {malloc}")
    print(f"\n{describe_cpu()}\n{setup}")
    means_s = {linear: statistics.mean(times) for linear, times in epoch_times_s.items()}
    medians_s = {linear: statistics.median(times) for linear, times in epoch_times_s.items()}
    for linear in LINEARS:
        print(f"linear={linear:<6}  mean epoch {means_s[linear]:.3f} s  median {medians_s[linear]:.3f} s  "
              f"min {min(epoch_times_s[linear]):.3f} s  {args.train_size / means_s[linear]:,.0f} samples/s")
    # the median shrugs off an epoch slowed by other work on a shared machine; the mean does not. Each pair
    # of neighbouring epochs gives a ratio too: their spread is how far one run can be trusted.
    paired = [t / c for t, c in zip(epoch_times_s["torch"], epoch_times_s["custom"])]
    ratio = (f"mean {means_s['torch'] / means_s['custom']:.2f}, median {medians_s['torch'] / medians_s['custom']:.2f} "
             f"(epoch by epoch {min(paired):.2f}-{max(paired):.2f})")
    print(f"ratio torch/custom (above 1: custom is faster): {ratio}")
    if args.markdown:
        command = "python -m bench.train " + " ".join(argv if argv is not None else sys.argv[1:])
        rows = [f"| {linear} | {means_s[linear]:.3f} | {medians_s[linear]:.3f} | {min(epoch_times_s[linear]):.3f} | "
                f"{args.train_size / means_s[linear]:,.0f} |" for linear in LINEARS]
        lines = [f"`{command.strip()}`", "", describe_cpu(), "", setup, "",
                 "| linear | mean epoch (s) | median (s) | fastest (s) | samples/s |", "|---|---|---|---|---|",
                 *rows, "", f"- torch/custom (above 1: custom is faster): {ratio}", ""]
        with open(args.markdown, "w") as file:
            file.write("\n".join(lines))
        print(f"markdown written to {args.markdown}")
    return means_s


if __name__ == "__main__":
    main()
