"""The whole training step, linear=torch against linear=custom: model=mlp on fake MNIST-size data.

    python -m bench.train                      # 60,000 x 1x28x28, batch 128, 1 warm-up + 5 timed epochs each
    python -m bench.train --epochs 3 --train-size 10000 --threads 1
    python -m bench.train --epochs 2 --train-size 2560 model=resnet18   # any model; add --malloc-defaults
    python -m bench.train --threads 2 --markdown bench_train.md         # the results as a markdown table too
    python -m bench.train --compiled-torch                              # and torch.compile'd nn.Linear
    python -m bench.train --conv --epochs 2 --train-size 2560 model=resnet18 data.image_size=[3,32,32]
                                                     # custom runs its convolutions on ext.conv2d too

Both models start from the same weights and train on the same in-memory batches through the trainer's own
train_one_epoch, with the trainer's own switches (trainer.amp, trainer.channels_last, trainer.compile); their
epochs alternate (torch, custom, torch, ...) so that a busy moment on the machine hits both alike. The
speedup is the ratio of mean step times, with a bootstrap interval over the steps and a verdict
(trainer/timing.py). --compiled-torch adds linear=torch under torch.compile as a third side. With --conv the
custom side is linear=custom conv=custom and every torch side conv=torch: the whole ResNet step on our kernels.
"""
import argparse
import statistics

import torch

import data
from bench.machine import (command_line, describe_cpu, describe_device, markdown_path, positive_int, run_tool,
                           thread_count, write_markdown)
import train
from trainer import build, config, logs, memory, timing

COMPILED_TORCH = "torch.compile"  # the third side of --compiled-torch


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=5, help="timed epochs per side (after one warm-up)")
    parser.add_argument("--train-size", type=positive_int, default=60_000)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--threads", type=thread_count, default=torch.get_num_threads(),
                        help="torch threads (default: all)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc's malloc as it is (by default freed memory is kept, as the trainer does)")
    parser.add_argument("--compiled-torch", action="store_true",
                        help="add a third side: linear=torch under torch.compile, what a user would try first")
    parser.add_argument("--conv", action="store_true",
                        help="the custom side runs conv=custom too (the torch sides conv=torch)")
    parser.add_argument("--markdown", metavar="FILE", type=markdown_path,
                        help="also write the results as a markdown table")
    parser.add_argument("overrides", nargs="*",
                        help="more trainer overrides, e.g. model.hidden_sizes=[512,512], model=resnet18, "
                             "trainer.amp=true, trainer.channels_last=true, trainer.compile=true (both sides)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    malloc = memory.set_up(keep=not args.malloc_defaults)  # as the trainer runs, unless --malloc-defaults

    common = ["model=mlp", "data=fake", "data.image_size=[1,28,28]", f"data.train_size={args.train_size}",
              "data.val_size=16", f"data.batch_size={args.batch_size}", "data.loader=memory", *args.overrides]
    conv = ["conv=custom"] if args.conv else []
    sides = {"torch": ["linear=torch", "conv=torch"], "custom": ["linear=custom", *conv]}
    if args.compiled_torch:
        sides[COMPILED_TORCH] = ["linear=torch", "conv=torch", "trainer.compile=true"]
    overrides = {side: common + extra for side, extra in sides.items()}
    for side_overrides in overrides.values():
        config.check_command_line(side_overrides)  # a bad override ends in one line, as with train.py
    configs = {side: config.load_config(side_overrides) for side, side_overrides in overrides.items()}
    device = build.pick_device(configs["torch"].trainer.device)
    print(f"loading fake data: {args.train_size:,} images ...", flush=True)
    dataset = data.load_data(**build.dataset_options(configs["torch"].data))
    image_shape = "x".join(str(size) for size in dataset.image_shape)
    runs = {}
    for side, cfg in configs.items():
        # the trainer's own code paths: channels_last, torch.compile, DDP wrapping and the AMP settings
        try:
            model, optimizer, _, train_loader, _ = build.build_training(cfg, dataset, device)
        except config.ConfigError as error:  # a batch size too small for BatchNorm: one line, as with train.py
            config.fail(str(error))
        settings = build.step_settings(cfg, device)
        runs[side] = build.training_module(model, cfg, device), train_loader, optimizer, settings

    epoch_times_s = {side: [] for side in sides}
    step_times_s = {side: [] for side in sides}
    steps_per_epoch = len(runs["torch"][1])
    for epoch in range(args.epochs + 1):
        for side in sides:
            model, loader, optimizer, settings = runs[side]
            faults_before = memory.minor_page_faults()
            stats = train.train_one_epoch(model, loader, optimizer, device, settings=settings)
            faults_per_step = (memory.minor_page_faults() - faults_before) / steps_per_epoch
            if epoch > 0:  # the first epoch warms up caches, allocators and any compilation
                epoch_times_s[side].append(stats.epoch_s)
                step_times_s[side] += stats.step_times_s
            print(f"epoch {epoch}{' (warm-up)' if epoch == 0 else ''} {side}: "
                  f"{stats.epoch_s:.3f} s, loss {stats.loss:.4f}, page faults per step {faults_per_step:,.0f}",
                  flush=True)

    model_cfg = configs["torch"].model
    model_text = f"mlp {list(model_cfg.hidden_sizes)}" if model_cfg.name == "mlp" else model_cfg.name
    switches = " ".join(override for override in args.overrides if override.startswith("trainer."))
    setup = (f"model={model_text}{' (custom: conv=custom too)' if args.conv else ''}, {args.train_size:,} x {image_shape}, batch {args.batch_size}, {describe_device(device)}, "
             f"{logs.counted(args.threads, 'thread')}, {logs.counted(args.epochs, 'timed epoch')} each"
             f"{', ' + switches if switches else ''}; malloc: {malloc}")
    print(f"\n{describe_cpu()}\n{setup}")
    rows = []
    for side, times in epoch_times_s.items():
        mean, median, fastest = statistics.mean(times), statistics.median(times), min(times)
        rows.append(f"| {side} | {mean:.3f} | {median:.3f} | {fastest:.3f} | {args.train_size / mean:,.0f} |")
        print(f"{side:<14} mean epoch {mean:.3f} s  median {median:.3f} s  min {fastest:.3f} s  "
              f"{args.train_size / mean:,.0f} samples/s")
    # Every step's time from the interleaved epochs: a block bootstrap gives the ratio's interval (trainer/timing.py).
    ratios = {other: timing.speedup(step_times_s[other], step_times_s["custom"])
              for other in sides if other != "custom"}
    ratio_lines = [f"custom's speedup over {other} (mean step time ratio): {ratio}" for other, ratio in ratios.items()]
    print("\n".join(ratio_lines))
    if args.markdown:
        lines = [command_line("python -m bench.train", argv), "", describe_cpu(), "", setup, "",
                 "| side | mean epoch (s) | median (s) | fastest (s) | samples/s |", "|---|---|---|---|---|",
                 *rows, "", *[f"- {line}" for line in ratio_lines], ""]
        write_markdown(args.markdown, lines)
    return ratios


if __name__ == "__main__":
    run_tool(main)
