"""What packing costs our forward: ext.linear with W as a layer holds it against the same weights stored transposed.

    python -m bench.ceiling [--shapes 128x256->256,...] [--threads 2,1] [--markdown FILE]

The forward's B is Wᵀ. With W as nn.Linear holds it (out x in, rows contiguous) every column panel of B is
packed (transposed) before the tiles read it; with the same weights stored transposed (a column-major W), B's
rows are contiguous and gemm.cpp reads them in place, packing nothing, up to `b_in_place_max_rows` rows of the
batch (python -m ext; above that B is packed either way, and the two columns should agree). The input is
read in place either way. So the second column is what the tiles reach with nothing packed: the gap between
it and the FMA peak is the microkernel's own, the gap between the two columns the packing's, and the gap
between 1 and 2 threads the split's. bench.linear's method: both in alternating torch.utils.benchmark rounds in
one process, each side's time the median of its round medians; packed/in place above 1 when packing costs time,
with its range over the rounds. The FMA peak is the highest of readings taken before the first shape and after
each one (bench.linear).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

import ext  # noqa: F401  (loads the ops)
from bench.linear import compare, fma_peak_gflops, parse_shapes, parse_threads, ratio_range, time_interleaved
from bench.machine import command_line, describe_cpu, write_markdown
from trainer import memory

DEFAULT_SHAPES = "128x256->256,128x784->256,128x1024->1024,128x2048->1000"


def bench_shape(shape, threads, min_run_time_s, rounds):
    """A bench.linear Row: its 'torch' side is W as held (B packed), its 'ext' side W stored transposed."""
    batch, in_features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_features, generator=generator)
    w = torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)
    w_stored_transposed = w.t().contiguous().t()  # the same values, column-major
    b = torch.randn(out_features, generator=generator)
    linear = torch.ops.ext.linear
    times, faults = time_interleaved({"packed": lambda: linear(x, w, b),
                                      "in place": lambda: linear(x, w_stored_transposed, b)}, min_run_time_s, rounds)
    return compare("forward", shape, "cpu", str(threads), None, times["packed"], times["in place"],
                   (faults["packed"], faults["in place"]))


def table(rows, peak_gflops) -> list[str]:
    lines = ["| shape (batch x in->out) | W as held (B packed): µs | GFLOP/s | % of peak | W stored transposed "
             "(B in place): µs | GFLOP/s | % of peak | packed / in place | by round |", "|---" * 9 + "|"]
    for r in rows:
        batch, in_features, out_features = r.shape
        cells = [f"{batch}x{in_features}->{out_features}"]
        for seconds in (r.torch_s, r.ext_s):
            cells += [f"{seconds * 1e6:.1f}", f"{r.gflops(seconds):.0f}", f"{100 * r.gflops(seconds) / peak_gflops:.0f}%"]
        cells += [f"{r.ratio:.2f}", ratio_range(r.round_ratios)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"batch x in -> out, comma-separated (default {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=parse_threads, default=parse_threads("2,1"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timed block")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    in_place_rows = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")["b_in_place_max_rows"]
    header = (f"{describe_cpu()}; CPU path {torch.ops.ext.cpu_path()}, B read in place up to {in_place_rows} rows; "
              f"malloc: {memory.set_up()}")
    markdown = [command_line("python -m bench.ceiling", argv), "", header, ""]
    print(header)
    for threads in args.threads:
        torch.set_num_threads(threads)
        peak_readings = [fma_peak_gflops(threads)]
        rows = []
        for shape in args.shapes:
            rows.append(bench_shape(shape, threads, args.min_run_time, args.rounds))
            peak_readings.append(fma_peak_gflops(threads))
        peak = max(peak_readings)
        lines = table(rows, peak)
        notes = [f"{b}x{i}->{o}: more than {in_place_rows} rows, so B is packed on both sides"
                 for b, i, o in args.shapes if b > in_place_rows]
        title = (f"CPU, {threads} thread{'s' if threads != 1 else ''} (FMA peak {peak:.0f} GFLOP/s: the highest of "
                 f"{len(peak_readings)} readings, the lowest {min(peak_readings):.0f})")
        print(f"\n== {title} ==", *lines, *notes, sep="\n", flush=True)
        markdown += [f"#### {title}", "", *lines, "", *[f"- {note}" for note in notes], ""]
    if args.markdown:
        write_markdown(args.markdown, markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
