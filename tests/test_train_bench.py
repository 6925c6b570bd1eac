"""bench/train.py runs the trainer's own epoch for both linears and reports their times (no timing limits)."""
import pytest

from bench import machine, train as bench_train
from bench.machine import describe_cpu


def test_bench_reports_both_linears_and_their_ratio(capsys, tmp_path):
    table = tmp_path / "bench_train.md"
    means_s = bench_train.main(["--epochs", "2", "--train-size", "256", "--batch-size", "64", "--markdown", str(table)])
    assert set(means_s) == {"torch", "custom"} and all(value > 0 for value in means_s.values())
    shown = capsys.readouterr().out
    assert "linear=torch " in shown and "linear=custom" in shown and "ratio torch/custom" in shown
    assert "epoch by epoch" in shown  # the ratio comes with its spread
    markdown = table.read_text()
    assert markdown.startswith("`python -m bench.train --epochs 2") and "| torch | " in markdown
    assert describe_cpu() in markdown  # a figure names the CPU it was measured on


def test_the_cpu_is_named_with_its_core(monkeypatch):
    zen3 = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "1",
            "flags": "fpu avx2 fma"}
    monkeypatch.setattr(machine, "cpuinfo", lambda: zen3)
    assert machine.describe_cpu().startswith("AMD EPYC (family 25, model 1: Zen 3; avx2, fma), ")
    monkeypatch.setattr(machine, "cpuinfo", lambda: {**zen3, "cpu family": "26", "model": "2",
                                                    "flags": "avx512f avx2 fma"})
    assert machine.describe_cpu().startswith("AMD EPYC (family 26, model 2: Zen 5; avx512f, avx2, fma), ")
    assert machine.amd_core(25, 0x11) == "Zen 4"


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
