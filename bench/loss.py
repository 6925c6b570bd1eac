"""The trainer's loss alone: ext.cross_entropy against F.cross_entropy, forward and forward+backward.

    python -m bench.loss [--shapes 128x10,256x1000] [--threads 2,1] [--markdown FILE]

bench.linear's method: both sides in alternating rounds in one process, each side's time
the median of its round medians, torch/ext above 1 when ours is faster, with its range over the rounds.
Logits are float32 (batch x classes) requiring grad, targets random class indices.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import ext
from bench.linear import compare, geomean_text, parse_threads, ratio_range, time_interleaved
from bench.machine import (command_line, describe_cpu, markdown_path, positive_int, positive_seconds, run_tool,
                           write_markdown)
from trainer import memory

DEFAULT_SHAPES = "128x10,512x10,256x1000,4096x1000,512x32000"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'128x10,256x1000' -> [(128, 10), (256, 1000)] (batch x classes)."""
    shapes = []
    for item in text.split(","):
        rows, _, classes = item.strip().partition("x")
        if not (rows.isdigit() and classes.isdigit() and int(rows) > 0 and int(classes) > 0):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not batch x classes, e.g. 128x10")
        shapes.append((int(rows), int(classes)))
    return shapes


def statements(loss, logits, target):
    def forward():
        loss(logits, target)

    def forward_backward():
        loss(logits, target).backward()
        logits.grad = None

    return {"forward": forward, "fwd+bwd": forward_backward}


def bench_shape(shape, threads, min_run_time_s, rounds):
    rows, classes = shape
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, classes, generator=generator).requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=generator)
    theirs, ours = statements(F.cross_entropy, logits, target), statements(ext.cross_entropy, logits, target)
    results = []
    for pass_name in theirs:
        times, faults = time_interleaved({"torch": theirs[pass_name], "ext": ours[pass_name]}, min_run_time_s, rounds)
        results.append(compare(pass_name, (rows, classes, 0), "cpu", str(threads), None, times["torch"], times["ext"],
                               (faults["torch"], faults["ext"])))
    return results


def table(results) -> list[str]:
    lines = ["| shape (batch x classes) | pass | torch µs | ext µs | torch/ext | by round |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.shape[0]}x{r.shape[1]} | {r.pass_name} | {r.torch_s * 1e6:.1f} | {r.ext_s * 1e6:.1f} "
                     f"| {r.torch_s / r.ext_s:.2f} | {ratio_range(r.round_ratios)} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loss", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES))
    parser.add_argument("--threads", type=parse_threads, default=parse_threads("2,1"))
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--min-run-time", type=positive_seconds, default=0.2, help="seconds each side is timed in a round (in blocks of about 10 ms)")
    parser.add_argument("--markdown", type=markdown_path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    header = f"{describe_cpu()}; malloc: {memory.set_up()}"  # as the trainer runs: freed memory kept for reuse
    markdown = [command_line("python -m bench.loss", argv), "", header, ""]
    print(header)
    for threads in args.threads:
        torch.set_num_threads(threads)
        results = [row for shape in args.shapes for row in bench_shape(shape, threads, args.min_run_time, args.rounds)]
        lines = table(results)
        summary = f"geomean torch/ext: {geomean_text(results)}"
        title = f"CPU, {threads} thread{'s' if threads != 1 else ''}"
        print(f"\n== {title} ==", *lines, summary, sep="\n", flush=True)
        markdown += [f"#### {title}", "", *lines, "", f"- {summary}", ""]
    if args.markdown:
        write_markdown(args.markdown, markdown)


if __name__ == "__main__":
    run_tool(lambda: main(sys.argv[1:]))
