"""ext's products against the best CPU libraries a user could pick, each library in its own process.

    python -m bench.linear --peers --threads 2,1 --markdown bench_peers.md

For each shape (batch x in -> out) and each product of a training step, the forward Y = X·Wᵀ (+ b for ext
and oneDNN), dX = dY·W and dW = dYᵀ·X, it times:
- ext: ext.linear, as a layer calls it, and the backward ops (linear_backward_input, linear_backward_weight)
  through ext._calls, the direct calls ext.linear makes (ext/csrc/python_calls.cpp). In training, autograd
  calls them from C++ and pays neither;
- torch: F.linear and torch.mm, torch's default (the BLAS torch was built with; MKL in the pip wheels);
- OpenBLAS: numpy's matmul (the OpenBLAS numpy bundles, its own CPU detection; OPENBLAS_CORETYPE and
  OPENBLAS_L2_SIZE are unset in its process only, as some machines here set them and they slow a current
  OpenBLAS; threadpoolctl sets its threads and names the kernel it runs). Its forward has no bias add: the
  comparison favours it slightly;
- oneDNN: torch's mkldnn ops (mkldnn_linear, mkldnn_linear_backward_input/_weights) on tensors already in
  oneDNN's layout, so no conversion is timed.

Each library runs in a worker process of its own, because a library's idle threads spin: measured in one
process with another, a side ran at a third of its speed. The parent asks the workers in turn, one at a time,
in an order that rotates each round, and pauses between them (PAUSE_S) so that the last one's spinning
threads have gone to sleep. A side's time is the median of its rounds' medians; ext/best is the best peer's
time over ext's (above 1: ext is faster), with its range over the rounds, and their geomean over the products
with a 95% interval (bench/stats.py). % of peak is ext's share of the
FMA peak ext measures on this machine, read by ext's worker right after each of its rounds: each round's time
against the reading of the same moment, the median over rounds with its range. A shared machine's slow
moments then slow both, rather than a product timed in one counting against a peak read in another.
Each side's call alone is timed too, as the products of a 1x1->1 layer, and a product not ahead of its best
peer in every round is compared again net of each side's call, with the range the rounds' extremes allow: for
a product of a few microseconds, how fast each side computes. The summary counts a product behind its peer (or
short of 90% of peak) only where every round is, ahead (or at 90%) only where every round is, and else within
noise. A library missing or unusable ends the run with one line naming it (PeerUnavailable); so does a side
failing or killed mid-run, naming the product.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

LIBRARIES = ("ext", "torch", "openblas", "onednn")
PEERS = LIBRARIES[1:]
LABELS = {"ext": "ext", "torch": "torch", "openblas": "OpenBLAS", "onednn": "oneDNN"}
PRODUCTS = ("forward", "dX", "dW")
PAUSE_S = 0.2  # OpenBLAS's threads spin ~0.1 s after a call (THREAD_TIMEOUT 2^28 cycles) before they sleep
BLOCK_S = 0.01  # each timed block repeats the call until it lasts this long
PEAK_GOAL = 0.90  # the goal: ext at >= 90% of peak where the GEMM is big enough to reach it
PEAK_GOAL_MIN = (128, 128, 256)  # ... that is, with M, N >= 128 and K >= 256
OPENBLAS_SLOWING_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
CALL_SHAPE = (1, 1, 1)  # a product of one multiply-add: what remains is the call itself


def gemm_dims(shape, product):
    """(M, N, K) of a product of a linear layer of shape (batch, in, out)."""
    batch, fan_in, fan_out = shape
    return {"forward": (batch, fan_out, fan_in), "dX": (batch, fan_in, fan_out),
            "dW": (fan_out, fan_in, batch)}[product]


# ---- the worker side: one library, timing what the parent asks, in its own process

def block_times(call, min_run_time_s, clock=time.perf_counter):
    """Seconds per call, one value per block of calls, for about min_run_time_s after two warm calls; and the
    calls made in all. `clock` reads the time (bench.linear's waits for the GPU first)."""
    call()
    call()
    number, calls = 1, 2
    while True:  # calls per block: enough for BLOCK_S, so the timer's resolution does not matter
        start = clock()
        for _ in range(number):
            call()
        elapsed = clock() - start
        calls += number
        if elapsed >= BLOCK_S:
            break
        number *= 2
    times, total = [elapsed / number], elapsed
    while total < min_run_time_s:
        start = clock()
        for _ in range(number):
            call()
        elapsed = clock() - start
        calls += number
        times.append(elapsed / number)
        total += elapsed
    return times, calls


def inputs(shape):
    """X, W, b and dY of a linear layer of shape (batch, in, out): float32 numpy arrays, the same for every
    library (the torch sides share their memory)."""
    import numpy as np

    batch, fan_in, fan_out = shape
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, fan_in), dtype=np.float32),
            "w": rng.standard_normal((fan_out, fan_in), dtype=np.float32) / np.float32(math.sqrt(fan_in)),
            "b": rng.standard_normal(fan_out, dtype=np.float32),
            "dy": rng.standard_normal((batch, fan_out), dtype=np.float32)}


def calls(library, shape):
    """{product: call} for `library` on inputs(shape); each call returns the product (oneDNN's in its own
    layout)."""
    arrays = inputs(shape)
    if library == "openblas":
        import numpy as np

        x, w, dy = arrays["x"], arrays["w"], arrays["dy"]
        y, dx, dw = (np.empty((a.shape[0], b.shape[0]), np.float32) for a, b in ((x, w), (dy, w.T), (dy.T, x.T)))
        # transposed views go to sgemm as its transpose flags: no copy is timed
        return {"forward": lambda: np.matmul(x, w.T, out=y), "dX": lambda: np.matmul(dy, w, out=dx),
                "dW": lambda: np.matmul(dy.T, x, out=dw)}
    import torch
    import torch.nn.functional as F

    x, w, b, dy = (torch.from_numpy(arrays[name]) for name in ("x", "w", "b", "dy"))
    if library == "ext":
        ext = importlib.import_module("ext")
        calls = ext._calls
        return {"forward": lambda: ext.linear(x, w, b), "dX": lambda: calls.linear_backward_input(dy, w),
                "dW": lambda: calls.linear_backward_weight(dy, x)}
    if library == "torch":
        return {"forward": lambda: F.linear(x, w, b), "dX": lambda: torch.mm(dy, w),
                "dW": lambda: torch.mm(dy.t(), x)}
    xm, wm, bm, dym = x.to_mkldnn(), w.to_mkldnn(), b.to_mkldnn(), dy.to_mkldnn()
    aten = torch.ops.aten
    return {"forward": lambda: torch._C._nn.mkldnn_linear(xm, wm, bm),
            "dX": lambda: aten.mkldnn_linear_backward_input(list(x.shape), dym, w),
            "dW": lambda: aten.mkldnn_linear_backward_weights(dym, xm, wm, False)[0]}


class Unusable(Exception):
    """This worker's library cannot run here; the message says what was wrong and what to do."""


# What to do when a library fails to start in a way its own checks do not name
WHAT_TO_DO = {
    "ext": "check that `python -c 'import ext'` works in this environment (ext/README.md: the build)",
    "torch": "reinstall the torch of requirements.txt (pip install -r requirements.txt)",
    "openblas": "reinstall numpy's pip wheel, which bundles OpenBLAS (pip install --force-reinstall numpy)",
    "onednn": "use a torch build with oneDNN, as the pip wheels are (torch.backends.mkldnn.is_available())",
}


class Worker:
    """The library's side of the conversation: set threads, build a shape's calls, time one. Raises Unusable
    where the library cannot run here."""

    def __init__(self, library):
        from trainer import memory

        memory.set_up(keep=True)  # as bench.linear and the trainer run: freed memory kept for reuse, every side alike
        self.library = library
        self.calls = {}
        self.set_threads, self.description = open_library(library)
        try:  # each product once on a 1x1->1 layer: a library that loads but cannot compute fails here, not mid-run
            for call in calls(library, CALL_SHAPE).values():
                call()
        except Exception as error:
            raise Unusable(f"its products fail on a 1x1->1 layer ({first_line(error)}): {WHAT_TO_DO[library]}")

    @staticmethod
    def ext_path():
        import torch

        importlib.import_module("ext")
        return torch.ops.ext.cpu_path()

    def answer(self, request):
        self.set_threads(request["threads"])
        shape = tuple(request["shape"])
        if shape not in self.calls:
            self.calls = {shape: calls(self.library, shape)}
        answer = {"seconds": block_times(self.calls[shape][request["product"]], request["min_run_time"])[0]}
        if request.get("then_peak"):  # the FMA peak of the same moment (ext's own probe, ~0.05 s)
            import torch
            answer["peak_gflops"] = torch.ops.ext.fma_peak_gflops(request["threads"])
        return answer


def open_library(library):
    """(set_threads, description) of `library`; Unusable where it is missing or not what this compares."""
    if library == "openblas":
        try:
            import numpy as np  # loads OpenBLAS, for threadpoolctl to find
            from threadpoolctl import threadpool_info, threadpool_limits
        except ImportError as error:
            raise Unusable(f"{first_line(error)}: install numpy and threadpoolctl (pip install -r requirements.txt)")
        blas = [info for info in threadpool_info() if info.get("user_api") == "blas"]
        openblas = [info for info in blas if info.get("internal_api") == "openblas"]
        if not openblas:
            found = ", ".join(str(info.get("internal_api")) for info in blas) or "none"
            raise Unusable(f"numpy {np.__version__} runs no OpenBLAS that threadpoolctl finds (BLAS found: {found}): "
                           f"{WHAT_TO_DO[library]}")
        info = openblas[0]
        return (lambda count: threadpool_limits(limits=count, user_api="blas"),
                f"OpenBLAS {info.get('version')} (numpy {np.__version__}), kernels for {info.get('architecture')}, "
                f"{info.get('threading_layer')} threads")
    import torch

    if library == "onednn" and not torch.backends.mkldnn.is_available():
        raise Unusable(f"torch {torch.__version__} was built without oneDNN: {WHAT_TO_DO[library]}")
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    onednn = re.search(r"MKL-DNN (v[\d.]+)", config)
    description = {
        "ext": lambda: f"ext (CPU path {Worker.ext_path()})",
        "torch": lambda: f"torch {torch.__version__} F.linear / torch.mm (BLAS: {blas[1] if blas else 'unknown'})",
        "onednn": lambda: f"oneDNN {onednn[1] if onednn else ''} through torch's mkldnn ops",
    }[library]()
    return torch.set_num_threads, description


def first_line(error):
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def worker_main(library):
    """`python -m bench.peers <library>`: answer one JSON request per line on stdin, one per line on stdout. The
    first line is the library's description, or {"error": ...} where it cannot run (and the worker ends)."""
    # Ctrl-C reaches every process of the terminal: the parent's `finally` closes the workers, without their
    # tracebacks; a worker asked to time something finishes it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(library)
    except Unusable as error:
        report_unusable(str(error))
    except Exception as error:  # an unforeseen failure still comes back as one line, with what to try
        report_unusable(f"{first_line(error)}: {WHAT_TO_DO[library]}")
    print(json.dumps({"description": worker.description}), flush=True)
    for line in sys.stdin:
        try:
            answer = worker.answer(json.loads(line))
        except Exception as error:  # mid-run (out of memory on a large shape, say): one line for the parent
            report_unusable(first_line(error))
        print(json.dumps(answer), flush=True)


def report_unusable(message):
    print(json.dumps({"error": message}), flush=True)
    sys.exit(1)


# ---- the parent side

class PeerUnavailable(RuntimeError):
    """A side of --peers cannot run here: the message names its library and what to do."""


class WorkerProcess:
    def __init__(self, library):
        self.label = LABELS[library]
        env = dict(os.environ)
        if library == "openblas":
            for name in OPENBLAS_SLOWING_VARIABLES:
                env.pop(name, None)
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen([sys.executable, "-m", "bench.peers", library], cwd=repo, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            first = self.receive()
        except BaseException:  # Ctrl-C while it starts: no process left behind
            self.close()
            raise
        if "error" in first:
            self.close()
            raise PeerUnavailable(f"--peers cannot run its {LABELS[library]} side: {first['error']}")
        self.description = first["description"]

    def ask(self, **request):
        """The worker's answer to `request`; PeerUnavailable, naming the library and the product, where it
        failed (the tables finished before stay printed, and written with --markdown)."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it has ended: receive says how
            pass
        answer = self.receive()
        if "error" in answer:
            batch, fan_in, fan_out = request["shape"]
            raise PeerUnavailable(f"--peers: its {self.label} side failed on {batch}x{fan_in}->{fan_out}'s "
                                  f"{request['product']} ({request['threads']} threads): {answer['error']}")
        return answer

    def receive(self):
        line = self.process.stdout.readline()
        if not line:  # killed (the OOM killer, say) or crashed, without a word for us
            code = self.process.wait()
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            raise PeerUnavailable(f"--peers: its {self.label} side's process ended early ({how}); "
                                  "what it printed, if anything, is above")
        return json.loads(line)

    def close(self):
        """Ends the worker: it sees the end of its input once it has answered what it was asked."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # it has ended already
            pass
        self.process.wait()


@dataclass
class PeerRow:
    shape: tuple
    product: str
    seconds: dict  # library -> median of its round medians
    round_seconds: dict  # library -> each round's median
    round_peaks: list  # the FMA peak (GFLOP/s) read right after each of ext's rounds

    @property
    def flops(self):
        m, n, k = gemm_dims(self.shape, self.product)
        return 2 * m * n * k

    @property
    def best_peer(self):
        return min(PEERS, key=lambda library: self.seconds[library])

    @property
    def ratio(self):
        """The best peer's time over ext's: above 1, ext is faster."""
        return self.seconds[self.best_peer] / self.seconds["ext"]

    @property
    def round_ratios(self):
        return [peer / ours for peer, ours in zip(self.round_seconds[self.best_peer], self.round_seconds["ext"])]

    @property
    def round_peak_shares(self):
        """ext's share of the FMA peak in each round: its time against the peak read in the same moment."""
        return [self.flops / seconds / 1e9 / peak for seconds, peak in zip(self.round_seconds["ext"], self.round_peaks)]

    @property
    def peak_share(self):
        return statistics.median(self.round_peak_shares)

    @property
    def peak_goal_applies(self):
        return all(dim >= least for dim, least in zip(gemm_dims(self.shape, self.product), PEAK_GOAL_MIN))

    def cells(self):
        m, k, n = self.shape
        gflops = [f"{self.flops / self.seconds[library] / 1e9:.0f}" for library in LIBRARIES]
        low, high = min(self.round_ratios), max(self.round_ratios)
        goal = "" if not self.peak_goal_applies else " (goal 90%)"
        shares = self.round_peak_shares
        return [f"{m}x{k}->{n}", self.product, "x".join(map(str, gemm_dims(self.shape, self.product))),
                f"{self.seconds['ext'] * 1e3:.3f}", *gflops, LABELS[self.best_peer], f"{self.ratio:.2f}",
                f"{low:.2f}-{high:.2f}", f"{percent(self.peak_share)} ({percent(min(shares))}-{percent(max(shares))}){goal}"]


def percent(share):
    """A share of the peak as printed: to a tenth of a percent, rounded down, so that a share short of the
    goal (89.96%) never prints as the goal's 90.0%."""
    return f"{math.floor(share * 1000 + 1e-9) / 10:.1f}%"


HEADER = ["shape (batch x in->out)", "product", "M x N x K", "ext ms", "ext GFLOP/s", "torch GFLOP/s",
          "OpenBLAS GFLOP/s", "oneDNN GFLOP/s", "best peer", "ext/best", "by round",
          "ext % of FMA peak (by round)"]


def measure_product(workers, shape, product, threads, min_run_time_s, rounds):
    """One product of one shape on every library, the workers asked in an order that rotates each round."""
    per_round = {library: [] for library in LIBRARIES}
    peaks = []
    for index in range(rounds):
        order = LIBRARIES[index % len(LIBRARIES):] + LIBRARIES[:index % len(LIBRARIES)]
        for library in order:
            answer = workers[library].ask(threads=threads, shape=shape, product=product, min_run_time=min_run_time_s,
                                          then_peak=library == "ext")
            per_round[library].append(statistics.median(answer["seconds"]))
            if library == "ext":
                peaks.append(answer["peak_gflops"])
            time.sleep(PAUSE_S)
    return PeerRow(shape, product, {lib: statistics.median(t) for lib, t in per_round.items()}, per_round, peaks)


def measure(workers, shapes, threads, min_run_time_s, rounds, progress=print):
    """The rows of one thread count (every shape x product) and each side's call alone (the products of
    CALL_SHAPE, by product)."""
    rows = []
    for shape in shapes:
        rows += [measure_product(workers, shape, product, threads, min_run_time_s, rounds) for product in PRODUCTS]
        m, k, n = shape
        progress(f"{m}x{k}->{n}: ext/best peer " + ", ".join(f"{r.product} {r.ratio:.2f} ({LABELS[r.best_peer]})"
                                                             for r in rows[-len(PRODUCTS):]))
    calls = {product: measure_product(workers, CALL_SHAPE, product, threads, min_run_time_s, rounds)
             for product in PRODUCTS}
    return rows, calls


def net_seconds(row, calls, side):
    """A side's product time less its call alone: from their medians, and the least and the most the rounds
    allow (its fastest round of the product less its slowest of the call, and the reverse). The call is timed
    after the products, so no round of one is paired with a round of the other."""
    product, call = row.round_seconds[side], calls[row.product].round_seconds[side]
    return (row.seconds[side] - calls[row.product].seconds[side], min(product) - max(call),
            max(product) - min(call))


def net_of_calls(row, calls):
    """The best peer's time over ext's, each less its own call alone (calls: measure's), with its range from
    the rounds' extremes: how the two compute, where a product lasts a few microseconds and the calls differ
    by one. None where a side's product cannot be told from its call alone (its fastest round of the product
    no slower than its slowest of the call): then there is no computing time to compare."""
    peer, ours = net_seconds(row, calls, row.best_peer), net_seconds(row, calls, "ext")
    if peer[1] <= 0 or ours[1] <= 0:
        return None
    return peer[0] / ours[0], peer[1] / ours[2], peer[2] / ours[1]


def net_of_calls_words(row, calls):
    net = net_of_calls(row, calls)
    if net is None:
        return "within noise net of the calls: a side's product no slower than its call alone in some round"
    value, low, high = net
    return f"{value:.2f} net of each side's call ({low:.2f}-{high:.2f} at the rounds' extremes)"


def against_line(low, high, line):
    """'above' where every round is at or above `line`, 'below' where every round is below it, else 'noise':
    a median on one side of the line with rounds on both says nothing about which side the product is on."""
    return "above" if low >= line else "below" if high < line else "noise"


def summary_lines(rows, calls):
    """The geomean of ext/best with its interval over rounds, each side's call alone, how many products are ahead
    of their best peer, level within noise and behind, round by round (those not ahead listed, with the
    ratio net of the calls), and the products the 90% of peak goal applies to that are not at 90% in every
    round."""
    from bench import stats  # numpy and torch: the parent's, not imported where an OpenBLAS worker runs

    lowest = min(rows, key=lambda row: row.ratio)
    headline = stats.geomean_text([([row.round_seconds[peer] for peer in PEERS], row.round_seconds["ext"])
                                   for row in rows])
    lines = [f"geomean ext/best peer over {len(rows)} products: {headline}; lowest {lowest.ratio:.2f} "
             f"({lowest.cells()[0]} {lowest.product}, best peer {LABELS[lowest.best_peer]})"]
    lines.append("the call alone (a 1x1->1 product; µs per call, forward / dX / dW): " + "; ".join(
        f"{LABELS[library]} " + " / ".join(f"{calls[product].seconds[library] * 1e6:.1f}" for product in PRODUCTS)
        for library in LIBRARIES))
    against_peer = {"above": [], "noise": [], "below": []}
    for row in rows:
        against_peer[against_line(min(row.round_ratios), max(row.round_ratios), 1.0)].append(row)
    lines.append(f"against the best peer, round by round: {len(against_peer['above'])} of {len(rows)} products "
                 f"level or ahead in every round, {len(against_peer['noise'])} level within noise (ahead in some "
                 f"rounds, behind in others), {len(against_peer['below'])} behind in every round")
    for verdict, words in (("below", "behind the best peer in every round"),
                           ("noise", "level with the best peer within noise")):
        if against_peer[verdict]:
            lines.append(f"{words}: " + ", ".join(
                f"{row.cells()[0]} {row.product} {row.ratio:.2f} (by round {min(row.round_ratios):.2f}-"
                f"{max(row.round_ratios):.2f}; {LABELS[row.best_peer]}; {net_of_calls_words(row, calls)})"
                for row in against_peer[verdict]))
    lines.append(peak_goal_line([row for row in rows if row.peak_goal_applies]))
    return lines


def peak_goal_line(rows):
    """How many of the rows (those the goal applies to) are at 90% of peak in every round, how many within
    noise of it (some rounds at it, some below) and how many short of it in every round, the last two named."""
    if not rows:
        return "the 90% of peak goal applies to none of these products (none has M, N >= 128 and K >= 256)"
    against_goal = {"above": [], "noise": [], "below": []}
    for row in rows:
        shares = row.round_peak_shares
        against_goal[against_line(min(shares), max(shares), PEAK_GOAL)].append(row)

    def named(rows):
        return ", ".join(f"{row.cells()[0]} {row.product} {percent(row.peak_share)} "
                         f"({percent(min(row.round_peak_shares))}-{percent(max(row.round_peak_shares))})"
                         for row in rows)

    line = (f"{len(against_goal['above'])} of the {len(rows)} products with M, N >= 128 and K >= 256 at 90% of peak "
            f"in every round, {len(against_goal['noise'])} within noise of it, {len(against_goal['below'])} short "
            "of it in every round")
    if against_goal["noise"]:
        line += f"; within noise of 90%: {named(against_goal['noise'])}"
    if against_goal["below"]:
        line += f"; short of 90%: {named(against_goal['below'])}"
    return line


def run(shapes, thread_counts, min_run_time_s, rounds, markdown, table_done=lambda: None):
    """Start the workers, measure each thread count, print and add to `markdown` (a list of lines), calling
    table_done() after each thread count's table (so that a run cut short keeps the tables it finished).
    Raises PeerUnavailable where a library cannot run here."""
    workers = {}
    try:
        for library in LIBRARIES:  # inside `try`: a side that cannot start closes those started before it
            workers[library] = WorkerProcess(library)
        sides = "; ".join(workers[library].description for library in LIBRARIES)
        print(f"sides, each in its own process: {sides}")
        markdown += [f"Sides, each in its own process: {sides}.", ""]
        for threads in thread_counts:
            rows, calls = measure(workers, shapes, threads, min_run_time_s, rounds,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
            peaks = [peak for row in rows for peak in row.round_peaks]
            title = (f"CPU, {threads} thread{'s' if threads != 1 else ''}: ext against the best peer (ext/best: the "
                     "best peer's time over ext's, above 1: ext faster; FMA peak read after each of ext's rounds: "
                     f"{min(peaks):.0f}-{max(peaks):.0f} GFLOP/s, median {statistics.median(peaks):.0f})")
            table = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
            table += ["| " + " | ".join(row.cells()) + " |" for row in rows]
            summary = summary_lines(rows, calls)
            print(f"\n== {title} ==")
            print("\n".join(table))
            print("\n".join(summary), flush=True)
            markdown += [f"### {title}", "", *table, "", *[f"- {line}" for line in summary], ""]
            table_done()
    finally:
        for worker in workers.values():
            worker.close()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in LIBRARIES:
        print("bench.peers is the worker process of `python -m bench.linear --peers` (run that); as a worker it "
              f"takes one of {', '.join(LIBRARIES)}, got {' '.join(sys.argv[1:]) or 'nothing'}", file=sys.stderr)
        sys.exit(2)  # a usage error, as argparse's
    worker_main(sys.argv[1])
