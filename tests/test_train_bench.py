"""bench/train.py runs the trainer's own epoch for both linears and reports their times (no timing limits)."""
import pytest

from bench import train as bench_train


def test_bench_reports_both_linears_and_their_ratio(capsys):
    means_s = bench_train.main(["--epochs", "1", "--train-size", "256", "--batch-size", "64"])
    assert set(means_s) == {"torch", "custom"} and all(value > 0 for value in means_s.values())
    shown = capsys.readouterr().out
    assert "linear=torch " in shown and "linear=custom" in shown and "ratio torch/custom" in shown


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: '0' is not a positive integer"),
    (["--threads", "two"], "argument --threads: 'two' is not a positive integer"),
    (["linear.fuse_relu=maybe"], "error: linear.fuse_relu=maybe is invalid: it must be true or false"),
    (["trainer.epoch=3"], "error: trainer.epoch is not a setting; did you mean trainer.epochs?"),
])
def test_a_bad_argument_or_override_is_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
