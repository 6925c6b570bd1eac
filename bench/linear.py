"""Kernel benchmark: `ext.linear` against `torch.nn.functional.linear`.

For each shape (batch x in -> out) it times the forward, the backward and both
together (float32, bias on, input and weight requiring grad), alternating torch
and ext measurements in one process so that a busy moment on the machine hits
both. It prints times, GFLOP/s, the ratio torch/ext (above 1: ext is faster)
with its lowest and highest value over the rounds (how far one run on a shared
machine can be trusted), and ext's share of this machine's FMA peak, measured by
the extension itself (the highest of the readings taken before the first shape
and after each); then geometric means of the ratios, again with their range over
the rounds. Each shape's ratios print to stderr as it finishes; each thread
count's tables print once all shapes are done.

With --products it times instead each product of a training step alone, without
autograd: the forward Y = X·Wᵀ + b (ext.linear), dX = dY·W, dW = dYᵀ·X and db = the
sum of dY's rows (the backward ops through ext._calls, the direct calls ext.linear
makes), against the torch calls that compute the same.

Example:
    python -m bench.linear --threads all,1 --markdown bench_linear.md
    python -m bench.linear --products --threads 1 --shapes '128x784->256'
    python -m bench.linear --cpu-path avx2+fma     # the AVX2 kernels (what a Zen3 runs) on this CPU
    python -m bench.linear --peers --threads 2,1   # each product against torch, OpenBLAS and oneDNN (bench/peers.py)
    python -m bench.linear --cuda-only              # on a GPU: float32, float32 with TF32 and bfloat16 vs cuBLAS
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python bench/linear.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ext  # noqa: E402
from bench import peers, stats  # noqa: E402
from bench.machine import (command_line, describe_cpu, markdown_path, positive_int, positive_seconds,  # noqa: E402
                           run_tool, thread_count, usable_cpus, write_markdown)
from trainer import memory  # noqa: E402

MLP_SHAPES = [(128, 784, 256), (128, 256, 256), (128, 256, 10), (512, 784, 256), (512, 256, 256)]
HEAD_SHAPES = [(128, 512, 10), (128, 2048, 1000)]
SQUARE_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048)]
SHAPES = MLP_SHAPES + HEAD_SHAPES + SQUARE_SHAPES
QUICK_SHAPES = [(128, 784, 256), (128, 256, 10), (1024, 1024, 1024)]
CUDA_EXTRA_SHAPES = [(4096, 4096, 4096)]
CPU_PATHS = ("avx512", "avx2+fma", "portable")  # torch.ops.ext.set_cpu_path's names
# The CUDA tables: {name: (dtype, torch.backends.cuda.matmul.allow_tf32)}, each side under the same flag,
# and the share of cuBLAS's speed at 4096^3 each aims for (issue 24's goals on an H100).
CUDA_PRECISIONS = {"float32": (torch.float32, False), "float32 with TF32": (torch.float32, True),
                   "bfloat16": (torch.bfloat16, False)}
CUDA_GOALS = {"float32": 0.8, "bfloat16": 0.7}

# Flops per pass, in units of M*N*K multiply-adds (2 flops each): the forward is
# one product, the backward two (dX and dW; db is a sum, negligible).
PASSES = {"forward": 2, "backward": 4, "fwd+bwd": 6}
# The same for each product alone (--products); db is no GEMM, so it gets no GFLOP/s.
PRODUCTS = {"forward": 2, "dX": 2, "dW": 2, "db": 0}
FLOPS_PER_MNK = {**PASSES, **PRODUCTS}

# From this many page faults per call (after one warm call, in the median round) a side's time is
# noted as not the kernel's alone. A warm call reuses memory and faults none; with glibc's defaults
# (--malloc-defaults) some processes hand freed blocks back to the system and every call faults
# them in again (seen: 150 per fwd+bwd of 128x784->256, 580-830 per 512x784->256, 0.7 ms of its
# 2.7, 2,000 per 1024^3), on either side.
FAULTS_NOTED_PER_CALL = 2.0


@dataclass
class Row:
    device: str
    threads: str
    shape: tuple[int, int, int]
    pass_name: str
    torch_rounds: tuple[float, ...]  # torch's median time in each round
    ext_rounds: tuple[float, ...]
    peak_gflops: float | None
    faults_per_call: tuple[float, float] = (0.0, 0.0)  # torch's and ext's page faults per timed call

    @property
    def torch_s(self) -> float:
        return statistics.median(self.torch_rounds)

    @property
    def ext_s(self) -> float:
        return statistics.median(self.ext_rounds)

    @property
    def round_ratios(self) -> tuple[float, ...]:
        return tuple(t / e for t, e in zip(self.torch_rounds, self.ext_rounds))

    @property
    def flops(self) -> float:
        m, k, n = self.shape
        return FLOPS_PER_MNK[self.pass_name] * m * n * k

    @property
    def ratio(self) -> float:
        return self.torch_s / self.ext_s

    def gflops(self, seconds: float) -> float:
        return self.flops / seconds / 1e9

    def cells(self) -> list[str]:
        m, k, n = self.shape
        gflops = [f"{self.gflops(s):.0f}" if self.flops else "-" for s in (self.torch_s, self.ext_s)]
        peak = f"{100 * self.gflops(self.ext_s) / self.peak_gflops:.0f}%" if self.peak_gflops and self.flops else "-"
        return [f"{m}x{k}->{n}", self.pass_name, f"{self.torch_s * 1e3:.3f}", f"{self.ext_s * 1e3:.3f}",
                *gflops, f"{self.ratio:.2f}", ratio_range(self.round_ratios), peak]


HEADER = ["shape (batch x in->out)", "pass", "torch ms", "ext ms", "torch GFLOP/s", "ext GFLOP/s",
          "torch/ext", "by round", "ext % of FMA peak"]


def ratio_range(ratios) -> str:
    """'1.09-1.16': the lowest and highest of some ratios, or '-' with fewer than two (one round's ratio
    is no range: --rounds 1)."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"


def make_statements(linear, x, w, b, dy):
    """The three timed statements for one implementation of linear."""
    forward_out = linear(x, w, b)
    return {
        "forward": lambda: linear(x, w, b),
        "backward": lambda: torch.autograd.grad(forward_out, (x, w, b), dy, retain_graph=True),
        "fwd+bwd": lambda: torch.autograd.grad(linear(x, w, b), (x, w, b), dy),
    }


def make_product_statements(x, w, b, dy):
    """The four products of a training step alone, {name: (torch's call, ext's call)}."""
    x, w, b = x.detach(), w.detach(), b.detach()
    calls = ext._calls  # the backward ops as ext.linear's direct calls reach them (ext/csrc/python_calls.cpp)
    return {
        "forward": (lambda: F.linear(x, w, b), lambda: ext.linear(x, w, b)),
        "dX": (lambda: torch.mm(dy, w), lambda: calls.linear_backward_input(dy, w)),
        "dW": (lambda: torch.mm(dy.t(), x), lambda: calls.linear_backward_weight(dy, x)),
        "db": (lambda: dy.sum(0), lambda: calls.linear_backward_bias(dy)),
    }


def synchronized_clock() -> float:
    """The time once the GPU has run what was queued: a block of calls is timed to its last kernel's end."""
    torch.cuda.synchronize()
    return time.perf_counter()


def time_interleaved(statements: dict, min_run_time_s: float,
                     rounds: int) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
    """Seconds per call of each statement, one list of block times per round, measured in alternating rounds;
    and each statement's page faults per call, in its median round. Blocks as the peers' (peers.block_times):
    each measurement lasts about min_run_time_s. (torch.utils.benchmark's blocked_autorange, used before,
    grew its blocks tenfold at a time and measured each statement up to ten times as long.)"""
    clock = synchronized_clock if torch.cuda.is_available() else time.perf_counter
    samples = {name: [] for name in statements}
    faults_per_call = {name: [] for name in statements}
    for fn in statements.values():
        fn()  # first touches of memory, before any call is counted
    for _ in range(rounds):
        for name, fn in statements.items():
            faults_before = memory.minor_page_faults()
            times, calls = peers.block_times(fn, min_run_time_s, clock)
            faults_per_call[name].append((memory.minor_page_faults() - faults_before) / calls)
            samples[name].append(times)
    return samples, {name: statistics.median(faults) for name, faults in faults_per_call.items()}


def compare(pass_name, shape, device, threads_label, peak_gflops, torch_rounds, ext_rounds,
            faults_per_call=(0.0, 0.0)) -> Row:
    """A row from each side's block times per round. A side's time is the median of its round medians, so
    the ratio of the two always lies within the range of the rounds' own ratios."""
    return Row(device, threads_label, shape, pass_name, tuple(statistics.median(times) for times in torch_rounds),
               tuple(statistics.median(times) for times in ext_rounds), peak_gflops, tuple(faults_per_call))


def fault_notes(rows: list[Row]) -> list[str]:
    """A line for each row where a side page-faulted on most calls: its time is not the kernel's alone."""
    notes = []
    for r in rows:
        faulting = [f"{side} {count:.0f}" for side, count in zip(("torch", "ext"), r.faults_per_call)
                    if count >= FAULTS_NOTED_PER_CALL]
        if faulting:
            m, k, n = r.shape
            notes.append(f"note: {m}x{k}->{n} {r.pass_name}: page faults per call: {', '.join(faulting)}; "
                         "freed memory went back to the system and was faulted in again each call, which its "
                         "time includes (bench/README.md, Memory)")
    return notes


def bench_shape(shape, device, threads_label, min_run_time_s, rounds, products=False,
                dtype=torch.float32) -> list[Row]:
    """One shape's rows, without a peak (main adds the peak once it has every reading)."""
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(dtype).requires_grad_()
    b = torch.randn(n, device=device, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(m, n, device=device, generator=gen).to(dtype)
    if products:
        pairs = make_product_statements(x, w, b, dy)
    else:
        torch_calls, ext_calls = make_statements(F.linear, x, w, b, dy), make_statements(ext.linear, x, w, b, dy)
        pairs = {pass_name: (torch_calls[pass_name], ext_calls[pass_name]) for pass_name in PASSES}
    rows = []
    for pass_name, (torch_call, ext_call) in pairs.items():
        times, faults = time_interleaved({"torch": torch_call, "ext": ext_call}, min_run_time_s, rounds)
        rows.append(compare(pass_name, shape, device, threads_label, None, times["torch"], times["ext"],
                            (faults["torch"], faults["ext"])))
    return rows


def geomean_text(rows: list[Row]) -> str:
    """The geometric mean of the rows' torch/ext, with its 95% interval over the rounds (bench/stats.py)."""
    return stats.geomean_text([([r.torch_rounds], r.ext_rounds) for r in rows])


def summary_lines(rows: list[Row]) -> list[str]:
    lines = []
    for pass_name in dict.fromkeys(r.pass_name for r in rows):
        of_pass = [r for r in rows if r.pass_name == pass_name]
        mlp = [r for r in of_pass if r.shape in MLP_SHAPES]
        text = f"geomean torch/ext, {pass_name}: all shapes {geomean_text(of_pass)}"
        if mlp:
            text += f", MLP shapes {geomean_text(mlp)}"
        lines.append(text)
    return lines


def cuda_goal_lines(rows: list[Row], precision: str) -> list[str]:
    """Where the precision has a goal: ext's share of cuBLAS's speed at 4096^3, forward, against it."""
    goal = CUDA_GOALS.get(precision)
    big = [r for r in rows if r.shape == CUDA_EXTRA_SHAPES[0] and r.pass_name == "forward"]
    if goal is None or not big:
        return []
    r = big[0]
    verdict = "met" if min(r.round_ratios) >= goal else "not met" if max(r.round_ratios) < goal else "within noise"
    return [f"goal at 4096^3 forward: ext at >= {goal:.0%} of cuBLAS; measured {r.ratio:.0%} "
            f"(by round {ratio_range(r.round_ratios)}): {verdict}"]


def fma_peak_gflops(threads: int) -> float:
    """One reading of this machine's FMA peak on `threads` threads (the extension's own FMA loop, ~0.1 s)."""
    return torch.ops.ext.fma_peak_gflops(threads)


def progress_line(rows: list[Row]) -> str:
    """One shape's rows in brief, printed (to stderr) as the shape finishes: '128x256->10: torch/ext forward 1.90, ...'."""
    m, k, n = rows[0].shape
    return f"{m}x{k}->{n}: torch/ext " + ", ".join(f"{r.pass_name} {r.ratio:.2f}" for r in rows)


def format_text(rows: list[Row]) -> str:
    """Rows as fixed-width text lines (the widths of HEADER)."""
    return "\n".join("  ".join(cell.rjust(max(len(title), 8)) for cell, title in zip(r.cells(), HEADER)) for r in rows)


def format_markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def parse_threads(text: str) -> list[int]:
    """'all,1' -> [the CPUs this process may use, 1]."""
    counts = []
    for item in text.split(","):
        try:
            counts.append(thread_count(item))
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"bad thread count {item.strip()!r} ({error}): write positive integers "
                                             "or 'all', e.g. all,1") from None
    return counts


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'128x256->10,1024x1024->1024' -> [(128, 256, 10), (1024, 1024, 1024)] (batch x in -> out)."""
    shapes = []
    for item in text.split(","):
        try:
            batch_in, out = item.split("->")
            batch, in_features = batch_in.split("x")
            shape = (int(batch), int(in_features), int(out))
        except ValueError:
            shape = (0,)
        if min(shape) <= 0:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: write batch x in -> out, each a positive "
                                             "integer, e.g. 128x256->10")
        shapes.append(shape)
    return shapes


def cuda_shape_list(named, shapes):
    """The CUDA tables' shapes: those named alone, else the CPU's and 4096^3 (issue 24's goals)."""
    return named or shapes + CUDA_EXTRA_SHAPES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.linear", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=parse_threads, default="all,1",
                        help="comma-separated thread counts; 'all' = every core")
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK_SHAPES)} shapes, shorter runs")
    parser.add_argument("--products", action="store_true",
                        help="time the forward, dX, dW and db products alone (no autograd)")
    parser.add_argument("--peers", action="store_true",
                        help="each product against torch, OpenBLAS and oneDNN, every library in its own process "
                             "(bench/peers.py)")
    parser.add_argument("--shapes", type=parse_shapes, help="only these shapes, e.g. '128x256->10,512x784->256'")
    parser.add_argument("--min-run-time", type=positive_seconds, default=None, help="seconds each side is timed in a round (in blocks of about 10 ms)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating torch/ext rounds per pass")
    parser.add_argument("--markdown", metavar="FILE", type=markdown_path, help="also write the tables as markdown")
    parser.add_argument("--cuda-only", action="store_true", help="only the CUDA tables (float32, TF32, bfloat16)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc's malloc as it is (by default freed memory is kept, as the trainer does: "
                             "trainer/memory.py)")
    parser.add_argument("--cpu-path", choices=CPU_PATHS,
                        help="run ext's kernels on this path (default: the best this CPU has; the %% of peak stays "
                             "against the widest FMA the CPU has)")
    args = parser.parse_args(argv)
    if args.cuda_only and (args.peers or args.cpu_path):
        parser.error("--cuda-only runs the CUDA tables only: leave out --peers and --cpu-path")
    if args.peers and (args.cpu_path or args.products):
        parser.error("--peers times the products on ext's best CPU path: leave out --cpu-path and --products")
    if args.peers and args.malloc_defaults:
        parser.error("--peers keeps freed memory for reuse in every side's process alike: leave out --malloc-defaults")
    if args.cpu_path:
        try:
            torch.ops.ext.set_cpu_path(args.cpu_path)
        except RuntimeError as error:
            parser.error((str(error).splitlines() or [f"cannot run the {args.cpu_path} path"])[0])
    malloc = memory.set_up(keep=not args.malloc_defaults)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    min_run_time_s = args.min_run_time or (0.05 if args.quick else 0.2)
    rounds = args.rounds or (2 if args.quick else 5)

    header = (f"{describe_cpu()}; torch {torch.__version__}, CPU path {torch.ops.ext.cpu_path()}, "
              f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"malloc: {malloc}")
    print(header)
    markdown = [command_line("python -m bench.linear", argv), "", header, ""]

    def save_tables_so_far():  # so that a run cut short keeps the tables it finished
        if args.markdown:
            write_markdown(args.markdown, markdown, announce=False)

    if args.peers:
        try:
            peers.run(shapes, args.threads, min_run_time_s, rounds, markdown, save_tables_so_far)
        except peers.PeerUnavailable as error:
            parser.exit(1, f"{parser.prog}: error: {error}\n")
    else:
        against_torch(args, shapes, min_run_time_s, rounds, markdown, save_tables_so_far)
    if args.markdown:
        write_markdown(args.markdown, markdown)


def against_torch(args, shapes, min_run_time_s, rounds, markdown: list[str], table_done) -> None:
    """ext against F.linear in this process, for each thread count, then on CUDA where there is a GPU:
    prints the tables, appends them to `markdown` as lines and calls table_done() after each."""
    for count in [] if args.cuda_only else args.threads:
        torch.set_num_threads(count)
        # The peak is read before the first shape and after each one, and the highest reading counts: one
        # reading (~0.1 s) can fall in a moment when another tenant holds a core, and then every row's
        # share of it reads too high (seen: 121%). So the table prints once all shapes are done.
        peak_readings = [fma_peak_gflops(count)]
        rows = []
        for shape in shapes:
            shape_rows = bench_shape(shape, "cpu", str(count), min_run_time_s, rounds, args.products)
            peak_readings.append(fma_peak_gflops(count))
            print(progress_line(shape_rows), file=sys.stderr, flush=True)
            rows += shape_rows
        peak = max(peak_readings)
        rows = [replace(r, peak_gflops=peak) for r in rows]
        title = (f"CPU, {count} thread{'s' if count != 1 else ''} (measured FMA peak {peak:.0f} GFLOP/s: the highest "
                 f"of {len(peak_readings)} readings, the lowest {min(peak_readings):.0f})")
        print(f"\n== {title} ==\n" + "  ".join(h.rjust(8) for h in HEADER))
        print(format_text(rows))
        summary = summary_lines(rows) + fault_notes(rows)
        print("\n".join(summary), flush=True)
        markdown += [f"### {title}", "", format_markdown(rows), ""] + [f"- {s}" for s in summary] + [""]
        table_done()

    if torch.cuda.is_available():
        torch.set_num_threads(usable_cpus())
        for precision, (dtype, allow_tf32) in CUDA_PRECISIONS.items():
            title = f"CUDA, {torch.cuda.get_device_name()}, {precision} (vs cuBLAS)"
            print(f"\n== {title} ==\n" + "  ".join(h.rjust(8) for h in HEADER), flush=True)
            before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32  # both sides: ext follows torch's flag
            try:
                rows = []
                for shape in cuda_shape_list(args.shapes, shapes):
                    shape_rows = bench_shape(shape, "cuda", "-", min_run_time_s, rounds, args.products, dtype)
                    print(progress_line(shape_rows), file=sys.stderr, flush=True)
                    rows += shape_rows
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before
            print(format_text(rows))
            summary = summary_lines(rows) + cuda_goal_lines(rows, precision) + fault_notes(rows)
            print("\n".join(summary), flush=True)
            markdown += [f"### {title}", "", format_markdown(rows), ""] + [f"- {s}" for s in summary] + [""]
            table_done()
    else:
        skipped = "CUDA: skipped (torch.cuda.is_available() is False: this machine has no usable GPU)"
        print("\n" + skipped)
        markdown += [skipped, ""]


if __name__ == "__main__":
    run_tool(main)
