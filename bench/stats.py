"""The benchmarks' headline: the geometric mean of per-product speed ratios, with a 95% interval.

A product's ratio is one side's time over another's, each the median of its rounds' medians (where several
sides compete, the fastest of them by that median: the best peer). The interval resamples each product's
rounds with replacement (the sides of one round together, since they ran in the same moment), takes the same
geometric mean of every resample, and keeps the middle 95%. It says how far a rerun of the same minutes could
move the headline; a whole run on a slower hour is a different question (bench/README.md, Method).

The lowest and highest geometric mean of single rounds, which the tables printed before, can exclude the
headline itself: each product's median may come from a different round, so the geometric mean of the medians
is not one round's, and a busy machine disturbs different products in different rounds.
"""
from __future__ import annotations

import math

import numpy as np

from trainer.timing import BOOTSTRAP_SAMPLES, percentiles

MIN_ROUNDS_FOR_INTERVAL = 3  # from 1 or 2 rounds the resamples' medians can take only 1 or 3 values


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ratio_of_medians(over_sides, under) -> float:
    """The fastest of `over_sides` (each a list of round times) by median, over `under`'s median."""
    return min(float(np.median(side)) for side in over_sides) / float(np.median(under))


def geomean_interval(products, seed=0, samples=BOOTSTRAP_SAMPLES) -> tuple[float, float] | None:
    """The 95% interval of the geometric mean of `products`' ratios, each product an (over_sides, under) pair
    as `ratio_of_medians` takes; None where a product has fewer than MIN_ROUNDS_FOR_INTERVAL rounds."""
    rng = np.random.default_rng(seed)
    log_sum = np.zeros(samples)
    for over_sides, under in products:
        rounds = len(under)
        if rounds < MIN_ROUNDS_FOR_INTERVAL:
            return None
        picks = rng.integers(0, rounds, size=(samples, rounds))  # one resample of round indices a row
        over = np.median(np.asarray(over_sides, dtype=np.float64)[:, picks], axis=2).min(axis=0)
        log_sum += np.log(over / np.median(np.asarray(under, dtype=np.float64)[picks], axis=1))
    return percentiles(np.exp(log_sum / len(products)))


def geomean_text(products) -> str:
    """'1.15 (95% interval 1.13-1.17)': the geometric mean of `products`' ratios (see geomean_interval), with
    its interval, or with the reason it has none."""
    value = geomean(ratio_of_medians(over_sides, under) for over_sides, under in products)
    interval = geomean_interval(products)
    if interval is None:
        fewest = min(len(under) for _, under in products)
        return f"{value:.2f} ({fewest} round{'s' if fewest != 1 else ''}: too few for an interval)"
    return f"{value:.2f} (95% interval {interval[0]:.2f}-{interval[1]:.2f})"
