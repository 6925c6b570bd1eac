"""bench/ceiling.py times ext's forward with W as a layer holds it against W stored transposed and prints (and
writes) its tables (no timing limits)."""
import pytest
import torch

from bench import ceiling
from bench.machine import describe_cpu

pytestmark = pytest.mark.usefixtures("restore_threads")  # conftest.py


def test_ceiling_bench_prints_both_layouts_per_shape_and_writes_markdown(tmp_path, capsys):
    markdown = tmp_path / "ceiling.md"
    ceiling.main(["--threads", "1", "--shapes", "8x3->5,200x40->16", "--min-run-time", "0.001", "--rounds", "2",
                  "--markdown", str(markdown)])
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(("| 8x3", "| 200x40"))]
    assert [row[0].strip() for row in rows] == ["8x3->5", "200x40->16"]
    for row, flops in zip(rows, (2 * 8 * 3 * 5, 2 * 200 * 40 * 16)):
        # µs, GFLOP/s and % of peak for each layout, their time ratio and its range over the rounds
        packed_us, in_place_us, ratio = float(row[1]), float(row[4]), float(row[7])
        assert float(row[2]) == pytest.approx(flops / packed_us / 1e3, rel=0.05, abs=0.5)
        assert float(row[5]) == pytest.approx(flops / in_place_us / 1e3, rel=0.05, abs=0.5)
        assert row[3].strip().endswith("%") and row[6].strip().endswith("%")
        low, high = map(float, row[8].split("-"))
        assert ratio == pytest.approx(packed_us / in_place_us, rel=0.05)
        assert low <= ratio <= high
    # 200 rows: more than the kernel reads B in place for, so the note says both sides pack
    assert "200x40->16: more than 128 rows, so B is packed on both sides" in out
    written = markdown.read_text()
    assert describe_cpu() in written and "#### CPU, 1 thread" in written and "| 200x40->16 |" in written
    with pytest.raises(SystemExit):
        ceiling.main(["--shapes", "8x3"])
    assert "bad shape '8x3'" in capsys.readouterr().err


def test_the_transposed_weights_give_the_same_forward_as_the_held_ones():
    x, w, b = torch.randn(64, 300), torch.randn(70, 300), torch.randn(70)
    stored_transposed = w.t().contiguous().t()
    assert stored_transposed.stride() == (1, 70) and torch.equal(stored_transposed, w)
    assert torch.allclose(torch.ops.ext.linear(x, stored_transposed, b), torch.ops.ext.linear(x, w, b),
                          rtol=1e-5, atol=1e-4)
