"""bench/train.py runs the trainer's own epoch for both linears and reports their times (no timing limits)."""
from bench import train as bench_train


def test_bench_reports_both_linears_and_their_ratio(capsys):
    means_s = bench_train.main(["--epochs", "1", "--train-size", "256", "--batch-size", "64"])
    assert set(means_s) == {"torch", "custom"} and all(value > 0 for value in means_s.values())
    shown = capsys.readouterr().out
    assert "linear=torch " in shown and "linear=custom" in shown and "ratio torch/custom" in shown
