"""Kernel benchmark: `ext.conv2d` against `torch.nn.functional.conv2d` (oneDNN on the CPU).

The convolutions of ResNet-18 and ResNet-50 at CIFAR size (batch 128, float32, no bias, as in the
ResNets): each stage's 3x3, the stride-2 3x3 and 1x1 downsamples, ResNet-50's 1x1 reduce and expand,
and the 3-channel stem (whose input needs no gradient, as in training). For each it times the forward,
the backward and both, alternating torch and ext in one process as bench.linear does (same method,
same columns: the ratio torch/ext with its range over the rounds, ext's share of the measured FMA peak),
then the geometric mean of the ratios.

With --cuda, the same shapes on the GPU against cuDNN, in float32 and bfloat16 (no FMA peak column).

Example:
    python -m bench.conv --threads 2,1 --markdown bench_conv.md
    python -m bench.conv --cuda --markdown bench_conv_cuda.md
    python -m bench.conv --quick --threads 2
    python -m bench.conv --shapes '64->64@32k3s1,256->1024@8k1s1' --batch 64
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python bench/conv.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ext  # noqa: E402
from bench.linear import (FAULTS_NOTED_PER_CALL, compare, fma_peak_gflops, geomean_text,  # noqa: E402
                          parse_threads, ratio_range, time_interleaved)
from bench.machine import (command_line, describe_cpu, markdown_path, positive_int, positive_seconds,  # noqa: E402
                           run_tool, thread_count, write_markdown)
from trainer import memory  # noqa: E402


@dataclass(frozen=True)
class ConvShape:
    in_channels: int
    out_channels: int
    size: int  # input height = width
    kernel: int
    stride: int
    needs_input_grad: bool = True

    @property
    def padding(self) -> int:
        return self.kernel // 2

    @property
    def out_size(self) -> int:
        return (self.size + 2 * self.padding - self.kernel) // self.stride + 1

    def __str__(self) -> str:
        return f"{self.in_channels}->{self.out_channels}@{self.size}k{self.kernel}s{self.stride}"


RESNET18 = [ConvShape(3, 64, 32, 3, 1, needs_input_grad=False),
            ConvShape(64, 64, 32, 3, 1), ConvShape(128, 128, 16, 3, 1), ConvShape(256, 256, 8, 3, 1),
            ConvShape(512, 512, 4, 3, 1),
            ConvShape(64, 128, 32, 3, 2), ConvShape(128, 256, 16, 3, 2), ConvShape(256, 512, 8, 3, 2),
            ConvShape(64, 128, 32, 1, 2), ConvShape(128, 256, 16, 1, 2), ConvShape(256, 512, 8, 1, 2)]
RESNET50_POINTWISE = [ConvShape(256, 64, 32, 1, 1), ConvShape(64, 256, 32, 1, 1),
                      ConvShape(512, 128, 16, 1, 1), ConvShape(128, 512, 16, 1, 1),
                      ConvShape(1024, 256, 8, 1, 1), ConvShape(256, 1024, 8, 1, 1)]
SHAPES = RESNET18 + RESNET50_POINTWISE
QUICK_SHAPES = [ConvShape(64, 64, 32, 3, 1), ConvShape(256, 256, 8, 3, 1), ConvShape(64, 256, 32, 1, 1)]
HEADER = ["shape (in->out @ size, kernel, stride)", "pass", "torch ms", "ext ms", "torch GFLOP/s", "ext GFLOP/s",
          "torch/ext", "by round", "ext % of FMA peak"]


def flops(shape: ConvShape, batch: int, pass_name: str) -> float:
    product = 2 * batch * shape.out_channels * shape.out_size ** 2 * shape.in_channels * shape.kernel ** 2
    backward = (2 if shape.needs_input_grad else 1) * product
    return {"forward": product, "backward": backward, "fwd+bwd": product + backward}[pass_name]


def statements(conv, x, w, dy, inputs):
    out = conv(x, w)
    return {
        "forward": lambda: conv(x, w),
        "backward": lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(conv(x, w), inputs, dy),
    }


def bench_shape(shape: ConvShape, batch: int, min_run_time_s: float, rounds: int, device="cpu",
                dtype=torch.float32):
    """[(pass, Row from bench.linear.compare)] for one shape; Row.shape is unused here."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, shape.in_channels, shape.size, shape.size, generator=gen).to(device, dtype)
    x.requires_grad_(shape.needs_input_grad)
    w = (torch.randn(shape.out_channels, shape.in_channels, shape.kernel, shape.kernel, generator=gen)
         / (shape.in_channels * shape.kernel ** 2) ** 0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(batch, shape.out_channels, shape.out_size, shape.out_size, generator=gen).to(device, dtype)
    inputs = (x, w) if shape.needs_input_grad else (w,)

    def conv_of(fn):
        return lambda x, w: fn(x, w, None, shape.stride, shape.padding)

    ours, theirs = statements(conv_of(ext.conv2d), x, w, dy, inputs), statements(conv_of(F.conv2d), x, w, dy, inputs)
    rows = []
    for pass_name in ours:
        times, faults = time_interleaved({"torch": theirs[pass_name], "ext": ours[pass_name]}, min_run_time_s, rounds)
        rows.append((pass_name, compare(pass_name, (0, 0, 0), device, "", None, times["torch"], times["ext"],
                                        (faults["torch"], faults["ext"]))))
    return rows


def cells(shape, batch, pass_name, row, peak):
    gflops = [flops(shape, batch, pass_name) / s / 1e9 for s in (row.torch_s, row.ext_s)]
    return [str(shape), pass_name, f"{row.torch_s * 1e3:.2f}", f"{row.ext_s * 1e3:.2f}", f"{gflops[0]:.0f}",
            f"{gflops[1]:.0f}", f"{row.ratio:.2f}", ratio_range(row.round_ratios),
            f"{100 * gflops[1] / peak:.0f}%" if peak else "-"]


def table_lines(title, results, batch, peak) -> list[str]:
    """Prints one table and its geomeans; returns them as markdown lines."""
    table = [cells(shape, batch, pass_name, row, peak) for shape, pass_name, row in results]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] + [
        "| " + " | ".join(line) + " |" for line in table]
    summary = []
    for pass_name in ("forward", "backward", "fwd+bwd"):
        of_pass = [row for _, p, row in results if p == pass_name]
        lowest = min(of_pass, key=lambda row: row.ratio)
        summary.append(f"geomean torch/ext, {pass_name}: {geomean_text(of_pass)}; lowest {lowest.ratio:.2f}")
    summary += fault_notes(results)
    if any(flops(shape, batch, p) / row.ext_s / 1e9 > peak for shape, p, row in results if peak):
        summary.append("note: GFLOP/s count every product of the kernel, the padding's too; on maps of at most 64 "
                       "pixels ext skips the padding's (ext/README.md, by output position: 31% of a 3x3 "
                       "kernel's at 4x4, 16% at 8x8), so its share of the peak can pass 100%")
    print("\n" + title + "\n" + "\n".join(lines) + "\n" + "\n".join(summary))
    return [title, "", *lines, "", *[f"- {line}" for line in summary], ""]


def fault_notes(results) -> list[str]:
    """A line for each row where a side page-faulted on most calls: its time is not the kernel's alone. With
    trainer/memory.py's settings every block comes from the heap, so a side that faults anyway pays for
    something a training step may not pay alike."""
    notes = []
    for shape, pass_name, row in results:
        faulting = [f"{side} {count:,.0f}" for side, count in zip(("torch", "ext"), row.faults_per_call)
                    if count >= FAULTS_NOTED_PER_CALL]
        if faulting:
            notes.append(f"note: {shape} {pass_name}: page faults per call: {', '.join(faulting)} (bench/README.md, "
                         "Memory)")
    return notes


def progress(shape, rows):
    print(f"{shape}: torch/ext " + ", ".join(f"{p} {r.ratio:.2f}" for p, r in rows), file=sys.stderr, flush=True)


def parse_shapes(text: str) -> list[ConvShape]:
    """'64->64@32k3s1,256->1024@8k1s1' -> ConvShapes (in->out @ input size, kernel, stride)."""
    shapes = []
    for item in text.split(","):
        try:
            channels, rest = item.split("@")
            in_channels, out_channels = (int(v) for v in channels.split("->"))
            size, rest = rest.split("k")
            kernel, stride = rest.split("s")
            shape = ConvShape(in_channels, out_channels, int(size), int(kernel), int(stride))
        except ValueError:
            shape = None
        if shape is None or min(shape.in_channels, shape.out_channels, shape.size, shape.kernel, shape.stride) <= 0 \
                or shape.out_size <= 0:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: write in->out@size k kernel s stride, e.g. "
                                             "64->64@32k3s1")
        shapes.append(shape)
    return shapes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.conv", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=parse_threads, default="all,1",
                        help="comma-separated thread counts; 'all' = every core")
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK_SHAPES)} shapes, shorter runs")
    parser.add_argument("--shapes", type=parse_shapes, help="only these shapes, e.g. '64->64@32k3s1'")
    parser.add_argument("--batch", type=positive_int, default=128)
    parser.add_argument("--min-run-time", type=positive_seconds, default=None, help="seconds each side is timed in a round (in blocks of about 10 ms)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating torch/ext rounds per pass")
    parser.add_argument("--markdown", metavar="FILE", type=markdown_path, help="also write the tables as markdown")
    parser.add_argument("--cuda", action="store_true", help="on the GPU against cuDNN, float32 and bfloat16")
    args = parser.parse_args(argv)
    malloc = memory.set_up()
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    min_run_time_s = args.min_run_time or (0.05 if args.quick else 0.2)
    rounds = args.rounds or (2 if args.quick else 5)
    if args.cuda:
        markdown = [command_line("python -m bench.conv", argv), ""] + cuda_tables(args, shapes, min_run_time_s, rounds)
    else:
        markdown = cpu_tables(args, argv, shapes, min_run_time_s, rounds, malloc)
    if args.markdown:
        write_markdown(args.markdown, markdown)


def cpu_tables(args, argv, shapes, min_run_time_s, rounds, malloc) -> list[str]:
    header = (f"{describe_cpu()}; torch {torch.__version__} (its convolution: oneDNN "
              f"{'on' if torch.backends.mkldnn.is_available() else 'off'}), CPU path {torch.ops.ext.cpu_path()}, "
              f"batch {args.batch}, float32, malloc: {malloc}")
    print(header)
    markdown = [command_line("python -m bench.conv", argv), "", header, ""]
    for count in args.threads:
        torch.set_num_threads(count)
        peak_readings = [fma_peak_gflops(count)]  # the highest reading counts (see bench.linear)
        results = []
        for shape in shapes:
            rows = bench_shape(shape, args.batch, min_run_time_s, rounds)
            results += [(shape, pass_name, row) for pass_name, row in rows]
            peak_readings.append(fma_peak_gflops(count))
            progress(shape, rows)
        peak = max(peak_readings)
        title = f"### {count} thread{'s' if count > 1 else ''} (FMA peak {peak:.0f} GFLOP/s, highest of " \
                f"{len(peak_readings)} readings)"
        markdown += table_lines(title, results, args.batch, peak)
    return markdown


def cuda_tables(args, shapes, min_run_time_s, rounds) -> list[str]:
    if not torch.cuda.is_available():
        print("CUDA: skipped (torch.cuda.is_available() is False: this machine has no usable GPU)")
        return ["CUDA: skipped (no usable GPU)", ""]
    header = (f"{torch.cuda.get_device_name()}; torch {torch.__version__}, its convolution cuDNN "
              f"{torch.backends.cudnn.version()} (TF32 {'on' if torch.backends.cudnn.allow_tf32 else 'off'} for "
              f"its float32), batch {args.batch}")
    print(header)
    markdown = [header, ""]
    for dtype in (torch.float32, torch.bfloat16):
        results = []
        for shape in shapes:
            rows = bench_shape(shape, args.batch, min_run_time_s, rounds, "cuda", dtype)
            results += [(shape, pass_name, row) for pass_name, row in rows]
            progress(shape, rows)
        markdown += table_lines(f"### CUDA, {str(dtype).removeprefix('torch.')} (vs cuDNN)", results, args.batch,
                                None)
    return markdown


if __name__ == "__main__":
    run_tool(main)
