"""How much timed work a custom/torch ratio needs on this machine: identical runs compared with each other.

    python -m bench.resolution                          # 4 sizes x 3 pairs, about 8 minutes on 2 cores
    python -m bench.resolution --sizes 1280,20480 --pairs 5 --markdown bench_resolution.md

Each pair is two identical training runs (linear=torch both, the MLP on fake MNIST-size data), one after the
other in their own processes, as a sweep runs its jobs. Their true speed ratio is 1, so every departure from
1, and every interval that leaves 1 out, is the machine's noise. trainer/timing.py's MIN_TIMED_S, below which
a comparison reads "too short to time", is chosen from this table (below it most pairs strayed by more than
MAX_ERROR, with intervals that left 1 out), and so is SEQUENTIAL_NOISE (how far pairs with more work still
strayed: whole runs slowed, which no interval over one run's steps can see).
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import (command_line, describe_cpu, markdown_path, positive_int, positive_ints, run_tool,
                           thread_count, write_markdown)
from trainer import logs, summary, timing

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 5  # the first is left out of the timing, as in every comparison
MAX_ERROR = 0.05


def run_once(folder, train_size, threads):
    """One run into `folder`; its step times per epoch."""
    overrides = ["model=mlp", "linear=torch", "data=fake", "data.image_size=[1,28,28]",
                 f"data.train_size={train_size}", "data.val_size=16", "data.batch_size=128", f"trainer.epochs={EPOCHS}",
                 f"trainer.threads={threads}", f"hydra.run.dir={folder}"]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, capture_output=True,
                            text=True)
    if result.returncode != 0:  # train.py's own one-line reason, not a CalledProcessError's traceback
        reason = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        sys.exit(f"python -m bench.resolution: a run of train.py failed: {reason}")
    return summary.read_run_summary(folder)[summary.STEP_TIMES_KEY]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.resolution", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_ints, default="1280,5120,20480,40960",
                        help="training images per run, comma-separated")
    parser.add_argument("--pairs", type=positive_int, default=3, help="pairs of identical runs per size")
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--markdown", metavar="FILE", type=markdown_path, help="also write the table as markdown")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes:
            for pair in range(args.pairs):
                first, second = (run_once(Path(scratch, f"{size}-{pair}-{side}"), size, args.threads)
                                 for side in ("a", "b"))
                ratio = timing.speedup(timing.timed_steps(first), timing.timed_steps(second))
                strayed = abs(ratio.value - 1) > MAX_ERROR
                excludes_one = ("-" if not ratio.has_interval  # too few steps: no interval to leave 1 out
                                else "yes" if not ratio.low <= 1 <= ratio.high else "no")
                rows.append(f"| {size:,} | {pair + 1} | {ratio.timed_s:.2f} | {ratio.value:.3f} | "
                            f"{ratio.interval_text()} | {'yes' if strayed else 'no'} | {excludes_one} |")
                print(rows[-1], flush=True)
    lines = [command_line("python -m bench.resolution", argv), "", describe_cpu(), "",
             f"MLP 784-256-256-10, batch 128, {logs.counted(args.threads, 'thread')}, {EPOCHS} epochs a run (the first not timed)", "",
             "| images | pair | timed s per run | ratio | 95% interval | off by more than 5% | interval leaves 1 out |",
             "|---|---|---|---|---|---|---|", *rows, ""]
    print("\n".join(lines))
    if args.markdown:
        write_markdown(args.markdown, lines)


if __name__ == "__main__":
    run_tool(main)
