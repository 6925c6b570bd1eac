"""The CPU GEMM kernels (ext/csrc/cpu) through the raw ops, on every code path:
sizes crossing every register-tile and cache-block boundary, strided and
transposed operands, the fused bias/ReLU epilogue, path agreement, and
bit-identical results across runs and thread counts."""
import contextlib
import itertools

import pytest
import torch

import ext  # noqa: F401  (loads the ops)
from conftest import assert_within_rounding, num_threads

ops = torch.ops.ext

def block_sizes(path, dtype):
    """The path's register tiles, cache blocks and thresholds as the compiled kernels use
    them (gemm.cpp's cpu::block_sizes, through ext.cpu_block_sizes): read, never copied, so a
    retuned constant moves every edge case below with it."""
    return dict(ops.cpu_block_sizes(path, str(dtype).removeprefix("torch.")))


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


def exact(a, b, bias=None, relu=False):
    """A·B (+ bias, then ReLU) in float64, and each result's sum of its terms' magnitudes."""
    a, b = a.double(), b.double()
    value, magnitude = a @ b, a.abs() @ b.abs()
    if bias is not None:
        value, magnitude = value + bias.double(), magnitude + bias.double().abs()
    return (value.clamp_min(0) if relu else value), magnitude


def column_sums(a):
    """db's reference: the sum over rows, and the sum of magnitudes."""
    return a.double().sum(0), a.double().abs().sum(0)


def assert_close(actual, expected, terms):
    """actual within rounding of expected = (value, magnitude) (conftest.assert_within_rounding)."""
    assert_within_rounding(actual, *expected, terms)


def boundary_shapes(path, dtype):
    """(M, N, K) products whose sizes sit on, just below and just above MR, NR, MC, KC, the
    deepest single K block and NC,
    on each side of the row count where a row-major B stops being read in place, and of the
    one where the many-rows tile takes over; ragged last column panels of every vector count."""
    b = block_sizes(path, dtype)
    mr, nr, narrow_mr, narrow_nr = b["wide_mr"], b["wide_nr"], b["narrow_mr"], b["narrow_nr"]
    many_mr, many_nr, many_rows_min_rows = b["many_rows_mr"], b["many_rows_nr"], b["many_rows_min_rows"]
    kc, mc, nc, lanes, b_in_place_max_rows = b["kc"], b["mc"], b["nc"], b["lanes"], b["b_in_place_max_rows"]
    two_k_blocks = b["max_single_k_block"] + 1  # the shallowest K that runs in two blocks (KC + a ragged rest)
    shapes = [(m, nr + 1, two_k_blocks) for m in (1, mr - 1, mr, mr + 1, mc - 1, mc, mc + 1)]
    shapes += [(m, nr + 1, two_k_blocks) for m in (b_in_place_max_rows, b_in_place_max_rows + 1)]
    shapes += [(narrow_mr + 1, narrow_nr, two_k_blocks)]  # narrow tile, full
    shapes += [(mr + 1, n, 5) for n in (1, narrow_nr - 1, narrow_nr + 1, nr - 1, nr, nr + 1, nc - 1, nc, nc + 1)]
    shapes += [(mr + 1, nr + 1, k) for k in (1, kc - 1, kc, kc + 1, two_k_blocks - 1, two_k_blocks, 2 * kc + 1)]
    shapes.append((mc + 1, 2 * nr + 3, 2 * kc + 3))  # every block edge at once
    # Rows that fit in SINGLE_BLOCK_BYTES at depth min(K, KC) make one A block; one more, MC-row blocks.
    for k in (kc // 2, kc):
        single_block_rows = b["single_block_bytes"] // (k * dtype.itemsize)
        shapes += [(m, nr + 1, k) for m in (mc + 1, single_block_rows, single_block_rows + 1)]
    # Ragged last row panels run tiles of about 3 MR / 4, MR / 2 and MR / 4 rows: each of those, and one more
    # (within MR: one more than 3 MR / 4 is MR's tile through its edge copy, or MR itself).
    def row_variants(tile_mr):
        return sorted({(3 * tile_mr + 3) // 4, (tile_mr + 1) // 2, (tile_mr + 3) // 4})
    shapes += [(mr + r, nr + 1, two_k_blocks) for v in row_variants(mr) for r in (v, v + 1)]
    first_many = -(-many_rows_min_rows // many_mr) * many_mr
    shapes += [(first_many + r, many_nr + 1, two_k_blocks) for v in row_variants(many_mr) for r in (v, v + 1)]
    # The tall tile, for C of exactly its MR rows: a batch of tall_mr (forward, dX; with tall_mr outputs, a
    # shallow dX), and the dW of a head with tall_mr outputs; ragged columns, K in one block and in two.
    tall_mr, tall_nr = b["tall_mr"], b["tall_nr"]
    shapes += [(tall_mr, n, k) for n in (tall_nr - 1, tall_nr + lanes + 1) for k in (5, two_k_blocks)]
    shapes += [(m, tall_mr, k) for m in (5, tall_mr, two_k_blocks) for k in (tall_nr + 1, 2 * tall_nr + lanes)]
    # A one-vector column panel with A read in place (a narrow product; a wide one's last panel, whole and
    # ragged) runs two row tiles at a time: rows on each side of that tile's and of its multiples, K in one
    # block and in two (then C is added and prefetched).
    for tile_mr, n in ((b["narrow_one_vector_mr"], narrow_nr - 1), (b["narrow_one_vector_mr"], narrow_nr),
                       (b["one_vector_mr"], nr + lanes), (b["one_vector_mr"], nr + lanes - 3)):
        shapes += [(m, n, k) for m in (tile_mr - 1, tile_mr, tile_mr + 1, 2 * tile_mr + mr + 3) for k in (5, two_k_blocks)]
    # Ragged last column panels: each whole vector count below NR, and one vector plus one value.
    shapes += [(mr + 1, nr + v * lanes + extra, two_k_blocks) for v in range(1, nr // lanes) for extra in (0, 1)]
    # The many-rows tile: on each side of where it starts, its MR, NR and both of MC's edges.
    shapes += [(m, many_nr + 1, two_k_blocks) for m in (many_rows_min_rows - 1, many_rows_min_rows,
                                                 many_rows_min_rows + 1, many_rows_min_rows + many_mr - 1,
                                                 2 * mc - 1, 2 * mc + 1)]
    shapes += [(many_rows_min_rows + 1, n, 5) for n in (many_nr - 1, many_nr, many_nr + lanes + 1, nc + 1)]
    shapes += [(many_rows_min_rows + many_mr + 1, many_nr + v * lanes, k)
               for v in range(1, many_nr // lanes) for k in (kc, 2 * kc + 1)]
    # C's rows a page apart: on each side of the C size (L2) from which its row tiles run outermost over a
    # B packed whole (float64 also with two K blocks, whose B block still fits half of L2).
    page_cols = 4096 // dtype.itemsize
    wide_n = page_cols + lanes + 1 if dtype == torch.float32 else page_cols
    rows_over_l2 = b["l2_bytes"] // (wide_n * dtype.itemsize) + 1
    shapes += [(m, wide_n, k) for m in (rows_over_l2 - 1, rows_over_l2 + mr + 1) for k in (5, two_k_blocks)]
    # A row-major B with rows a whole number of pages apart is packed a micro-panel at a time, by the panel's
    # first row tile as it reads it (from MR rows; fewer, packed first): dX of a layer of 1024 float32 inputs,
    # and dW from a batch whose input has that width (A then packed too); K in one block and in two.
    shapes += [(m, n, page_cols) for m in (mr - 1, mr, mr + 1, 3 * mr + 2) for n in (nr + 1, two_k_blocks)]
    # With several A blocks a row-major B is packed whole by the first block's row tiles, each panel by its first
    # (a ragged last panel packed apart), and the later blocks read the copy: dX and dW of MC + 1 and 2 MC + MR + 1
    # rows, and as many as the many-rows tile runs, with a ragged last column panel and K in two blocks.
    for m in (mc + 1, 2 * mc + mr + 1, many_rows_min_rows + many_mr + 1):
        shapes += [(m, 2 * kc + 1, 2 * nr + 3), (2 * kc + 1, m, 2 * nr + 3)]
    # A column-major A (dW's dYᵀ) is packed by the row tiles of each A block's first column panel, a ragged last
    # row panel apart, and packed first where that panel is narrower than NR: dW (M = n, N = k, K = m) of MR ± 1
    # rows to two A blocks and a ragged rest, and as many as the many-rows tile runs; K in two blocks.
    for n in (mr - 1, mr + 1, mc + 3, 2 * mc + 1, many_rows_min_rows + many_mr + 1):
        shapes += [(two_k_blocks, n, k) for k in (nr - 1, nr, 2 * nr + 1)]
    # dX of a 10-class head (its K = 10): B's block (10 x in) on each side of the bytes that run row tiles outermost.
    rows_outer_max_cols = b["rows_outer_max_b_bytes"] // (10 * dtype.itemsize)
    shapes += [(m, 10, k) for m in (mr + 1, b_in_place_max_rows) for k in (rows_outer_max_cols, rows_outer_max_cols + 1)]
    return shapes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_forward_and_backward_across_block_boundaries(path, dtype):
    with cpu_path(path):
        for seed, (m, n, k) in enumerate(boundary_shapes(path, dtype)):
            x, w = make(m, k, dtype, "contiguous", seed), make(n, k, dtype, "contiguous", seed + 1000)
            b, dy = make(1, n, dtype, "contiguous", seed + 2000)[0], make(m, n, dtype, "contiguous", seed + 3000)
            shape = f"M={m} N={n} K={k}"
            assert_close(ops.linear(x, w, b), exact(x, w.t(), b), k + 1), shape
            assert_close(ops.linear_relu(x, w, b), exact(x, w.t(), b, relu=True), k + 1)
            assert_close(ops.linear_backward_input(dy, w), exact(dy, w), n)
            assert_close(ops.linear_backward_weight(dy, x), exact(dy.t(), x), m)
            assert_close(ops.linear_backward_bias(dy), column_sums(dy), m)


def assert_equal_on_1_to_3_threads(product, expected, where):
    """product() is expected to the bit on 1, 2 and 3 threads (each cut of the work its own)."""
    for threads in (1, 2, 3):
        with num_threads(threads):
            assert torch.equal(product(), expected), f"{where}, {threads} threads"


def shallow_shapes(path, dtype):
    """(rows, depth, columns) of products gemm.cpp runs as row panels of shallow tiles (both operands read in
    place, depth up to max_shallow_depth): rows on each side of the shallow and the wide tile's and up to the
    most that read B in place; columns a part of a vector, whole shallow tiles, one vector more, and one value
    more; depths of 1, a 10-class head's, the deepest taken and one deeper (wide tiles again)."""
    b = block_sizes(path, dtype)
    shallow_mr, shallow_nr, lanes = b["shallow_mr"], b["shallow_nr"], b["lanes"]
    rows = (1, shallow_mr - 1, shallow_mr, shallow_mr + 1, b["wide_mr"] + shallow_mr + 1, b["b_in_place_max_rows"])
    columns = (lanes - 1, 2 * shallow_nr, 2 * shallow_nr + lanes, 3 * shallow_nr + lanes + 1)
    depths = (1, 10, b["max_shallow_depth"], b["max_shallow_depth"] + 1)
    return [(m, k, n) for m in rows for k in depths for n in columns]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_a_shallow_product_in_row_panels_is_the_same_to_the_bit(path, dtype):
    # dX = dY·W and a forward whose W is stored transposed (B = Wᵀ row-major) read both operands in place and, up
    # to max_shallow_depth, run row panels of shallow tiles. The same products with the left operand
    # column-major are packed and run the wide tiles: each element must get the same arithmetic, its bias,
    # ReLU and any thread count included.
    with cpu_path(path):
        for seed, (m, k, n) in enumerate(shallow_shapes(path, dtype)):
            a, b = make(m, k, dtype, "contiguous", seed), make(k, n, dtype, "contiguous", seed + 100)
            a_column_major, bias = a.t().contiguous().t(), make(1, n, dtype, "contiguous", seed + 200)[0]
            w_stored_transposed = b.t()  # n x k, column-major: its transpose is b, row-major
            shape = f"M={m} K={k} N={n}"
            products = [(lambda left: ops.linear_backward_input(left, b), None, False)]
            products += [(lambda left, op=op, bias_=bias_: op(left, w_stored_transposed, bias_), bias_, relu)
                         for op, relu in ((ops.linear, False), (ops.linear_relu, True)) for bias_ in (bias, None)]
            for product, bias_, relu in products:
                expected = product(a_column_major)
                assert_close(expected, exact(a, b, bias_, relu=relu), k + (bias_ is not None))
                assert_equal_on_1_to_3_threads(lambda: product(a), expected, shape)


def shallow_vectors(fmas_per_cycle, shallow_mr):
    """The shallow tile's vectors: enough for 8 sums in flight, or 16 where the core issues two 512-bit FMAs a
    cycle (gemm.cpp, with_shallow_tiles_for), at most kMaxTileVectors (4)."""
    return min(4, -(-8 * fmas_per_cycle // shallow_mr))


def test_the_shallow_tiles_follow_the_fmas_a_core_issues_a_cycle():
    for path in PATHS:
        for dtype in DTYPES:
            b = block_sizes(path, dtype)
            assert b["fmas_per_cycle"] in ((1, 2) if path == "avx512" else (1,)), path
            assert b["shallow_nr"] == shallow_vectors(b["fmas_per_cycle"], b["shallow_mr"]) * b["lanes"], \
                (path, dtype, b["shallow_mr"], b["shallow_nr"])


@pytest.mark.skipif("avx512" not in PATHS, reason="this CPU has no AVX-512")
@pytest.mark.parametrize("fmas", ["1", "2"])
def test_either_fma_rate_runs_its_shallow_tiles_to_the_bit(fmas):
    """LINEAR_LAB_FMAS_PER_CYCLE runs the shallow tiles another CPU would pick (Zen 4's, or Zen 5's): the
    shallow-product test above, in a process of its own, on the AVX-512 path."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "LINEAR_LAB_FMAS_PER_CYCLE": fmas}
    probe = subprocess.run([sys.executable, "-c", "import torch, ext; b = torch.ops.ext.cpu_block_sizes('avx512', "
                            "'float32'); print(b['fmas_per_cycle'], b['shallow_mr'], b['shallow_nr'])"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert probe.returncode == 0, probe.stderr[-2000:]
    got_fmas, shallow_mr, shallow_nr = map(int, probe.stdout.split())
    assert got_fmas == int(fmas) and shallow_nr == shallow_vectors(got_fmas, shallow_mr) * 16
    test = f"{__file__}::test_a_shallow_product_in_row_panels_is_the_same_to_the_bit"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-k", "avx512"],
                            capture_output=True, text=True, timeout=600, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


def test_a_malformed_fma_rate_override_is_one_line():
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", "import torch, ext; ext.linear(torch.ones(2, 2), torch.ones(2, 2))"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LINEAR_LAB_FMAS_PER_CYCLE": "3"})
    if "avx512" not in PATHS:  # measured, and overridden, only where the CPU has AVX-512
        assert result.returncode == 0, result.stderr[-2000:]
        return
    assert result.returncode != 0
    assert "LINEAR_LAB_FMAS_PER_CYCLE='3' is not 1 or 2" in result.stderr


LAYOUTS = ["contiguous", "transposed", "strided"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_strided_and_transposed_operands(path, dtype):
    b = block_sizes(path, dtype)
    # Ragged in every dimension, on the wide tile, then on the many-rows one (M and,
    # for dW, N of at least many_rows_min_rows), then on the tall one (dX of a batch of
    # tall_mr, dW of a head of tall_mr outputs).
    k = b["max_single_k_block"] + 9
    shapes = [(2 * b["wide_mr"] + 1, b["wide_nr"] + 3, k),
              (b["many_rows_min_rows"] + 2 * b["many_rows_mr"] + 1, b["many_rows_min_rows"] + 3, k),
              (b["tall_mr"], b["wide_nr"] + 3, k), (2 * b["wide_mr"] + 1, b["tall_mr"], k)]
    with cpu_path(path):
        for (m, n, k), x_layout, w_layout in itertools.product(shapes, LAYOUTS, LAYOUTS):
            x, w = make(m, k, dtype, x_layout, 1), make(n, k, dtype, w_layout, 2)
            dy, b = make(m, n, dtype, x_layout, 3), make(1, n, dtype, "contiguous", 4)[0]
            assert_close(ops.linear(x, w, b), exact(x, w.t(), b), k + 1)
            assert_close(ops.linear_relu(x, w, None), exact(x, w.t(), None, relu=True), k)
            assert_close(ops.linear_backward_input(dy, w), exact(dy, w), n)
            assert_close(ops.linear_backward_weight(dy, x), exact(dy.t(), x), m)
            assert_close(ops.linear_backward_bias(dy), column_sums(dy), m)


def computes_transposed(m, n, k, b):
    """Whether gemm computes the forward Y = X·Wᵀ (X contiguous, W as held) as Yᵀ = W·Xᵀ: gemm.cpp's rule,
    its two numbers read from the kernels (ext.cpu_block_sizes)."""
    return m >= b["transposed_min_rows"] and k * (n - m) > b["transposed_c_cost"] * m * n


def first_transposed_depth(m, n, b):
    """The least K from which an m-row forward with n outputs is computed as Yᵀ."""
    return b["transposed_c_cost"] * m * n // (n - m) + 1


def transposed_shapes(path, dtype):
    """(M, N, K) forwards computed as Yᵀ = W·Xᵀ: the fewest rows the rule takes (the narrow tile's width),
    ragged row and column panels of each tile Yᵀ runs (narrow, wide, many-rows), K in one block and in
    several (the bias starts only the first block's sums, the ReLU ends the last), and the least K.
    (No shallow K: the rule needs K > transposed_c_cost·M.)"""
    b = block_sizes(path, dtype)
    rows, lanes, kc = b["transposed_min_rows"], b["lanes"], b["kc"]
    two_k_blocks = b["max_single_k_block"] + 1
    shapes = [(rows, 5 * b["narrow_mr"] + 3, two_k_blocks),                       # Yᵀ on the narrow tile
              (rows + 1, 7 * b["wide_mr"] + 1, 2 * kc + 1),                        # the wide tile, one value past a vector
              (b["wide_nr"] + lanes + 1, b["many_rows_min_rows"] + b["many_rows_mr"] + 1, 2 * kc + 3)]  # many rows
    shapes += [(rows, n, first_transposed_depth(rows, n, b)) for n in (2 * rows, 5 * b["narrow_mr"] + 1)]
    assert all(computes_transposed(m, n, k, b) for m, n, k in shapes)
    return shapes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_a_forward_computed_as_its_transpose_is_the_same_to_the_bit(path, dtype):
    # The same product with X column-major is never computed as Yᵀ (X's panels are packed instead): every
    # element must get the same arithmetic either way, on any thread count.
    with cpu_path(path):
        for seed, (m, n, k) in enumerate(transposed_shapes(path, dtype)):
            x, w = make(m, k, dtype, "contiguous", seed), make(n, k, dtype, "contiguous", seed + 100)
            x_column_major, bias = x.t().contiguous().t(), make(1, n, dtype, "contiguous", seed + 200)[0]
            shape = f"M={m} N={n} K={k}"
            for op, relu in ((ops.linear, False), (ops.linear_relu, True)):
                for b in (bias, None):
                    expected = op(x_column_major, w, b)
                    assert_close(expected, exact(x, w.t(), b, relu=relu), k + 1)
                    assert_equal_on_1_to_3_threads(lambda: op(x, w, b), expected, shape)


@pytest.mark.parametrize("path", PATHS)
def test_bias_and_relu_epilogue(path):
    m, n, k = 37, 41, 19
    x, w = make(m, k, torch.float64, "contiguous", 5), make(n, k, torch.float64, "contiguous", 6)
    b = torch.linspace(-3, 3, n, dtype=torch.float64)  # sign changes across the row: ReLU must clip some
    with cpu_path(path):
        relu_out = ops.linear_relu(x, w, b)
        assert (relu_out == 0).any() and (relu_out > 0).any()
        assert_close(relu_out, exact(x, w.t(), b, relu=True), k + 1)
        assert_close(ops.linear(x, w, None), exact(x, w.t()), k)
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
    magnitudes = [exact(x, w.t(), b)[1], exact(dy, w)[1], exact(dy.t(), x)[1]]
    for path in PATHS[1:]:  # two float results: each side's rounding counts
        for ours, portable, magnitude, terms in zip(results[path], results["portable"], magnitudes, (k + 1, n, m),
                                                    strict=True):
            assert_within_rounding(ours, portable, magnitude, terms, reference_dtype=dtype)


# Shapes above the parallel threshold, split by columns (wide N, or more rows than columns
# with A read in place: the forward and dX of (512, 256, 300)) and by rows (N = 10; dW of
# (64, 600, 40), whose A, dYᵀ, is packed, and whose 600 rows outnumber its 40 columns).
# Under 4 Mflop a product is cut into whole slabs (gemm.cpp, kWholeSlabsMaxFlops): (131, 10, 200)
# and (64, 64, 64) split their dX by rows, with both operands read in place, and the first its dW
# (10 rows of 200 columns) by columns, with no panels taken between threads.
DETERMINISM_SHAPES = [(128, 256, 784), (1000, 10, 600), (512, 256, 300), (64, 600, 40), (131, 10, 200),
                      (64, 64, 64)]


# "Any thread count": more threads than this machine's cores too, so that every way of
# cutting the columns (by 3, 4, 5) is compared with one thread.
THREAD_COUNTS = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("path", PATHS)
def test_bit_identical_across_runs_and_thread_counts(path):
    sizes = block_sizes(path, torch.float32)
    assert any(2 * m * n * k < sizes["whole_slabs_max_flops"] for m, n, k in DETERMINISM_SHAPES)
    for m, n, k in DETERMINISM_SHAPES:
        assert 2 * m * n * k > sizes["parallel_min_flops"]  # or threads would never be used
        x, w = make(m, k, torch.float32, "contiguous", 11), make(n, k, torch.float32, "contiguous", 12)
        b, dy = make(1, n, torch.float32, "contiguous", 13)[0], make(m, n, torch.float32, "contiguous", 14)

        def run():
            return [ops.linear(x, w, b), ops.linear_relu(x, w, b), ops.linear_backward_input(dy, w),
                    ops.linear_backward_weight(dy, x), ops.linear_backward_bias(dy)]

        with cpu_path(path):
            with num_threads(1):
                single = run()
            with num_threads(2):
                first, again = run(), run()
            for one, two, repeated in zip(single, first, again, strict=True):
                assert torch.equal(two, repeated), f"{path}: two runs differ for M={m} N={n} K={k}"
                assert torch.equal(one, two), f"{path}: 1 and 2 threads differ for M={m} N={n} K={k}"
            for count in THREAD_COUNTS[2:]:
                with num_threads(count):
                    results = run()
                for one, many in zip(single, results, strict=True):
                    assert torch.equal(one, many), f"{path}: 1 and {count} threads differ for M={m} N={n} K={k}"


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
# still left once done (from shared_min_flops per product). (batch, out, in): two K blocks for
# dX (out > 800), ragged last tiles, the many-rows tile, a 10-class head, dW cut into panels
# that share one packed dYᵀ (the last two: ragged, and whole tiles); every grad_output layout.
BACKWARD_SHAPES = [(128, 1000, 2048), (300, 801, 49), (129, 65, 385), (512, 256, 31), (257, 10, 600),
                   (150, 90, 530), (256, 192, 384)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_backward_on_more_threads_matches_one_thread_bit_for_bit(path, dtype):
    sizes = block_sizes(path, dtype)
    flops = [2 * batch * out_features * in_features for batch, out_features, in_features in BACKWARD_SHAPES]
    assert min(flops) >= sizes["parallel_min_flops"]  # or dX and dW run one after the other
    assert min(flops) < sizes["shared_min_flops"] <= max(flops)  # with and without shared chunks
    for batch, out_features, in_features in BACKWARD_SHAPES:
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
                runs = []
                for count in [2, 2, 2, *THREAD_COUNTS[2:]]:  # which thread computes which panel changes from run to run
                    with num_threads(count):
                        runs.append(grads())
            where = f"{path}: {batch}x{in_features}->{out_features}, {grad_layout} grad_output"
            expected = [exact(grad_output, weight), exact(grad_output.t(), input), column_sums(grad_output)]
            for shared in runs:
                for name, one, two, reference, depth in zip(("dX", "dW", "db"), single, shared, expected,
                                                            (out_features, batch, batch), strict=True):
                    assert torch.equal(one, two), f"{name} differs on 1 and more threads ({where})"
                    assert_close(two, reference, depth)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sum_rows_over_many_columns(layout):
    # sum_rows splits columns into tasks of 1024 (gemm.cpp); cross that and use both inner loops.
    for m, n in [(1, 1), (3, 1023), (70, 1025), (300, 2049)]:
        dy = make(m, n, torch.float64, layout, m + n)
        assert_close(ops.linear_backward_bias(dy), column_sums(dy), m)
        with num_threads(1):
            single = ops.linear_backward_bias(dy.float())
        with num_threads(2):
            assert torch.equal(ops.linear_backward_bias(dy.float()), single)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_sum_rows_adds_each_column_in_row_order_on_every_path(path, dtype):
    # Each path sums blocks of 4 vectors of columns, then single vectors, then a scalar tail;
    # every column must still add its rows in order: bit-identical to a sequential sum.
    lanes = block_sizes(path, dtype)["lanes"]
    for n in sorted({1, lanes - 1, lanes, lanes + 1, 4 * lanes - 1, 4 * lanes, 4 * lanes + 1, 9 * lanes + 3} - {0}):
        dy = make(37, n, dtype, "contiguous", n)
        expected = torch.zeros(n, dtype=dtype)
        for row in dy:
            expected += row
        with cpu_path(path):
            assert torch.equal(ops.linear_backward_bias(dy), expected), f"{path}: N={n}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_relu_backward_is_the_linear_backward_of_the_masked_gradient(path, dtype):
    # linear_relu's backward masks dY and sums db in one pass of its own (autograd.cpp,
    # relu_backward_sum_rows): every gradient must be, to the bit, what threshold_backward's
    # mask followed by linear's backward gives, over the mask kernel's column blocks and tail,
    # its split into 1024-column tasks (from 64k values), zero and NaN outputs, NaN in dY, and
    # dY in layouts that take torch's threshold_backward instead.
    lanes = block_sizes(path, dtype)["lanes"]
    widths = sorted({1, lanes - 1, lanes + 1, 4 * lanes, 4 * lanes + 3, 9 * lanes + 1} - {0})
    shapes = [(37, n, 11) for n in widths] + [(3, 5, 300), (64, 1100, 16), (66, 2049, 5)]
    for (batch, out_features, in_features), has_bias, threads in itertools.product(shapes, (True, False), (1, 2)):
        input = make(batch, in_features, dtype, "contiguous", batch)
        weight = make(out_features, in_features, dtype, "contiguous", out_features)
        bias = make(1, out_features, dtype, "contiguous", 3)[0] if has_bias else None
        input[0, :] = float("nan")  # a NaN output row: its gradient passes through
        with cpu_path(path), num_threads(threads):
            output = ops.linear_relu(input, weight, bias)
            assert (output == 0).any() and output.isnan().any()
            for grad_layout in LAYOUTS:
                grad_output = make(batch, out_features, dtype, grad_layout, 7)
                grad_output[-1, 0] = float("nan")
                leaves = [t.clone().requires_grad_() if t is not None else None for t in (input, weight, bias)]
                ext.linear_relu(*leaves).backward(grad_output)
                masked = torch.ops.aten.threshold_backward(grad_output, output, 0)
                expected = [t.clone().requires_grad_() if t is not None else None for t in (input, weight, bias)]
                ext.linear(*expected).backward(masked)
                where = f"{path}, {threads} threads: {batch}x{in_features}->{out_features}, {grad_layout} dY"
                for name, ours, reference in zip(("dX", "dW", "db"), leaves, expected):
                    if ours is not None:
                        torch.testing.assert_close(ours.grad, reference.grad, rtol=0, atol=0, equal_nan=True,
                                                   msg=lambda m: f"{name} ({where}): {m}")


def test_set_cpu_path_names_the_active_path():
    for path in PATHS:
        with cpu_path(path):
            assert ops.cpu_path() == path
    assert ops.cpu_path() == PATHS[-1], "the best path this CPU supports is active by default"


# Cache blocking from the running CPU's caches (gemm.cpp: caches, block_rows)


def sysfs_caches():
    """cpu0's L1d and L2 as the kernel reports them, or None where it does not."""
    import pathlib
    sizes = {}
    for index in sorted(pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        value = int(size[:-1]) * {"K": 1024, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
        if (level, kind) == ("1", "Data"):
            sizes["l1d"] = value
        elif level == "2" and kind != "Instruction":
            sizes["l2"] = value
    return sizes if len(sizes) == 2 else None


def expected_mc(path, l2_bytes):
    """The rule in gemm.cpp: a quarter of L2 (AVX-512) or half (others) in rows of 2 KiB, rounded down to
    a multiple of every MR of the path."""
    share, multiple = {"avx512": (4, 24), "avx2+fma": (2, 6), "portable": (2, 4)}[path]
    return max(multiple, l2_bytes // share // 2048 // multiple * multiple)


def test_blocking_follows_this_cpus_caches():
    caches = sysfs_caches()
    if caches is None:
        pytest.skip("this kernel reports no cache sizes in sysfs")
    for path in PATHS:
        b = block_sizes(path, torch.float32)
        assert (b["l1d_bytes"], b["l2_bytes"]) == (caches["l1d"], caches["l2"])
        assert b["mc"] == expected_mc(path, caches["l2"])
        assert b["rows_outer_max_b_bytes"] == caches["l1d"] * 5 // 8


SCRIPT = """
import torch, torch.nn.functional as F, ext
b = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")
print(b["l1d_bytes"], b["l2_bytes"], b["mc"], b["single_block_bytes"])
torch.manual_seed(0)
for m, k, n in [(300, 700, 130), (1000, 64, 520), (10, 2048, 1000)]:
    x, w = torch.randn(m, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    assert torch.allclose(ext.linear(x, w), x @ w.t(), rtol=1e-12, atol=1e-10), (m, k, n)
x, w = torch.randn(6, 40, 12, 12, dtype=torch.float64), torch.randn(50, 40, 3, 3, dtype=torch.float64)
assert torch.allclose(ext.conv2d(x, w, padding=1), F.conv2d(x, w, padding=1), rtol=1e-12, atol=1e-10)
"""


@pytest.mark.parametrize("caches, l1d, l2", [("l1d=32K,l2=1M", 32768, 1 << 20), ("l1d=32K,l2=512K", 32768, 1 << 19),
                                             ("l1d=48K,l2=2048K", 49152, 2 << 20)])
def test_another_cpus_caches_give_its_blocking_and_the_same_results(caches, l1d, l2):
    """LINEAR_LAB_CPU_CACHES runs the blocking of a Zen 4/5 (1 MiB L2), a Zen 3 (512 KiB) or the Xeon here."""
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LINEAR_LAB_CPU_CACHES": caches})
    assert result.returncode == 0, result.stderr[-2000:]
    got_l1d, got_l2, mc, single = map(int, result.stdout.split()[-4:])
    path = ops.cpu_path()
    assert (got_l1d, got_l2, mc) == (l1d, l2, expected_mc(path, l2))
    assert single == l2 // (4 if path == "avx512" else 2)


def test_a_malformed_cache_override_is_one_line():
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", "import torch, ext; ext.linear(torch.ones(2, 2), torch.ones(2, 2))"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LINEAR_LAB_CPU_CACHES": "l2=lots"})
    assert result.returncode != 0
    assert "LINEAR_LAB_CPU_CACHES='l2=lots' is not l1d=<size>,l2=<size>" in result.stderr


# What gemm packs, and the register tile alone: bench.ceiling's two measurements


def packed_by(product):
    """The values of A and of B that one call of product packs, as gemm.cpp counts them."""
    a_before, b_before = ops.cpu_packed_values()
    product()
    a_after, b_after = ops.cpu_packed_values()
    return a_after - a_before, b_after - b_before


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("path", PATHS)
def test_the_packed_value_counts_say_which_operand_a_product_packs(path):
    torch.set_num_threads(1)  # on more, each column slab of a dW packs its own copy of A
    b = block_sizes(path, torch.float32)
    rows, k, n = 4 * b["wide_mr"], 64, 2 * b["wide_nr"]  # whole tiles; B far under half of L2
    x, w, dy = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    w_stored_transposed = w.t().contiguous().t()
    tall = (b["b_in_place_max_rows"] // b["wide_mr"] + 1) * b["wide_mr"]  # whole tiles, too many to read B in place
    with cpu_path(path):
        # The forward's B is Wᵀ: transposed into panels, every value once; the input is read in place.
        assert packed_by(lambda: ops.linear(x, w, None)) == (0, k * n)
        # The same weights stored transposed: B's rows are contiguous and read in place.
        assert packed_by(lambda: ops.linear(x, w_stored_transposed, None)) == (0, 0)
        assert packed_by(lambda: ops.linear(torch.randn(tall, k), w_stored_transposed, None)) == (0, k * n)
        # dX = dY·W reads W in place; dW = dYᵀ·X packs dYᵀ once and reads X in place.
        assert packed_by(lambda: ops.linear_backward_input(dy, w)) == (0, 0)
        # Unless W's rows are a page apart: then its panels are packed, each by its first row tile.
        w_pages = torch.randn(n, 4096 // 4)
        assert packed_by(lambda: ops.linear_backward_input(dy, w_pages)) == (0, n * w_pages.shape[1])
        # More rows than one A block (whole tiles of the wide tile's): W packed once, by the first block's tiles,
        # read by every block.
        blocks_dy = torch.randn((max(b["mc"], b["b_in_place_max_rows"]) // b["wide_mr"] + 1) * b["wide_mr"], n)
        assert blocks_dy.shape[0] < b["many_rows_min_rows"]
        assert packed_by(lambda: ops.linear_backward_input(blocks_dy, w)) == (0, n * k)
        # A shallow dX (a 10-class head's) too, in row panels; only the column past its last whole vector is
        # copied into a panel, once (rows in whole wide tiles too, none of dY's packed for a ragged one).
        head_dy, head_w = torch.randn(b["wide_mr"] * b["shallow_mr"], 10), torch.randn(10, 2 * b["shallow_nr"] + 1)
        assert packed_by(lambda: ops.linear_backward_input(head_dy, head_w)) == (0, 10)
        assert packed_by(lambda: ops.linear_backward_weight(dy, x)) == (n * rows, 0)
        # dYᵀ in more than one A block, with a ragged last row panel: still every value once, by the tiles; and X,
        # now under more rows of C than read it in place, once too.
        outputs = 2 * b["mc"] + 3
        assert outputs > b["b_in_place_max_rows"]
        assert packed_by(lambda: ops.linear_backward_weight(torch.randn(rows, outputs), x)) == (outputs * rows, rows * k)
        # Few rows and deep enough: Yᵀ = W·Xᵀ reads W in place and transposes only X into panels (Yᵀ's rows
        # whole panels of its tile, the narrow one, so that none is packed for its padding).
        rows, n = b["transposed_min_rows"], 4 * b["narrow_mr"]
        k = first_transposed_depth(rows, n, b)
        assert packed_by(lambda: ops.linear(torch.randn(rows, k), torch.randn(n, k), None)) == (0, rows * k)
        # One shallower, or one row fewer: W's panels are packed (and X's ragged last row panel, if any).
        assert packed_by(lambda: ops.linear(torch.randn(rows, k - 1), torch.randn(n, k - 1), None))[1] == n * (k - 1)
        assert packed_by(lambda: ops.linear(torch.randn(rows - 1, k), torch.randn(n, k), None))[1] == n * k


@pytest.mark.parametrize("path", PATHS)
def test_the_tile_alone_runs_every_tile_of_every_path(path):
    with cpu_path(path):
        b = block_sizes(path, torch.float32)
        for tile in ("wide", "narrow", "many_rows", "tall"):
            for vectors in range(1, b[f"{tile}_nr"] // b["lanes"] + 1):
                gflops = ops.tile_gflops(tile, vectors, 16, 1)
                assert 0 < gflops < float("inf"), (tile, vectors, gflops)
        assert 0 < ops.tile_gflops("one_vector", 1, 16, 1) < float("inf")
        assert ops.tile_gflops("wide", 1, 8, 2) > 0


@pytest.mark.parametrize("args, message", [
    (("square", 1, 16, 1), "tile must be 'wide', 'narrow', 'many_rows', 'tall' or 'one_vector'"),
    (("one_vector", 2, 16, 1), "vectors must be 1 to 1 for this tile"),
    (("wide", 0, 16, 1), "vectors must be 1 to"),
    (("narrow", 2, 16, 1), "vectors must be 1 to 1 for this tile"),
    (("wide", 1, 0, 1), "kc must be 1 to 4096"),
    (("wide", 1, 16, 0), "num_threads must be 1 to 256"),
])
def test_a_bad_tile_measurement_is_one_line_naming_the_argument(args, message):
    with pytest.raises(RuntimeError) as error:
        ops.tile_gflops(*args)
    first_line = str(error.value).splitlines()[0]
    assert first_line.startswith("ext.tile_gflops: ") and message in first_line


THREADS_THAT_CANNOT_START = """
import resource, torch, ext
with open("/proc/self/status") as status:
    in_use = [int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize")][0]
# Room for a few threads' 8 MiB stacks, not for 128: starting them fails part way.
resource.setrlimit(resource.RLIMIT_AS, (in_use + 64 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
for measure in (lambda: torch.ops.ext.tile_gflops("wide", 1, 1, 128), lambda: torch.ops.ext.fma_peak_gflops(128)):
    try:
        measure()
        print("measured")
    except (RuntimeError, MemoryError) as error:
        print(type(error).__name__)
"""


def test_a_measurement_whose_threads_cannot_start_is_an_error_not_an_abort():
    """The tile and peak measurements start threads of their own; one that fails to start used to leave the
    others joinable, and the process ended in std::terminate."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", THREADS_THAT_CANNOT_START], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["RuntimeError", "RuntimeError"], result.stdout
