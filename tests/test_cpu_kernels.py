"""The CPU GEMM kernels (ext/csrc/cpu) through the raw ops, on every code path:
sizes crossing every register-tile and cache-block boundary, strided and
transposed operands, the fused bias/ReLU epilogue, path agreement, and
bit-identical results across runs and thread counts."""
import contextlib
import itertools

import pytest
import torch

import ext  # noqa: F401  (loads the ops)
from conftest import num_threads

ops = torch.ops.ext

# The kernels' block sizes, written down once here. Source of truth: the
# microkernel_<path>.cpp files (wide, narrow and many-rows MR x NR register
# tiles; the narrow one runs when N <= its NR, the many-rows one when
# M >= MANY_ROWS_MIN_ROWS) and gemm.cpp (kKC, kMaxSingleKBlock, kMCAvx512/kMCAvx2/kMCPortable, kNC).
TILES = {  # (path, dtype): ((MR, NR) wide, (MR, NR) narrow, (MR, NR) many rows)
    ("avx512", torch.float32): ((8, 48), (8, 16), (6, 64)),
    ("avx512", torch.float64): ((8, 16), (8, 8), (8, 16)),
    ("avx2+fma", torch.float32): ((6, 16), (6, 8), (6, 16)),
    ("avx2+fma", torch.float64): ((6, 8), (6, 4), (6, 8)),
    ("portable", torch.float32): ((4, 8), (4, 4), (4, 8)),
    ("portable", torch.float64): ((4, 4), (4, 2), (4, 4)),
}
LANES = {  # values per vector: a wide tile's ragged last column panel runs whole vectors of them
    ("avx512", torch.float32): 16, ("avx512", torch.float64): 8,
    ("avx2+fma", torch.float32): 8, ("avx2+fma", torch.float64): 4,
    ("portable", torch.float32): 4, ("portable", torch.float64): 2,
}
KC = {torch.float32: 512, torch.float64: 256}
# Up to this K the whole depth is one block; deeper K runs in blocks of KC (gemm.cpp kMaxSingleKBlock).
MAX_SINGLE_K_BLOCK = {torch.float32: 800, torch.float64: 400}
MC = {"avx512": 240, "avx2+fma": 120, "portable": 120}  # rows of a packed A block, per path
NC = 3072
SINGLE_BLOCK_BYTES = {"avx512": 512 * 1024, "avx2+fma": 256 * 1024, "portable": 256 * 1024}  # gemm.cpp single_block_bytes
MANY_ROWS_MIN_ROWS = 512  # from this many rows of C the many-rows tile runs (gemm.cpp kManyRowsMinRows)
B_IN_PLACE_MAX_ROWS = 128  # up to this many rows of C a row-major B is read unpacked (gemm.cpp)
# Both operands read in place and B's block at most this many bytes: row tiles run outermost (gemm.cpp)
ROWS_OUTER_MAX_B_BYTES = 48 * 1024 // 2
L2_BYTES = 2 * 1024 * 1024  # gemm.cpp kL2Bytes: a C larger than this with rows a page apart is written by rows
PARALLEL_MIN_FLOPS = 5e5  # below this the GEMM runs on one thread (gemm.h kParallelMinFlops)

# torch's own CPU feature detection decides which of our paths this machine must run.
_CAPABILITY = torch.backends.cpu.get_cpu_capability()
PATHS = ["portable"]
if _CAPABILITY in ("AVX2", "AVX512"):
    PATHS.append("avx2+fma")
if _CAPABILITY == "AVX512":
    PATHS.append("avx512")
DTYPES = [torch.float32, torch.float64]


@contextlib.contextmanager
def cpu_path(name):
    previous = ops.cpu_path()
    ops.set_cpu_path(name)
    try:
        yield
    finally:
        ops.set_cpu_path(previous)


def make(rows, cols, dtype, layout, seed):
    """A rows x cols tensor in the given memory layout, same values for any layout."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(rows, cols, generator=gen, dtype=dtype)
    if layout == "transposed":
        return torch.randn(cols, rows, generator=gen, dtype=dtype).t()
    assert layout == "strided"  # both strides > 1: every other column of a wider matrix
    return torch.randn(rows, 2 * cols, generator=gen, dtype=dtype)[:, ::2]


def reference_linear(x, w, b, relu=False):
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    return y.clamp_min(0) if relu else y


def tolerance(dtype, depth):
    # float64: near exact; float32: rounding grows with the length of each dot product.
    return dict(rtol=0, atol=1e-12 * max(depth, 1)) if dtype == torch.float64 else \
        dict(rtol=0, atol=2e-5 * max(depth, 1) ** 0.5)


def assert_close(actual, expected, dtype, depth):
    torch.testing.assert_close(actual.double(), expected, **tolerance(dtype, depth))


def boundary_shapes(path, dtype):
    """(M, N, K) products whose sizes sit on, just below and just above MR, NR, MC, KC, the
    deepest single K block and NC,
    on each side of the row count where a row-major B stops being read in place, and of the
    one where the many-rows tile takes over; ragged last column panels of every vector count."""
    (mr, nr), (narrow_mr, narrow_nr), (many_mr, many_nr) = TILES[path, dtype]
    kc, mc, lanes = KC[dtype], MC[path], LANES[path, dtype]
    two_k_blocks = MAX_SINGLE_K_BLOCK[dtype] + 1  # the shallowest K that runs in two blocks (KC + a ragged rest)
    shapes = [(m, nr + 1, two_k_blocks) for m in (1, mr - 1, mr, mr + 1, mc - 1, mc, mc + 1)]
    shapes += [(m, nr + 1, two_k_blocks) for m in (B_IN_PLACE_MAX_ROWS, B_IN_PLACE_MAX_ROWS + 1)]
    shapes += [(narrow_mr + 1, narrow_nr, two_k_blocks)]  # narrow tile, full
    shapes += [(mr + 1, n, 5) for n in (1, narrow_nr - 1, narrow_nr + 1, nr - 1, nr, nr + 1, NC - 1, NC, NC + 1)]
    shapes += [(mr + 1, nr + 1, k) for k in (1, kc - 1, kc, kc + 1, two_k_blocks - 1, two_k_blocks, 2 * kc + 1)]
    shapes.append((mc + 1, 2 * nr + 3, 2 * kc + 3))  # every block edge at once
    # Rows that fit in SINGLE_BLOCK_BYTES at depth min(K, KC) make one A block; one more, MC-row blocks.
    for k in (kc // 2, kc):
        single_block_rows = SINGLE_BLOCK_BYTES[path] // (k * dtype.itemsize)
        shapes += [(m, nr + 1, k) for m in (mc + 1, single_block_rows, single_block_rows + 1)]
    # Ragged last row panels run tiles of about MR / 2 and MR / 4 rows: each of those, and one more.
    row_variants = sorted({(mr + 1) // 2, (mr + 3) // 4})
    shapes += [(mr + r, nr + 1, two_k_blocks) for v in row_variants for r in (v, v + 1)]
    first_many = -(-MANY_ROWS_MIN_ROWS // many_mr) * many_mr
    shapes += [(first_many + r, many_nr + 1, two_k_blocks) for v in sorted({(many_mr + 1) // 2, (many_mr + 3) // 4})
               for r in (v, v + 1)]
    # Ragged last column panels: each whole vector count below NR, and one vector plus one value.
    shapes += [(mr + 1, nr + v * lanes + extra, two_k_blocks) for v in range(1, nr // lanes) for extra in (0, 1)]
    # The many-rows tile: on each side of where it starts, its MR, NR and both of MC's edges.
    shapes += [(m, many_nr + 1, two_k_blocks) for m in (MANY_ROWS_MIN_ROWS - 1, MANY_ROWS_MIN_ROWS,
                                                 MANY_ROWS_MIN_ROWS + 1, MANY_ROWS_MIN_ROWS + many_mr - 1,
                                                 2 * mc - 1, 2 * mc + 1)]
    shapes += [(MANY_ROWS_MIN_ROWS + 1, n, 5) for n in (many_nr - 1, many_nr, many_nr + lanes + 1, NC + 1)]
    shapes += [(MANY_ROWS_MIN_ROWS + many_mr + 1, many_nr + v * lanes, k)
               for v in range(1, many_nr // lanes) for k in (kc, 2 * kc + 1)]
    # C's rows a page apart: on each side of the C size (L2) from which its row tiles run outermost over a
    # B packed whole (float64 also with two K blocks, whose B block still fits half of L2).
    page_cols = 4096 // dtype.itemsize
    wide_n = page_cols + lanes + 1 if dtype == torch.float32 else page_cols
    rows_over_l2 = L2_BYTES // (wide_n * dtype.itemsize) + 1
    shapes += [(m, wide_n, k) for m in (rows_over_l2 - 1, rows_over_l2 + mr + 1) for k in (5, two_k_blocks)]
    # dX of a 10-class head (its K = 10): B's block (10 x in) on each side of the bytes that run row tiles outermost.
    rows_outer_max_cols = ROWS_OUTER_MAX_B_BYTES // (10 * dtype.itemsize)
    shapes += [(m, 10, k) for m in (mr + 1, B_IN_PLACE_MAX_ROWS) for k in (rows_outer_max_cols, rows_outer_max_cols + 1)]
    return shapes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_forward_and_backward_across_block_boundaries(path, dtype):
    with cpu_path(path):
        for seed, (m, n, k) in enumerate(boundary_shapes(path, dtype)):
            x, w = make(m, k, dtype, "contiguous", seed), make(n, k, dtype, "contiguous", seed + 1000)
            b, dy = make(1, n, dtype, "contiguous", seed + 2000)[0], make(m, n, dtype, "contiguous", seed + 3000)
            shape = f"M={m} N={n} K={k}"
            assert_close(ops.linear(x, w, b), reference_linear(x, w, b), dtype, k), shape
            assert_close(ops.linear_relu(x, w, b), reference_linear(x, w, b, relu=True), dtype, k)
            assert_close(ops.linear_backward_input(dy, w), dy.double() @ w.double(), dtype, n)
            assert_close(ops.linear_backward_weight(dy, x), dy.double().t() @ x.double(), dtype, m)
            assert_close(ops.linear_backward_bias(dy), dy.double().sum(0), dtype, m)


LAYOUTS = ["contiguous", "transposed", "strided"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_strided_and_transposed_operands(path, dtype):
    (mr, nr), _, (many_mr, _) = TILES[path, dtype]
    # Ragged in every dimension, on the wide tile, then on the many-rows one (M and,
    # for dW, N of at least MANY_ROWS_MIN_ROWS).
    shapes = [(2 * mr + 1, nr + 3, MAX_SINGLE_K_BLOCK[dtype] + 9),
              (MANY_ROWS_MIN_ROWS + 2 * many_mr + 1, MANY_ROWS_MIN_ROWS + 3, MAX_SINGLE_K_BLOCK[dtype] + 9)]
    with cpu_path(path):
        for (m, n, k), x_layout, w_layout in itertools.product(shapes, LAYOUTS, LAYOUTS):
            x, w = make(m, k, dtype, x_layout, 1), make(n, k, dtype, w_layout, 2)
            dy, b = make(m, n, dtype, x_layout, 3), make(1, n, dtype, "contiguous", 4)[0]
            assert_close(ops.linear(x, w, b), reference_linear(x, w, b), dtype, k)
            assert_close(ops.linear_relu(x, w, None), reference_linear(x, w, None, relu=True), dtype, k)
            assert_close(ops.linear_backward_input(dy, w), dy.double() @ w.double(), dtype, n)
            assert_close(ops.linear_backward_weight(dy, x), dy.double().t() @ x.double(), dtype, m)
            assert_close(ops.linear_backward_bias(dy), dy.double().sum(0), dtype, m)


@pytest.mark.parametrize("path", PATHS)
def test_bias_and_relu_epilogue(path):
    m, n, k = 37, 41, 19
    x, w = make(m, k, torch.float64, "contiguous", 5), make(n, k, torch.float64, "contiguous", 6)
    b = torch.linspace(-3, 3, n, dtype=torch.float64)  # sign changes across the row: ReLU must clip some
    with cpu_path(path):
        relu_out = ops.linear_relu(x, w, b)
        assert (relu_out == 0).any() and (relu_out > 0).any()
        assert_close(relu_out, reference_linear(x, w, b, relu=True), torch.float64, k)
        assert_close(ops.linear(x, w, None), reference_linear(x, w, None), torch.float64, k)
        # NaN propagates through the fused ReLU as through torch.relu.
        x_nan = x.clone()
        x_nan[3, 5] = float("nan")
        assert ops.linear_relu(x_nan, w, b)[3].isnan().all()
        # K == 0: the product is the bias alone (then ReLU), never uninitialised memory.
        empty_x, empty_w = torch.empty(m, 0, dtype=torch.float64), torch.empty(n, 0, dtype=torch.float64)
        torch.testing.assert_close(ops.linear(empty_x, empty_w, b), b.expand(m, n))
        torch.testing.assert_close(ops.linear_relu(empty_x, empty_w, b), b.clamp_min(0).expand(m, n))
        torch.testing.assert_close(ops.linear(empty_x, empty_w, None), torch.zeros(m, n, dtype=torch.float64))


@pytest.mark.skipif(len(PATHS) == 1, reason="this CPU runs only the portable path")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_simd_paths_agree_with_portable(dtype):
    m, n, k = 150, 70, 600
    x, w, b = make(m, k, dtype, "contiguous", 7), make(n, k, dtype, "contiguous", 8), make(1, n, dtype, "contiguous", 9)[0]
    dy = make(m, n, dtype, "contiguous", 10)
    results = {}
    for path in PATHS:
        with cpu_path(path):
            results[path] = [ops.linear(x, w, b), ops.linear_backward_input(dy, w), ops.linear_backward_weight(dy, x)]
    for path in PATHS[1:]:
        for ours, portable, depth in zip(results[path], results["portable"], (k, n, m)):
            torch.testing.assert_close(ours, portable, **tolerance(dtype, depth))


# Shapes above the parallel threshold, split by columns (wide N, or more rows than columns
# with A read in place: the forward and dX of (512, 256, 300)) and by rows (N = 10; dW of
# (64, 600, 40), whose A, dYᵀ, is packed, and whose 600 rows outnumber its 40 columns).
DETERMINISM_SHAPES = [(128, 256, 784), (1000, 10, 600), (512, 256, 300), (64, 600, 40)]


@pytest.mark.parametrize("path", PATHS)
def test_bit_identical_across_runs_and_thread_counts(path):
    for m, n, k in DETERMINISM_SHAPES:
        assert 2 * m * n * k > PARALLEL_MIN_FLOPS  # or threads would never be used
        x, w = make(m, k, torch.float32, "contiguous", 11), make(n, k, torch.float32, "contiguous", 12)
        b, dy = make(1, n, torch.float32, "contiguous", 13)[0], make(m, n, torch.float32, "contiguous", 14)

        def run():
            return [ops.linear(x, w, b), ops.linear_relu(x, w, b), ops.linear_backward_input(dy, w),
                    ops.linear_backward_weight(dy, x), ops.linear_backward_bias(dy)]

        with cpu_path(path):
            with num_threads(1):
                single = run()
            with num_threads(2):
                first, second = run(), run()
        for one, two, again in zip(single, first, second):
            assert torch.equal(two, again), f"{path}: two runs differ for M={m} N={n} K={k}"
            assert torch.equal(one, two), f"{path}: 1 and 2 threads differ for M={m} N={n} K={k}"


@pytest.mark.parametrize("path", PATHS)
def test_float32_error_does_not_grow_with_many_k_blocks(path):
    # Each K block's sum is added to C at the tile's store, not carried as one chain of K FMAs:
    # at K = 65536 (128 blocks) one chain's rms error was 4.6e-6 of the output's rms, torch's 3.9e-7.
    # The forward and dW (whose depth is the batch) both run the same tile.
    x, w = make(64, 65536, torch.float32, "contiguous", 31), make(32, 65536, torch.float32, "contiguous", 32)
    dy = make(65536, 8, torch.float32, "contiguous", 33)
    with cpu_path(path):
        products = [(ops.linear(x, w, None), x.double() @ w.double().t()),
                    (ops.linear_backward_weight(dy, x.t()), dy.double().t() @ x.double().t())]
    for ours, exact in products:
        relative_rms = ((ours.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
        assert relative_rms < 1e-6, f"{path}: {relative_rms:.2e}"


# The autograd backward calls the kernels directly (autograd.cpp backward_cpu), with dX and db
# on one thread and dW on the other when there are 2, each taking the other's column panels
# still left once done (from SHARED_MIN_FLOPS per product). (batch, out, in): two K blocks for
# dX (out > 800), ragged last tiles, the many-rows tile, a 10-class head, dW cut into panels
# that share one packed dYᵀ (the last two: ragged, and whole tiles); every grad_output layout.
SHARED_MIN_FLOPS = 8e6  # autograd.cpp kSharedMinFlops
BACKWARD_SHAPES = [(128, 1000, 2048), (300, 801, 49), (129, 65, 385), (512, 256, 31), (257, 10, 600),
                   (150, 90, 530), (256, 192, 384)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_backward_on_two_threads_matches_one_thread_bit_for_bit(path, dtype):
    for batch, out_features, in_features in BACKWARD_SHAPES:
        assert 2 * batch * out_features * in_features >= PARALLEL_MIN_FLOPS  # or dX and dW run one after the other
        input = make(batch, in_features, dtype, "contiguous", 21).requires_grad_()
        weight = make(out_features, in_features, dtype, "contiguous", 22).requires_grad_()
        bias = make(1, out_features, dtype, "contiguous", 23)[0].requires_grad_()
        for grad_layout in LAYOUTS:
            grad_output = make(batch, out_features, dtype, grad_layout, 24)

            def grads():
                input.grad = weight.grad = bias.grad = None
                ext.linear(input, weight, bias).backward(grad_output)
                return input.grad, weight.grad, bias.grad

            with cpu_path(path):
                with num_threads(1):
                    single = grads()
                with num_threads(2):  # which thread computes which panel changes from run to run
                    runs = [grads() for _ in range(3)]
            where = f"{path}: {batch}x{in_features}->{out_features}, {grad_layout} grad_output"
            expected = [grad_output.double() @ weight.double(), grad_output.double().t() @ input.double(),
                        grad_output.double().sum(0)]
            for shared in runs:
                for name, one, two, reference, depth in zip(("dX", "dW", "db"), single, shared, expected,
                                                            (out_features, batch, batch)):
                    assert torch.equal(one, two), f"{name} differs on 1 and 2 threads ({where})"
                    assert_close(two, reference, dtype, depth)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sum_rows_over_many_columns(layout):
    # sum_rows splits columns into tasks of 1024 (gemm.cpp); cross that and use both inner loops.
    for m, n in [(1, 1), (3, 1023), (70, 1025), (300, 2049)]:
        dy = make(m, n, torch.float64, layout, m + n)
        assert_close(ops.linear_backward_bias(dy), dy.sum(0), torch.float64, m)
        with num_threads(1):
            single = ops.linear_backward_bias(dy.float())
        with num_threads(2):
            assert torch.equal(ops.linear_backward_bias(dy.float()), single)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_sum_rows_adds_each_column_in_row_order_on_every_path(path, dtype):
    # Each path sums blocks of 4 vectors of columns, then single vectors, then a scalar tail;
    # every column must still add its rows in order: bit-identical to a sequential sum.
    lanes = LANES[path, dtype]
    for n in sorted({1, lanes - 1, lanes, lanes + 1, 4 * lanes - 1, 4 * lanes, 4 * lanes + 1, 9 * lanes + 3} - {0}):
        dy = make(37, n, dtype, "contiguous", n)
        expected = torch.zeros(n, dtype=dtype)
        for row in dy:
            expected += row
        with cpu_path(path):
            assert torch.equal(ops.linear_backward_bias(dy), expected), f"{path}: N={n}"


def test_set_cpu_path_names_the_active_path():
    for path in PATHS:
        with cpu_path(path):
            assert ops.cpu_path() == path
    assert ops.cpu_path() == PATHS[-1], "the best path this CPU supports is active by default"
