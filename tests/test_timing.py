"""trainer/timing.py: step times, the bootstrap interval around a speed ratio, and its verdict in words."""
import random
import time

import pytest
import torch

from trainer import timing


def steps(mean_s, count=400, seed=0, spread=0.2):
    rng = random.Random(seed)
    return [mean_s * rng.uniform(1 - spread, 1 + spread) for _ in range(count)]


def test_a_clear_difference_is_named_with_an_interval_around_it():
    ratio = timing.speedup(steps(0.02, seed=1), steps(0.01, seed=2))
    assert ratio.low < ratio.value < ratio.high and 1.9 < ratio.low and ratio.high < 2.1
    assert ratio.verdict == "custom is faster"
    assert str(ratio) == f"{ratio.value:.2f}x (95% interval {ratio.low:.2f}-{ratio.high:.2f}): custom is faster"
    assert timing.speedup(steps(0.01, seed=3), steps(0.02, seed=4)).verdict == "custom is slower"


def test_identical_sides_show_no_measurable_difference():
    ratio = timing.speedup(steps(0.01, seed=5), steps(0.01, seed=6))
    assert ratio.low <= 1 <= ratio.high and ratio.verdict == "no measurable difference"


def test_too_little_timed_work_is_too_short_to_time():
    ratio = timing.speedup(steps(0.001, count=100, seed=7), steps(0.0005, count=100, seed=8))
    assert ratio.verdict == f"too short to time (0.049 s of timed steps per side, under {timing.MIN_TIMED_S:g} s)"


def test_too_few_steps_give_no_interval_to_trust_and_say_so():
    # one long step a side: a bootstrap of one value is a point, which had read "2.24x (2.24-2.24): custom is faster"
    ratio = timing.speedup([5.4], [2.4])
    assert ratio.verdict == f"too few steps to time (1 timed step per side, under {timing.MIN_TIMED_STEPS})"
    assert str(ratio) == f"2.25x: {ratio.verdict}" and ratio.interval_text() == "-"  # no interval shown, not a point
    few = timing.MIN_TIMED_STEPS - 1
    assert timing.speedup(steps(2.0, count=few), steps(1.0, count=400)).verdict.startswith(f"too few steps to time ({few}")
    assert timing.speedup(steps(2.0, count=few + 1), steps(1.0, count=few + 1)).verdict == "custom is faster"
    assert timing.mean_interval([5.44, 5.45], scale=1000) == "5.44e+03 (2 timed steps: too few for an interval)"
    assert timing.mean_interval([5.44], scale=1000) == "5.44e+03 (1 timed step: too few for an interval)"


def test_runs_one_after_the_other_count_only_beyond_their_noise():
    torch_steps, custom_steps = steps(0.011, seed=9, spread=0.05), steps(0.01, seed=10, spread=0.05)
    assert timing.speedup(torch_steps, custom_steps).verdict == "custom is faster"  # interleaved: 1.10x is real
    sequential = timing.speedup(torch_steps, custom_steps, sequential=True)
    assert sequential.low > 1 and sequential.verdict.startswith("no measurable difference (runs one after the other")
    assert timing.speedup(steps(0.03, seed=11), steps(0.01, seed=12), sequential=True).verdict == "custom is faster"


def test_the_interval_widens_with_the_noise_and_the_first_epoch_is_left_out():
    calm = timing.speedup(steps(0.01, seed=13, spread=0.05), steps(0.01, seed=14, spread=0.05))
    noisy = timing.speedup(steps(0.01, seed=13, spread=0.5), steps(0.01, seed=14, spread=0.5))
    assert noisy.high - noisy.low > 3 * (calm.high - calm.low)
    assert timing.timed_steps([[9.0], [1.0, 2.0], [3.0]]) == [1.0, 2.0, 3.0]  # epoch 1 warms up
    assert timing.timed_steps([[1.0, 2.0]]) == [1.0, 2.0]  # a single epoch is all there is
    # a run resumed after epoch 2: the resumed process's first epoch warms up too
    assert timing.timed_steps([[9.0], [1.0], [8.0], [2.0]], warmup_epochs=[0, 2]) == [1.0, 2.0]
    assert timing.timed_steps([[9.0], [8.0]], warmup_epochs=[0, 1]) == [9.0, 8.0]  # nothing else: all of it
    assert timing.speedup([], [1.0]) is None


def test_the_step_clock_times_each_step():
    clock = timing.StepClock(torch.device("cpu"))
    clock.mark()
    for pause_s in (0.01, 0.03):
        time.sleep(pause_s)
        clock.mark()
    first, second = clock.durations_s()
    assert first == pytest.approx(0.01, abs=0.009) and second == pytest.approx(0.03, abs=0.009)


def test_a_mean_is_given_with_its_interval():
    text = timing.mean_interval(steps(0.002, seed=15), scale=1000)
    mean, low, high = (float(part) for part in text.replace(" (95% interval ", " ").replace(")", "").replace("-", " ").split())
    assert low < mean < high and mean == pytest.approx(2.0, rel=0.05)
    assert timing.mean_interval([]) == "-"
