"""What our forward reaches against the FMA peak, and where the rest goes: the register tile alone, and ext.linear
with W as a layer holds it against the same weights stored transposed.

    python -m bench.ceiling [--shapes 128x256->256,...] [--threads 2,1] [--markdown FILE]

The tile alone (`torch.ops.ext.tile_gflops`): each of the CPU path's tiles, with each of its vector counts (a
product's last column panel runs fewer vectors when the columns run out), at the shapes' K blocks, its operands
where gemm.cpp puts them at a batch of 128 (the input's rows read in place, one packed B micro-panel re-read by
every row tile), and nothing else: no packing, no ragged tile, no call: the ceiling of the products. Each figure
is the best of its rounds.

The forward's B is Wᵀ. With W as nn.Linear holds it (out x in, rows contiguous) every column panel of B is
packed (transposed) before the tiles read it, except where gemm.cpp computes the forward as Yᵀ = W·Xᵀ
(few rows against a deep W; `python -m ext` prints the rule): then X is packed, and the share reads
batch / out. With the same weights stored transposed (a column-major W), B's rows are contiguous and
gemm.cpp reads them in place when the batch is at most `b_in_place_max_rows` rows (python -m ext), a
thread's block of B fits in half of L2 and its rows are not a multiple of 4 KiB apart,
else copies them into panels (a ragged last panel, part of a vector wide, is always packed). Each side's
"values packed" is what the library counted (`torch.ops.ext.cpu_packed_values`) over one call, as a share of
B's values: 100% when each is packed once, more where a panel is packed again for each row tile. So the gap
between the tile alone and a side with nothing packed is the product's own (its ragged last panel, its call),
the gap between the two sides the transposition's, and the gap between 1 and 2 threads the split's.
bench.linear's method: both sides in alternating rounds in one process, each side's time
the median of its round medians; held/transposed above 1 when transposing costs time, with its range over the
rounds. The FMA peak is the highest of readings taken before the first shape and after each one (bench.linear).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

import ext
from bench.linear import compare, fma_peak_gflops, parse_shapes, parse_threads, ratio_range, time_interleaved
from bench.machine import (command_line, describe_cpu, markdown_path, positive_int, positive_seconds, run_tool,
                           write_markdown)
from trainer import memory

DEFAULT_SHAPES = "128x256->256,128x784->256,128x1024->1024,128x2048->1000"


def b_packed_share(forward, k, n) -> float:
    """The values of B that one call of forward packs, as the library counts them, over B's k x n: 1 when every
    value is packed once, more where a panel is packed again (once per row tile, or per block of rows)."""
    before = torch.ops.ext.cpu_packed_values()[1]
    forward()
    return (torch.ops.ext.cpu_packed_values()[1] - before) / (k * n)


def bench_shape(shape, threads, min_run_time_s, rounds):
    """A bench.linear Row (its 'torch' side W as held, its 'ext' side W stored transposed) and the share of B
    each side packs per call."""
    batch, in_features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_features, generator=generator)
    w = torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)
    w_stored_transposed = w.t().contiguous().t()  # the same values, column-major
    b = torch.randn(out_features, generator=generator)
    sides = {"held": lambda: ext.linear(x, w, b), "transposed": lambda: ext.linear(x, w_stored_transposed, b)}
    packed = tuple(b_packed_share(forward, in_features, out_features) for forward in sides.values())
    times, faults = time_interleaved(sides, min_run_time_s, rounds)
    row = compare("forward", shape, "cpu", str(threads), None, times["held"], times["transposed"],
                  (faults["held"], faults["transposed"]))
    return row, packed


def microseconds(seconds) -> str:
    """Two decimals under 10 µs, one above: a small layer's call takes about 1 µs, where one decimal put the
    held/transposed ratio up to 8% off the times shown."""
    return f"{seconds * 1e6:.{2 if seconds < 1e-5 else 1}f}"


def table(rows, packed, peak_gflops) -> list[str]:
    lines = ["| shape (batch x in->out) | W as held: µs | GFLOP/s | % of peak | W stored transposed: µs | GFLOP/s "
             "| % of peak | values packed per call, % of B (held / transposed) | held / transposed | by round |",
             "|---" * 10 + "|"]
    for r, shares in zip(rows, packed):
        batch, in_features, out_features = r.shape
        cells = [f"{batch}x{in_features}->{out_features}"]
        for seconds in (r.torch_s, r.ext_s):
            cells += [microseconds(seconds), f"{r.gflops(seconds):.0f}", f"{100 * r.gflops(seconds) / peak_gflops:.0f}%"]
        cells += [" / ".join(f"{100 * share:.0f}%" for share in shares), f"{r.ratio:.2f}", ratio_range(r.round_ratios)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tile_shapes(sizes) -> list[tuple[str, int, int]]:
    """(tile, vectors, columns) for each of the path's wide and many-rows tiles and each of its vector counts,
    widest first; the narrow tile is the wide one's single vector on every path. After the wide tile's single
    vector, the tile that runs a one-vector panel two row tiles at a time (A read in place)."""
    shapes = []
    for tile in ("wide", "many_rows"):
        for vectors in range(sizes[f"{tile}_nr"] // sizes["lanes"], 0, -1):
            shapes.append((tile, vectors, vectors * sizes["lanes"]))
        if tile == "wide":
            shapes.append(("one_vector", 1, sizes["lanes"]))
    return shapes


def tile_label(sizes, tile: str, vectors: int, columns: int) -> str:
    if tile == "one_vector":
        return f"{sizes['one_vector_mr']}x{columns} (two wide row tiles on 1 of {sizes['wide_nr'] // sizes['lanes']} vectors)"
    return f"{sizes[f'{tile}_mr']}x{columns} ({tile.replace('_', ' ')}, {vectors} of {sizes[f'{tile}_nr'] // sizes['lanes']} vectors)"


def k_blocks(shapes, sizes) -> list[int]:
    """The K block depths the shapes' forwards run: all of K up to max_single_k_block, else kc."""
    return sorted({k if k <= sizes["max_single_k_block"] else sizes["kc"] for _, k, _ in shapes})


def measure_tiles(sizes, depths, threads, rounds) -> list[tuple[str, list[float]]]:
    """Each tile's label and its GFLOP/s at each K block depth: the best of `rounds` rounds over all of them
    (each reading itself the best of 7 trials), so that a busy moment on the machine spoils no tile's figure."""
    shapes = tile_shapes(sizes)
    best = [[0.0] * len(depths) for _ in shapes]
    for _ in range(rounds):
        for (tile, vectors, _), row in zip(shapes, best):
            for i, kc in enumerate(depths):
                row[i] = max(row[i], torch.ops.ext.tile_gflops(tile, vectors, kc, threads))
    return [(tile_label(sizes, tile, vectors, columns), row) for (tile, vectors, columns), row in zip(shapes, best)]


def tile_table(measured, depths, peak_gflops) -> list[str]:
    lines = ["| tile | " + " | ".join(f"K block {kc}: GFLOP/s | % of peak" for kc in depths) + " |",
             "|---" * (1 + 2 * len(depths)) + "|"]
    for label, gflops in measured:
        cells = [label] + [cell for g in gflops for cell in (f"{g:.0f}", f"{100 * g / peak_gflops:.0f}%")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"batch x in -> out, comma-separated (default {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=parse_threads, default=parse_threads("2,1"))
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--min-run-time", type=positive_seconds, default=0.2, help="seconds each side is timed in a round (in blocks of about 10 ms)")
    parser.add_argument("--markdown", type=markdown_path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    sizes = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")
    header = (f"{describe_cpu()}; CPU path {torch.ops.ext.cpu_path()}, B read in place up to "
              f"{sizes['b_in_place_max_rows']} rows when a thread's block of it fits in "
              f"{sizes['l2_bytes'] // 2 // 1024} KiB (half of L2) and its rows are not a multiple of 4 KiB apart; "
              f"malloc: {memory.set_up()}")
    markdown = [command_line("python -m bench.ceiling", argv), "", header, ""]
    print(header)
    for threads in args.threads:
        torch.set_num_threads(threads)
        peak_readings = [fma_peak_gflops(threads)]
        rows, packed = [], []
        for shape in args.shapes:
            row, shares = bench_shape(shape, threads, args.min_run_time, args.rounds)
            rows.append(row)
            packed.append(shares)
            peak_readings.append(fma_peak_gflops(threads))
        depths = k_blocks(args.shapes, sizes)
        tiles = measure_tiles(sizes, depths, threads, args.rounds)
        peak_readings.append(fma_peak_gflops(threads))
        peak = max(peak_readings)
        plural = "s" if threads != 1 else ""
        peak_words = (f"FMA peak {peak:.0f} GFLOP/s: the highest of {len(peak_readings)} readings, the lowest "
                      f"{min(peak_readings):.0f}")
        for title, lines in ((f"The tile alone, CPU, {threads} thread{plural} ({peak_words})",
                              tile_table(tiles, depths, peak)),
                             (f"The forward, CPU, {threads} thread{plural} ({peak_words})", table(rows, packed, peak))):
            print(f"\n== {title} ==", *lines, sep="\n", flush=True)
            markdown += [f"#### {title}", "", *lines, ""]
    if args.markdown:
        write_markdown(args.markdown, markdown)


if __name__ == "__main__":
    run_tool(lambda: main(sys.argv[1:]))
