"""bench/loss.py times ext.cross_entropy against F.cross_entropy and prints (and writes) its tables (no timing
limits)."""
import pytest

from bench import loss as bench_loss
from bench.machine import describe_cpu

pytestmark = pytest.mark.usefixtures("restore_threads")  # conftest.py


def test_loss_bench_prints_both_passes_per_shape_and_writes_markdown(tmp_path, capsys):
    markdown = tmp_path / "loss.md"
    bench_loss.main(["--threads", "1", "--shapes", "8x3,5x40", "--min-run-time", "0.001", "--rounds", "2",
                     "--markdown", str(markdown)])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 8x3")
            or line.startswith("| 5x40")]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [
        ("8x3", "forward"), ("8x3", "fwd+bwd"), ("5x40", "forward"), ("5x40", "fwd+bwd")]
    for row in rows:  # torch µs, ext µs, their ratio, and its range over the two rounds
        torch_us, ext_us, ratio = float(row[2]), float(row[3]), float(row[4])
        low, high = map(float, row[5].split("-"))
        assert ratio == pytest.approx(torch_us / ext_us, rel=0.05) and low <= ratio <= high
    written = markdown.read_text()
    assert describe_cpu() in written and "#### CPU, 1 thread" in written and "| 5x40 | fwd+bwd |" in written
    with pytest.raises(SystemExit):
        bench_loss.main(["--shapes", "8y3"])
    assert "'8y3' is not batch x classes" in capsys.readouterr().err
