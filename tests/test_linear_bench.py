"""bench/linear.py times ext.linear against F.linear and prints (and writes) its tables (no timing limits)."""
import argparse
import json
import mmap
import os
import re
import signal
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer import memory
from bench import linear as bench_linear
from bench import peers
from bench.machine import describe_cpu


@pytest.fixture(autouse=True)
def restore_threads_and_cpu_path():
    """bench.linear's main sets torch's thread count (and may set ext's CPU path) for the rest of the
    process, as a command should; the tests after these must not inherit them."""
    threads, cpu_path = torch.get_num_threads(), torch.ops.ext.cpu_path()
    yield
    torch.set_num_threads(threads)
    torch.ops.ext.set_cpu_path(cpu_path)


def test_parse_shapes():
    assert bench_linear.parse_shapes("128x256->10,1024x1024->1024") == [(128, 256, 10), (1024, 1024, 1024)]
    for bad in ("128x256", "128x784->0", "-1x4->4"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"bad shape '{bad}'"):
            bench_linear.parse_shapes(bad)


def test_parse_threads():
    assert bench_linear.parse_threads("all,1") == [os.cpu_count(), 1]
    for bad in ("abc", "0", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad thread count"):
            bench_linear.parse_threads(bad)


def test_bad_command_line_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_linear.main(["--threads", "abc"])
    assert exit_info.value.code == 2
    assert "argument --threads: bad thread count 'abc'" in capsys.readouterr().err


def test_bench_prints_every_pass_and_writes_markdown(tmp_path, capsys):
    markdown = tmp_path / "bench.md"
    bench_linear.main(["--threads", "1", "--shapes", "8x12->5,3x7->33", "--min-run-time", "0.001",
                       "--rounds", "1", "--markdown", str(markdown)])
    shown = capsys.readouterr().out
    for shape in ("8x12->5", "3x7->33"):
        for pass_name in ("forward", "backward", "fwd+bwd"):
            assert any(shape in line and pass_name in line for line in shown.splitlines())
    assert "geomean torch/ext, fwd+bwd" in shown
    written = markdown.read_text()
    assert "| 8x12->5 |" in written and "### CPU, 1 thread" in written
    assert describe_cpu() in written  # a figure names the CPU it was measured on


def test_a_run_cut_short_keeps_the_tables_it_finished(tmp_path, monkeypatch):
    markdown = tmp_path / "bench.md"
    real_bench_shape = bench_linear.bench_shape

    def killed_in_the_second_table(shape, device, threads, *args, **kwargs):
        if threads == "2":
            raise KeyboardInterrupt  # as a run stopped by a timeout or Ctrl-C
        return real_bench_shape(shape, device, threads, *args, **kwargs)

    monkeypatch.setattr(bench_linear, "bench_shape", killed_in_the_second_table)
    with pytest.raises(KeyboardInterrupt):
        bench_linear.main(["--threads", "1,2", "--shapes", "8x12->5", "--min-run-time", "0.001",
                           "--rounds", "1", "--markdown", str(markdown)])
    written = markdown.read_text()
    assert "### CPU, 1 thread" in written and "| 8x12->5 |" in written
    assert "### CPU, 2 threads" not in written
    assert [p.name for p in tmp_path.iterdir()] == ["bench.md"]  # no partial file left beside it


def test_products_mode_times_each_product_alone(capsys):
    bench_linear.main(["--products", "--threads", "1", "--shapes", "8x12->5", "--min-run-time", "0.001",
                       "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    for product in ("forward", "dX", "dW", "db"):
        row = next(line.split() for line in lines if line.split()[:2] == ["8x12->5", product])
        assert float(row[2]) > 0 and float(row[3]) > 0  # torch ms, ext ms
        if product == "db":
            assert row[4:6] == ["-", "-"] and row[8] == "-"  # a sum: no GFLOP/s, no % of peak
    assert "geomean torch/ext, dW: all shapes" in "\n".join(lines)
    assert not any(line.split()[1:2] == ["fwd+bwd"] for line in lines if line.strip())


def test_ratio_is_the_median_round_and_lies_within_the_rounds():
    # Round 2 has many fast ext blocks: pooled over all blocks, ext's median would be 1.0 and the
    # ratio 2.0, above every round's own ratio.
    torch_rounds = [[2.0], [2.0, 2.0, 2.0], [2.0]]
    ext_rounds = [[1.6], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0], [1.25]]
    row = bench_linear.compare("fwd+bwd", (8, 12, 5), "cpu", "1", None, torch_rounds, ext_rounds)
    assert row.round_ratios == (1.25, 2.0, 1.6)
    assert (row.torch_s, row.ext_s) == (2.0, 1.25) and row.ratio == 1.6
    assert "1.25-2.00" in row.cells()


def interval_of(text):
    value, low, high = map(float, re.fullmatch(r"(\S+) \(95% interval (\S+)-(\S+)\)", text).groups())
    return value, low, high


def test_a_geomean_comes_with_an_interval_that_holds_it_where_single_rounds_do_not():
    # Each shape's ratio is 2 (its median round), each from a different round: every single round's geomean over
    # the three is (1 * 2 * 2)^(1/3) = 1.59, which the tables' "by round" range once printed beside a 2.00.
    torch_rounds = [[2.0], [2.0], [2.0]]
    rows = [bench_linear.compare("fwd+bwd", shape, "cpu", "1", None, torch_rounds, ext_rounds)
            for shape, ext_rounds in (((128, 784, 256), [[2.0], [1.0], [1.0]]),
                                      ((128, 256, 256), [[1.0], [1.0], [2.0]]),
                                      ((1024, 1024, 1024), [[1.0], [2.0], [1.0]]))]
    value, low, high = interval_of(bench_linear.geomean_text(rows))
    assert value == 2.0 and low < 1.6 and high == 2.0  # a resample can take the slow round of every shape
    [line] = bench_linear.summary_lines(rows)
    assert line.startswith("geomean torch/ext, fwd+bwd: all shapes 2.00 (95% interval ")
    assert ", MLP shapes 2.00 (95% interval " in line  # the first two shapes
    # the same run's headline twice: the interval is seeded, so a table reads the same when printed again
    assert bench_linear.geomean_text(rows) == bench_linear.geomean_text(rows)


def test_the_interval_narrows_with_steady_rounds_and_is_refused_from_too_few():
    steady = bench_linear.compare("forward", (8, 12, 5), "cpu", "1", None, [[3.0]] * 5, [[1.0], [1.1], [1.0], [0.9],
                                                                                      [1.0]])
    noisy = bench_linear.compare("forward", (8, 12, 5), "cpu", "1", None, [[3.0]] * 5, [[1.0], [2.0], [1.0], [0.5],
                                                                                     [1.5]])
    _, steady_low, steady_high = interval_of(bench_linear.geomean_text([steady]))
    _, noisy_low, noisy_high = interval_of(bench_linear.geomean_text([noisy]))
    assert steady_low <= 3.0 <= steady_high and noisy_high - noisy_low > 2 * (steady_high - steady_low)
    two = bench_linear.compare("forward", (8, 12, 5), "cpu", "1", None, [[3.0]] * 2, [[1.0], [1.5]])
    assert bench_linear.geomean_text([steady, two]) == "2.68 (2 rounds: too few for an interval)"  # (3 * 2.4)^0.5


@pytest.mark.skipif(memory.resource is None, reason="page faults are counted through the resource module (Unix)")
def test_page_faults_per_call_are_counted_for_each_side():
    # Each call maps 1,024 fresh pages and touches every one (not through malloc, which may have memory at hand).
    def fresh_pages():
        with mmap.mmap(-1, 1024 * mmap.PAGESIZE) as pages:
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                pages.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages, whatever the host's huge-page setting
            pages[::mmap.PAGESIZE] = b"\1" * 1024

    warm = torch.empty(1024)
    statements = {"fresh": fresh_pages, "warm": lambda: warm.fill_(1.0)}
    _, faults = bench_linear.time_interleaved(statements, min_run_time_s=0.01, rounds=1)
    assert faults["fresh"] >= 1000
    assert faults["warm"] < bench_linear.FAULTS_NOTED_PER_CALL


def test_a_side_that_page_faults_on_most_calls_is_noted():
    rounds = [[1.0], [1.0]]
    quiet, faulting = (bench_linear.compare("fwd+bwd", (512, 784, 256), "cpu", "2", None, rounds, rounds, faults)
                       for faults in ((0.0, 0.4), (0.1, 580.0)))
    notes = bench_linear.fault_notes([quiet, faulting])
    assert len(notes) == 1
    assert notes[0].startswith("note: 512x784->256 fwd+bwd: page faults per call: ext 580;")


def test_share_of_peak_is_taken_from_the_highest_peak_reading(monkeypatch, capsys):
    # A reading taken while another tenant held a core (50) must not inflate the % column.
    readings = iter([100.0, 50.0, 200.0])
    monkeypatch.setattr(bench_linear, "fma_peak_gflops", lambda threads: next(readings))
    bench_linear.main(["--threads", "1", "--shapes", "64x256->256,3x7->33", "--min-run-time", "0.01",
                       "--rounds", "1"])
    captured = capsys.readouterr()
    assert "measured FMA peak 200 GFLOP/s: the highest of 3 readings, the lowest 50" in captured.out
    rows = [line.split() for line in captured.out.splitlines() if line.split()[:1] == ["64x256->256"]]
    assert len(rows) == 3
    for cells in rows:
        ext_gflops, share = float(cells[5]), float(cells[8].rstrip("%"))
        assert abs(share - 100 * ext_gflops / 200) <= 1  # both cells are rounded
    assert "64x256->256: torch/ext forward" in captured.err and "3x7->33: torch/ext forward" in captured.err


def test_cpu_path_option_runs_ext_on_that_path(capsys):
    bench_linear.main(["--cpu-path", "portable", "--threads", "1", "--shapes", "8x12->5",
                       "--min-run-time", "0.001", "--rounds", "1"])
    assert "CPU path portable," in capsys.readouterr().out


def test_cpu_path_this_cpu_lacks_is_one_clear_error(monkeypatch, capsys):
    def lacking(name):
        raise RuntimeError(f"ext.set_cpu_path: this CPU cannot run the {name} path\nException raised from ...")
    monkeypatch.setattr(torch.ops.ext, "set_cpu_path", lacking)
    with pytest.raises(SystemExit) as exit_info:
        bench_linear.main(["--cpu-path", "avx512", "--threads", "1", "--shapes", "8x12->5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "this CPU cannot run the avx512 path" in err and "Exception raised from" not in err


def test_importing_the_benchmark_prints_no_cuda_home_warning():
    # torch.utils.cpp_extension's import warns "No CUDA runtime is found" where nvcc is on PATH and no GPU is
    # (this machine); nothing the benchmark imports may print it. Elsewhere it never shows and this passes.
    done = subprocess.run([sys.executable, "-c", "import bench.linear"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr


@pytest.mark.parametrize("library", peers.LIBRARIES)
def test_every_side_of_the_peers_benchmark_computes_the_product_it_is_timed_on(library):
    shape = (33, 70, 17)
    arrays = {name: torch.from_numpy(array).double() for name, array in peers.inputs(shape).items()}
    expected = {"forward": arrays["x"] @ arrays["w"].T, "dX": arrays["dy"] @ arrays["w"],
                "dW": arrays["dy"].T @ arrays["x"]}
    if library != "openblas":  # numpy's matmul has no bias; the comparison gives it that much less work
        expected["forward"] += arrays["b"]
    for product, call in peers.calls(library, shape).items():
        result = call()
        result = torch.as_tensor(result.to_dense() if library == "onednn" else result).double()
        assert result.shape == expected[product].shape == gemm_shape(shape, product)
        torch.testing.assert_close(result, expected[product], rtol=1e-5, atol=1e-5, msg=f"{library} {product}")


def gemm_shape(shape, product):
    m, n, _ = peers.gemm_dims(shape, product)
    return (m, n)


def test_the_openblas_side_runs_without_the_variables_that_slow_it(monkeypatch):
    clean = subprocess.run(
        [sys.executable, "-c", "import numpy, threadpoolctl; "
         "print([i['architecture'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'][0])"],
        capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k not in peers.OPENBLAS_SLOWING_VARIABLES}).stdout.strip()
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")  # a core older than any this project runs on
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "65536")
    worker = peers.WorkerProcess("openblas")
    try:
        assert f"kernels for {clean}," in worker.description and clean != "Prescott"
    finally:
        worker.close()


def test_a_peer_row_compares_ext_with_the_fastest_peer_round_by_round():
    seconds = {"ext": [1.0, 2.0, 1.0], "torch": [1.5, 1.5, 1.5], "openblas": [1.2, 1.2, 3.0], "onednn": [9, 9, 9]}
    row = peers.PeerRow((128, 512, 256), "dX", {side: sorted(times)[1] for side, times in seconds.items()}, seconds,
                        [100.0, 50.0, 80.0])
    assert row.best_peer == "openblas" and row.ratio == 1.2 / 1.0
    assert row.round_ratios == [1.2, 0.6, 3.0]
    assert peers.gemm_dims((128, 512, 256), "dX") == (128, 512, 256) and row.peak_goal_applies
    dw = peers.PeerRow((64, 256, 128), "dW", row.seconds, seconds, [100.0] * 3)
    assert peers.gemm_dims((64, 256, 128), "dW") == (128, 256, 64) and not dw.peak_goal_applies  # K = batch 64


def test_the_peers_headline_resamples_which_peer_is_fastest_too():
    """OpenBLAS is slow in rounds 2 and 3 (its median 3.0) but fast in round 1: torch is the best peer by median
    (1.2x), and a resample that draws round 1 twice makes OpenBLAS the best (0.5x). The interval holds both."""
    def row(shape, seconds):
        return peers.PeerRow(shape, "dX", {side: statistics.median(t) for side, t in seconds.items()}, seconds,
                             [100.0] * 3)

    seconds = {"ext": [1.0] * 3, "torch": [1.2] * 3, "openblas": [0.5, 3.0, 3.0], "onednn": [9.0] * 3}
    calls = {product: row(peers.CALL_SHAPE, {side: [1e-6] * 3 for side in seconds}) for product in peers.PRODUCTS}
    lines = peers.summary_lines([row((128, 512, 256), seconds)], calls)
    assert lines[0] == ("geomean ext/best peer over 1 products: 1.20 (95% interval 0.50-1.20); lowest 1.20 "
                        "(128x512->256 dX, best peer torch)")


def test_the_share_of_peak_is_each_rounds_time_against_the_peak_read_in_the_same_moment():
    """Round 2 ran at half speed while the peak read half too: the same share as round 1, not half of it."""
    flops = 2 * 128 * 512 * 256
    ext = [flops / 90e9, flops / 45e9, flops / 80e9]  # 90, 45 and 80 GFLOP/s
    seconds = {"ext": ext, "torch": [1.0] * 3, "openblas": [1.0] * 3, "onednn": [1.0] * 3}
    row = peers.PeerRow((128, 512, 256), "dX", {side: statistics.median(t) for side, t in seconds.items()}, seconds,
                        [100.0, 50.0, 100.0])
    assert row.round_peak_shares == pytest.approx([0.9, 0.9, 0.8])
    assert row.peak_share == pytest.approx(0.9)  # against the highest reading (100) the median time reads 80%
    assert row.cells()[-1] == "90.0% (80.0%-90.0%) (goal 90%)"
    # a tenth of a percent, rounded down: a share just under the goal never prints as the goal
    assert [peers.percent(s) for s in (0.8996, 0.8994, 0.9, 0.9004, 1.4409)] == ["89.9%", "89.9%", "90.0%", "90.0%",
                                                                                 "144.0%"]
    reached = replace(row, round_seconds={**seconds, "ext": [flops / 90e9, flops / 45e9, flops / 90e9]})
    assert peers.summary_lines([reached], {p: row for p in peers.PRODUCTS})[-1] == (
        "1 of the 1 products with M, N >= 128 and K >= 256 at 90% of peak in every round, 0 within noise of it, "
        "0 short of it in every round")
    slow = replace(row, round_peaks=[101.0, 50.5, 101.0])  # 89.1% in every round but the 79.2% one: short
    assert peers.summary_lines([slow], {p: row for p in peers.PRODUCTS})[-1] == (
        "0 of the 1 products with M, N >= 128 and K >= 256 at 90% of peak in every round, 0 within noise of it, "
        "1 short of it in every round; short of 90%: 128x512->256 dX 89.1% (79.2%-89.1%)")


def test_peers_mode_times_every_product_on_every_side_and_writes_markdown(tmp_path, capsys):
    markdown = tmp_path / "peers.md"
    # Big enough that the slowest side's call (oneDNN's, tens of µs) still reads >= 1 GFLOP/s, as printed.
    bench_linear.main(["--peers", "--threads", "1", "--shapes", "32x64->48", "--rounds", "2", "--min-run-time",
                       "0.001", "--markdown", str(markdown)])
    out = capsys.readouterr().out
    text = markdown.read_text()
    assert "sides, each in its own process: ext (CPU path" in out and "OpenBLAS" in out and "oneDNN v" in out
    rows = [line for line in text.splitlines() if line.startswith("| 32x64->48 |")]
    assert [row.split(" | ")[1] for row in rows] == ["forward", "dX", "dW"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        # GFLOP/s of ext and the three peers, whole numbers: this tiny product can read 0 on a loaded machine
        assert all(float(cells[index]) >= 0 for index in range(4, 8)) and any(float(cells[index]) > 0 for index in
                                                                               range(4, 8))
        assert cells[8] in ("torch", "OpenBLAS", "oneDNN")
        assert re.fullmatch(r"\d+\.\d% \(\d+\.\d%-\d+\.\d%\)", cells[11])  # % of peak, its range over rounds
    assert re.search(r"FMA peak read after each of ext's rounds: \d+-\d+ GFLOP/s, median \d+\)", text)
    assert "- geomean ext/best peer over 3 products:" in text
    (calls,) = [line for line in text.splitlines() if line.startswith("- the call alone (a 1x1->1 product")]
    for label in ("ext", "torch", "OpenBLAS", "oneDNN"):  # each side's forward / dX / dW, in µs
        assert re.search(rf"\b{label} \d+\.\d / \d+\.\d / \d+\.\d\b", calls), (label, calls)
    assert "- the 90% of peak goal applies to none of these products (none has M, N >= 128 and K >= 256)" in text
    assert "ext against the best peer (ext/best: the best peer's time over ext's, above 1: ext faster;" in text


def test_a_product_behind_its_peer_is_also_compared_net_of_each_sides_call():
    """A 4.7 µs product of ours against OpenBLAS's 3.8, whose calls alone take 1.6 and 0.7 µs: 0.81x, but the
    same 3.1 µs of work each (1.00x net of the calls)."""
    def row(shape, ext, openblas, others=9.0):
        seconds = {"ext": ext * 1e-6, "torch": others * 1e-6, "openblas": openblas * 1e-6, "onednn": others * 1e-6}
        return peers.PeerRow(shape, "dX", seconds, {side: [t] for side, t in seconds.items()}, [100.0])

    head = row((128, 256, 10), 4.7, 3.8)
    calls = {product: row(peers.CALL_SHAPE, 1.6, 0.7) for product in peers.PRODUCTS}
    assert head.ratio == pytest.approx(3.8 / 4.7) and peers.net_of_calls(head, calls) == pytest.approx((1, 1, 1))
    lines = peers.summary_lines([head, row((128, 512, 256), 100.0, 110.0, others=200.0)], calls)
    assert ("the call alone (a 1x1->1 product; µs per call, forward / dX / dW): ext 1.6 / 1.6 / 1.6; "
            "torch 9.0 / 9.0 / 9.0; OpenBLAS 0.7 / 0.7 / 0.7; oneDNN 9.0 / 9.0 / 9.0") in lines
    assert ("behind the best peer in every round: 128x256->10 dX 0.81 (by round 0.81-0.81; OpenBLAS; 1.00 net of "
            "each side's call (1.00-1.00 at the rounds' extremes))") in lines
    # a product no longer than a side's call alone leaves nothing to compare
    tiny = row((16, 40, 24), 1.5, 1.0)
    assert peers.net_of_calls(tiny, calls) is None
    assert ("16x40->24 dX 0.67 (by round 0.67-0.67; OpenBLAS; within noise net of the calls: a side's product no "
            "slower than its call alone in some round)") in peers.summary_lines([tiny], calls)[-2]


def test_the_ratio_net_of_the_calls_comes_with_the_range_its_rounds_allow():
    """ext's product 2.0-2.2 µs against its call alone 1.9-2.0: the 0.1 µs between the medians could be
    0.0-0.3; the peer's 3.0 µs less 1.0 is 2.0 in every round. Net 10.0 from the medians, 6.7 to unbounded."""
    product = synthetic_row((8, 16, 4), "forward", [2.0e-6, 2.1e-6, 2.2e-6], [3.0e-6] * 3)
    call = synthetic_row(peers.CALL_SHAPE, "forward", [1.9e-6, 2.0e-6, 1.9e-6], [1.0e-6] * 3)
    calls = {p: call for p in peers.PRODUCTS}
    assert peers.net_of_calls(product, calls) is None  # ext's fastest product round (2.0) is its slowest call's
    faster_call = synthetic_row(peers.CALL_SHAPE, "forward", [1.8e-6, 1.8e-6, 1.7e-6], [1.0e-6] * 3)
    net = peers.net_of_calls(product, {p: faster_call for p in peers.PRODUCTS})
    assert net == pytest.approx((2.0 / 0.3, 2.0 / 0.5, 2.0 / 0.2))
    assert peers.net_of_calls_words(product, {p: faster_call for p in peers.PRODUCTS}) == (
        "6.67 net of each side's call (4.00-10.00 at the rounds' extremes)")


def test_a_product_is_ahead_or_behind_its_peer_only_where_every_round_says_so():
    rows = [synthetic_row((128, 512, 256), "forward", [1.0] * 3, [1.1, 1.2, 1.0]),  # ahead or level every round
            synthetic_row((128, 512, 256), "dX", [1.0] * 3, [0.99, 1.04, 1.0]),  # median 1.00, a round behind
            synthetic_row((1024, 1024, 1024), "forward", [1.0] * 3, [0.99, 0.99, 1.04]),  # median 0.99: noise
            synthetic_row((128, 512, 256), "dW", [1.0] * 3, [0.9, 0.95, 0.99])]  # behind in every round
    calls = {p: synthetic_row(peers.CALL_SHAPE, p, [0.1] * 3, [0.1] * 3) for p in peers.PRODUCTS}
    lines = peers.summary_lines(rows, calls)
    assert ("against the best peer, round by round: 1 of 4 products level or ahead in every round, 2 level within "
            "noise (ahead in some rounds, behind in others), 1 behind in every round") in lines
    (behind,) = [line for line in lines if line.startswith("behind the best peer in every round: ")]
    assert "128x512->256 dW 0.95 (by round 0.90-0.99; OpenBLAS;" in behind and "dX" not in behind
    (level,) = [line for line in lines if line.startswith("level with the best peer within noise: ")]
    assert "128x512->256 dX 1.00 (by round 0.99-1.04;" in level
    assert "1024x1024->1024 forward 0.99 (by round 0.99-1.04;" in level and "128x512->256 forward" not in level


def test_a_product_misses_the_90_percent_goal_only_where_every_round_does():
    flops = 2 * 128 * 256 * 256  # 128x256->256's forward: M, N = 128, 256, K = 256, the goal applies

    def row(*gflops):
        return synthetic_row((128, 256, 256), "forward", [flops / (g * 1e9) for g in gflops], [1.0] * 3)

    rows = [row(91, 95, 90), row(89.1, 89.4, 90.0), row(80, 85, 89.9), replace(row(91, 91, 91), product="dX")]
    calls = {p: synthetic_row(peers.CALL_SHAPE, p, [0.1] * 3, [0.1] * 3) for p in peers.PRODUCTS}
    assert peers.summary_lines(rows, calls)[-1] == (
        "2 of the 4 products with M, N >= 128 and K >= 256 at 90% of peak in every round, 1 within noise of it, "
        "1 short of it in every round; within noise of 90%: 128x256->256 forward 89.4% (89.1%-90.0%); "
        "short of 90%: 128x256->256 forward 85.0% (80.0%-89.9%)")
    assert peers.summary_lines([synthetic_row((8, 16, 4), "dW", [1.0], [1.0])], calls)[-1] == (
        "the 90% of peak goal applies to none of these products (none has M, N >= 128 and K >= 256)")


@pytest.mark.parametrize("argv", [["--help"], [], ["mkl"]])
def test_the_peers_worker_run_by_hand_says_what_to_run_instead(argv):
    result = subprocess.run([sys.executable, "-m", "bench.peers", *argv], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "python -m bench.linear --peers" in result.stderr
    assert "ext, torch, openblas, onednn" in result.stderr


def test_peers_mode_refuses_the_options_it_does_not_take(capsys):
    with pytest.raises(SystemExit):
        bench_linear.main(["--peers", "--products"])
    assert "--peers times the products on ext's best CPU path" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # every worker keeps freed memory: the header would misname the setting
        bench_linear.main(["--peers", "--malloc-defaults"])
    assert "leave out --malloc-defaults" in capsys.readouterr().err


REPO = Path(__file__).resolve().parents[1]


def stub_module(directory, name, source):
    """A directory holding module `name` with `source`, to put before the real one on PYTHONPATH."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.py").write_text(source)
    return f"{directory}{os.pathsep}{REPO}"


def test_peers_mode_without_a_library_it_needs_ends_with_one_line_naming_it(tmp_path):
    path = stub_module(tmp_path / "stubs", "threadpoolctl", 'raise ImportError("No module named threadpoolctl")')
    done = subprocess.run([sys.executable, "-m", "bench.linear", "--peers", "--threads", "1", "--shapes", "8x16->4",
                           "--rounds", "1", "--min-run-time", "0.01"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "python -m bench.linear: error: --peers cannot run its OpenBLAS side: ImportError: No module named "
        "threadpoolctl: install numpy and threadpoolctl (pip install -r requirements.txt)"]


def test_a_worker_whose_library_cannot_run_says_so_as_its_first_answer(tmp_path):
    path = stub_module(tmp_path / "stubs", "threadpoolctl", 'raise ImportError("No module named threadpoolctl")')
    done = subprocess.run([sys.executable, "-m", "bench.peers", "openblas"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert (done.returncode, done.stderr) == (1, "")
    assert json.loads(done.stdout) == {"error": "ImportError: No module named threadpoolctl: install numpy and "
                                                "threadpoolctl (pip install -r requirements.txt)"}


def test_the_parent_raises_the_workers_error_naming_its_library(tmp_path, monkeypatch):
    # numpy with a BLAS other than OpenBLAS: threadpoolctl finds none
    monkeypatch.setenv("PYTHONPATH", stub_module(tmp_path / "stubs", "threadpoolctl", "def threadpool_info():\n"
                                                 "    return []\n\n\ndef threadpool_limits(**kwargs):\n    pass\n"))
    with pytest.raises(peers.PeerUnavailable, match=r"^--peers cannot run its OpenBLAS side: numpy \S+ runs no "
                                                    r"OpenBLAS that threadpoolctl finds \(BLAS found: none\): "
                                                    r"reinstall numpy's pip wheel"):
        peers.WorkerProcess("openblas")


def test_a_worker_failing_mid_run_ends_the_run_in_one_line_naming_its_library_and_product():
    # a product a library fails on once the run is under way (out of memory on a large shape, say)
    worker = peers.WorkerProcess("ext")
    try:
        with pytest.raises(peers.PeerUnavailable, match=r"^--peers: its ext side failed on 2x3->4's bogus "
                                                        r"\(1 threads\): KeyError: 'bogus'$"):
            worker.ask(threads=1, shape=[2, 3, 4], product="bogus", min_run_time=0.01)
    finally:
        worker.close()
    worker = peers.WorkerProcess("ext")  # killed without a word (the OOM killer, say)
    worker.process.kill()
    worker.process.wait()
    with pytest.raises(peers.PeerUnavailable, match=r"^--peers: its ext side's process ended early \(killed by "
                                                    r"signal 9\); what it printed, if anything, is above$"):
        worker.ask(threads=1, shape=[2, 3, 4], product="forward", min_run_time=0.01)
    worker.close()


def test_a_onednn_that_cannot_compute_is_found_when_its_worker_starts(monkeypatch):
    def unusable(self):
        raise RuntimeError("mkldnn: unsupported CPU\nmore detail")

    monkeypatch.setattr(torch.Tensor, "to_mkldnn", unusable)
    with pytest.raises(peers.Unusable, match=r"^its products fail on a 1x1->1 layer \(RuntimeError: mkldnn: "
                                             r"unsupported CPU\): use a torch build with oneDNN"):
        peers.Worker("onednn")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(peers.Unusable, match=r"^torch \S+ was built without oneDNN: use a torch build with oneDNN"):
        peers.open_library("onednn")


def test_a_worker_ignores_ctrl_c_and_ends_when_its_parent_closes_it():
    worker = subprocess.Popen([sys.executable, "-m", "bench.peers", "openblas"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "OpenBLAS" in json.loads(worker.stdout.readline())["description"]
        worker.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole terminal's processes
        worker.stdin.write(json.dumps({"threads": 1, "shape": [2, 3, 4], "product": "dX", "min_run_time": 0.001})
                           + "\n")
        worker.stdin.flush()
        assert json.loads(worker.stdout.readline())["seconds"]
    finally:
        worker.stdin.close()
        assert worker.wait(timeout=60) == 0
        assert worker.stderr.read() == ""


def test_a_peers_run_cut_short_keeps_the_tables_it_finished(tmp_path, monkeypatch):
    class StandInWorker:
        def __init__(self, library):
            self.description = f"stand-in {library}"

        def close(self):
            pass

    def measure(workers, shapes, threads, min_run_time_s, rounds, progress):
        if threads == 2:
            raise KeyboardInterrupt  # as a run stopped by a timeout or Ctrl-C
        row = synthetic_row((8, 16, 4), "forward", [1.0, 1.1], [1.2, 1.2])
        return [row], {product: replace(row, product=product) for product in peers.PRODUCTS}

    monkeypatch.setattr(peers, "WorkerProcess", StandInWorker)
    monkeypatch.setattr(peers, "measure", measure)
    markdown = tmp_path / "peers.md"
    with pytest.raises(KeyboardInterrupt):
        bench_linear.main(["--peers", "--threads", "1,2", "--markdown", str(markdown)])
    written = markdown.read_text()
    assert "### CPU, 1 thread: ext against the best peer" in written and "| 8x16->4 | forward |" in written
    assert "### CPU, 2 threads" not in written


def synthetic_row(shape, product, ext, peer, peaks=None, others=None):
    """A PeerRow from each round's median seconds of ext and of its best peer (OpenBLAS; the others slower)."""
    others = others or [max(peer) * 10] * len(peer)
    rounds = {"ext": list(ext), "torch": list(others), "openblas": list(peer), "onednn": list(others)}
    return peers.PeerRow(shape, product, {side: statistics.median(t) for side, t in rounds.items()}, rounds,
                         list(peaks or [100.0] * len(ext)))


def test_cuda_only_runs_no_cpu_table(tmp_path, capsys):
    bench_linear.main(["--cuda-only", "--quick", "--markdown", str(tmp_path / "cuda.md")])
    out = capsys.readouterr().out
    assert "== CPU" not in out and "### CPU" not in (tmp_path / "cuda.md").read_text()
    if not torch.cuda.is_available():
        assert "CUDA: skipped (torch.cuda.is_available() is False" in out


def test_cuda_tables_time_the_named_shapes_alone(monkeypatch, capsys):
    # The CUDA tables' loop, run here with a stand-in GPU: each precision times the shapes named, and
    # 4096^3 (issue 24's goals) only where none are named.
    timed = []

    def fake_bench_shape(shape, device, threads_label, min_run_time_s, rounds, products, dtype):
        timed.append((shape, dtype))
        return [bench_linear.Row(device, threads_label, shape, p, (2e-3, 2e-3), (1e-3, 1e-3), None) for p in ("forward",)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Stand-in GPU")
    monkeypatch.setattr(bench_linear, "bench_shape", fake_bench_shape)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    bench_linear.main(["--cuda-only", "--shapes", "8x12->5", "--min-run-time", "0.001", "--rounds", "1"])
    assert timed == [((8, 12, 5), dtype) for dtype, _ in bench_linear.CUDA_PRECISIONS.values()]
    assert "== CUDA, Stand-in GPU, bfloat16 (vs cuBLAS) ==" in capsys.readouterr().out
    assert bench_linear.cuda_shape_list(None, bench_linear.QUICK_SHAPES)[-1] == (4096, 4096, 4096)


def cuda_row(pass_name, ratios, shape=(4096, 4096, 4096)):
    ratio = sorted(ratios)[len(ratios) // 2]
    return bench_linear.Row("cuda", "-", shape, pass_name, tuple(r * 1e-3 for r in ratios), (1e-3,) * len(ratios), None)


@pytest.mark.parametrize("ratios,verdict", [((0.85, 0.9, 0.82), "met"), ((0.5, 0.6, 0.55), "not met"),
                                            ((0.75, 0.85, 0.8), "within noise")])
def test_cuda_goal_line_says_whether_the_share_of_cublas_is_met(ratios, verdict):
    rows = [cuda_row("forward", ratios), cuda_row("backward", (0.1, 0.1, 0.1)), cuda_row("forward", (9, 9, 9), (1, 1, 1))]
    [line] = bench_linear.cuda_goal_lines(rows, "float32")
    assert line.startswith("goal at 4096^3 forward: ext at >= 80% of cuBLAS") and line.endswith(f": {verdict}")
    assert bench_linear.cuda_goal_lines(rows, "float32 with TF32") == []  # no goal set for it


def test_gpu_day_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(Path(__file__).parents[1] / "scripts" / "gpu_day.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_the_profiling_target_says_in_one_line_that_it_needs_a_gpu():
    result = subprocess.run([sys.executable, "-m", "bench.profile_cuda", "--precision", "float32"],
                            capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "bench.profile_cuda: needs a CUDA GPU (torch.cuda.is_available() is False)"]


def test_the_profiling_target_refuses_a_bad_shape_in_one_line(capsys):
    from bench import profile_cuda
    with pytest.raises(SystemExit):
        profile_cuda.main(["--shape", "4096x4096"])
    assert "bad shape '4096x4096'" in capsys.readouterr().err
    for argv in (["--shape", "8x8->8,16x16->16"], ["--calls", "0"]):
        with pytest.raises(SystemExit):
            profile_cuda.main(argv)
        assert "give one --shape and --calls of at least 1" in capsys.readouterr().err
