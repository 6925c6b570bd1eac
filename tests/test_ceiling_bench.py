"""bench/ceiling.py times ext's forward with W as a layer holds it against W stored transposed and prints (and
writes) its tables (no timing limits)."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_within_rounding

from bench import ceiling
from bench.machine import describe_cpu

pytestmark = pytest.mark.usefixtures("restore_threads")  # conftest.py


def test_ceiling_bench_prints_the_tiles_and_both_layouts_per_shape_and_writes_markdown(tmp_path, capsys):
    markdown = tmp_path / "ceiling.md"
    ceiling.main(["--threads", "1", "--shapes", "4x3->5,16x64->32,200x40->16", "--min-run-time", "0.001",
                  "--rounds", "2", "--markdown", str(markdown)])
    out = capsys.readouterr().out
    sizes = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")

    # The tile alone: every vector count of the wide and many-rows tiles, at each of the shapes' K blocks.
    assert "| tile | K block 3: GFLOP/s | % of peak | K block 40: GFLOP/s | % of peak | K block 64: GFLOP/s |" in out
    tiles = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and " vectors) |" in line]
    wide, many = sizes["wide_nr"] // sizes["lanes"], sizes["many_rows_nr"] // sizes["lanes"]
    assert [row[0].strip() for row in tiles] == (
        [f"{sizes['wide_mr']}x{v * sizes['lanes']} (wide, {v} of {wide} vectors)" for v in range(wide, 0, -1)]
        + [f"{sizes['one_vector_mr']}x{sizes['lanes']} (two wide row tiles on 1 of {wide} vectors)"]
        + [f"{sizes['many_rows_mr']}x{v * sizes['lanes']} (many rows, {v} of {many} vectors)"
           for v in range(many, 0, -1)])
    assert all(len(row) == 7 and float(row[1]) > 0 and row[2].strip().endswith("%") for row in tiles)

    # The forward with W as held and stored transposed.
    shapes = ("| 4x3->", "| 16x64->", "| 200x40->")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(shapes)]
    assert [row[0].strip() for row in rows] == ["4x3->5", "16x64->32", "200x40->16"]
    for row, flops in zip(rows, (2 * 4 * 3 * 5, 2 * 16 * 64 * 32, 2 * 200 * 40 * 16)):
        # µs, GFLOP/s and % of peak for each layout, the share of B each packs, their time ratio and its range
        held_us, transposed_us, ratio = float(row[1]), float(row[4]), float(row[8])
        assert float(row[2]) == pytest.approx(flops / held_us / 1e3, rel=0.05, abs=0.5)
        assert float(row[5]) == pytest.approx(flops / transposed_us / 1e3, rel=0.05, abs=0.5)
        assert row[3].strip().endswith("%") and row[6].strip().endswith("%")
        low, high = map(float, row[9].split("-"))
        assert ratio == pytest.approx(held_us / transposed_us, rel=0.05)
        assert low <= ratio <= high
    # W as held always packs all of B. Stored transposed, B is read in place only in whole vectors of columns
    # (5 is not: its ragged panel is packed, once for the one row tile of 4 rows on every path) and up to
    # b_in_place_max_rows rows (200 are more).
    assert [row[7].strip() for row in rows] == ["100% / 100%", "100% / 0%", "100% / 100%"]
    written = markdown.read_text()
    assert describe_cpu() in written and "#### The tile alone, CPU, 1 thread" in written
    assert "#### The forward, CPU, 1 thread" in written and "| 200x40->16 |" in written
    with pytest.raises(SystemExit):
        ceiling.main(["--shapes", "8x3"])
    assert "bad shape '8x3'" in capsys.readouterr().err


def test_the_transposed_weights_give_the_same_forward_as_the_held_ones():
    x, w, b = torch.randn(64, 300), torch.randn(70, 300), torch.randn(70)
    stored_transposed = w.t().contiguous().t()
    assert stored_transposed.stride() == (1, 70) and torch.equal(stored_transposed, w)
    expected = F.linear(x.double(), w.double(), b.double())
    magnitude = x.double().abs() @ w.double().abs().t() + b.double().abs()
    for weight in (w, stored_transposed):  # both sides of bench.ceiling's comparison against torch, not each other
        assert_within_rounding(torch.ops.ext.linear(x, weight, b), expected, magnitude, 300 + 1)
