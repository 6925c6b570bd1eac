"""How sure a speed ratio is: step times, a bootstrap interval for the custom/torch ratio, and a verdict in words.

A ratio of two mean epoch times says nothing about how far it could move on a rerun. So runs record every
training step's time, and a comparison resamples them: a moving-block bootstrap over each side's steps
(blocks of consecutive steps, because a busy moment on a shared machine slows neighbouring steps together),
BOOTSTRAP_SAMPLES times, gives a 95% interval for the ratio of the two means. The first epoch is left out
where there are more (it warms up caches, the allocator and any compilation).

What the interval cannot see: a disturbance that lasts a whole job. Two jobs of a sweep run one after the
other, and identical runs one after another differed here by far more than their intervals allow. So a
comparison of jobs that ran one after the other (`sequential=True`: the sweep summary) counts as a
difference only beyond SEQUENTIAL_NOISE; `python -m bench.train`, which interleaves the two sides' epochs in
one process, needs no such margin and is the fairer measurement.

Both thresholds were measured with `python -m bench.resolution` (pairs of identical runs, one after the other)
on an AMD EPYC (Zen 3, 2 vCPUs, shared); bench/README.md has the table:
- MIN_TIMED_S: with 0.09-0.33 s of timed steps, 5 of 6 identical pairs read more than 5% apart, with intervals
  that left 1 out; with 1.3 s, none of 3 did.
- SEQUENTIAL_NOISE: with 1.3-2.9 s, identical pairs still read 0.80-1.07: a whole job ran slower.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_CHUNK = 200
MIN_TIMED_S = 1.0  # less timed work per side: "too short to time"
# Fewer steps per side: "too few steps to time". The bootstrap resamples n steps in blocks of about n^(1/3):
# from 2 steps it can draw only 3 different means, so its "interval" is a point or two (one timed step a side
# read "2.24x, 95% interval 2.24-2.24"); from 20, 18 blocks of 3 give millions of different resamples.
MIN_TIMED_STEPS = 20
SEQUENTIAL_NOISE = 1.25  # identical runs one after the other read up to this far apart (either way)


def synchronize(device):
    """Wait for queued GPU work, so wall-clock times measure the work and not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Marks the end of each training step; `durations_s()` at the end of the epoch gives every step's time.

    On the CPU a clock read per step; on a GPU a CUDA event per step, read once at the end, so that timing
    adds no synchronisation to the steps.
    """

    def __init__(self, device):
        self.device = device
        self.marks = []

    def mark(self):
        if self.device.type == "cuda":  # on the device's own stream: it need not be the current device
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations_s(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1000 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


def timed_steps(step_times_s, warmup_epochs=(0,)):
    """The steps a comparison uses, from a run's per-epoch lists: every epoch but those that warmed a process
    up (`warmup_epochs`, 0-based: the first, and the first after each resume, ran with cold caches and
    allocator), where any other is left."""
    cold = set(warmup_epochs)
    warm = [epoch for index, epoch in enumerate(step_times_s) if index not in cold]
    return [step for epoch in (warm or step_times_s) for step in epoch]


def bootstrap_means(steps, rng, samples=BOOTSTRAP_SAMPLES):
    """Means of `samples` moving-block resamples of `steps`: each draws n/L blocks of L (about n^(1/3))
    consecutive steps. Block sums come from a prefix sum, and resamples are drawn a chunk at a time: a
    million steps take tens of megabytes and about a second."""
    steps = np.asarray(steps, dtype=np.float64)
    n = len(steps)
    block = max(1, round(n ** (1 / 3)))
    blocks_per_sample = max(1, n // block)
    prefix = np.concatenate([[0.0], np.cumsum(steps)])
    block_sums = prefix[block:] - prefix[:-block]  # the sum of the block starting at each step
    means = []
    for chunk in range(0, samples, BOOTSTRAP_CHUNK):  # a chunk of resamples at a time bounds the memory
        starts = rng.integers(0, n - block + 1, size=(min(BOOTSTRAP_CHUNK, samples - chunk), blocks_per_sample))
        means.append(block_sums[starts].sum(axis=1) / (blocks_per_sample * block))
    return np.concatenate(means)


def percentiles(values):
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def mean_interval(steps, scale=1.0, seed=0):
    """'1.02 (95% interval 0.99-1.05)': the mean of `steps` times `scale`, with its bootstrap interval."""
    if not steps:
        return "-"
    if len(steps) < MIN_TIMED_STEPS:
        plural = "s" if len(steps) != 1 else ""
        return f"{np.mean(steps) * scale:.3g} ({len(steps)} timed step{plural}: too few for an interval)"
    low, high = percentiles(bootstrap_means(steps, np.random.default_rng(seed)) * scale)
    return f"{np.mean(steps) * scale:.3g} (95% interval {low:.3g}-{high:.3g})"


@dataclass
class Speedup:
    """custom's speedup over torch (torch's mean step time / custom's; above 1: custom is faster), with its
    interval and the verdict in words."""

    value: float
    low: float
    high: float
    timed_s: float  # the lesser of the two sides' timed work
    steps: int  # the lesser of the two sides' number of timed steps
    sequential: bool = False  # the sides ran one after the other, not interleaved

    @property
    def verdict(self):
        if not self.has_interval:
            return f"too few steps to time ({self.steps} timed step{'s' if self.steps != 1 else ''} per side, " \
                   f"under {MIN_TIMED_STEPS})"
        if self.timed_s < MIN_TIMED_S:
            return f"too short to time ({self.timed_s:.2g} s of timed steps per side, under {MIN_TIMED_S:g} s)"
        if self.low <= 1 <= self.high:
            return "no measurable difference"
        if self.sequential and self.low < SEQUENTIAL_NOISE and self.high > 1 / SEQUENTIAL_NOISE:
            return (f"no measurable difference (runs one after the other differ by up to "
                    f"{SEQUENTIAL_NOISE - 1:.0%} here; python -m bench.train interleaves them)")
        return "custom is faster" if self.low > 1 else "custom is slower"

    @property
    def has_interval(self):
        """Enough steps a side for the bootstrap's interval to mean anything (MIN_TIMED_STEPS)."""
        return self.steps >= MIN_TIMED_STEPS

    @property
    def is_timed(self):
        """Enough steps and enough timed work a side for the verdict to judge the ratio (not "too ... to time")."""
        return self.has_interval and self.timed_s >= MIN_TIMED_S

    def interval_text(self):
        return f"{self.low:.2f}-{self.high:.2f}" if self.has_interval else "-"

    def __str__(self):
        interval = f" (95% interval {self.interval_text()})" if self.has_interval else ""
        return f"{self.value:.2f}x{interval}: {self.verdict}"


def speedup(torch_steps, custom_steps, sequential=False, seed=0):
    """Speedup of custom over torch from each side's step times (flat lists: see timed_steps); None when a
    side has none (a summary written before step times were recorded). `sequential`: the two sides ran one
    after the other (two jobs of a sweep), so only a difference beyond SEQUENTIAL_NOISE counts."""
    if not torch_steps or not custom_steps:
        return None
    rng = np.random.default_rng(seed)
    low, high = percentiles(bootstrap_means(torch_steps, rng) / bootstrap_means(custom_steps, rng))
    value = float(np.mean(torch_steps) / np.mean(custom_steps))
    return Speedup(value, low, high, min(sum(torch_steps), sum(custom_steps)), min(len(torch_steps), len(custom_steps)),
                   sequential)
