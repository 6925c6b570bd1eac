"""The real CUDA kernels (ext/csrc/cuda/*.cuh), run on the CPU through the emulation of
the CUDA execution model in tests/cuda_emu/cuda_emu.h and compared with PyTorch.

Also under ThreadSanitizer and AddressSanitizer: the real kernels must be clean, and the
deliberately broken variants (EMU_BREAK_* switches in gemm.cuh) must each be caught.

Inputs are multiples of 1/4 in [-2, 2]: every product and sum is exact in float32, so each
result must equal PyTorch's float64 result rounded to the dtype, bit for bit. That checks
the indexing exactly, and the rounding of float16/bfloat16 stores too. The arithmetic itself
(which type accumulates, and when results are rounded) is checked at the end, on random
inputs and long reductions.
"""
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from build import driver_path  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulation harness needs Linux and g++")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
GEMM_OPS = ["linear", "linear_relu", "backward_input", "backward_weight"]
OPS = [*GEMM_OPS, "backward_bias"]
BARRIER_TIMEOUT_EXIT = 86  # emu::kBarrierTimeoutExit in cuda_emu.h
TSAN_RACE_EXIT = 66  # ThreadSanitizer's exit code when it reported something

# (M, N, K): degenerate, prime, and just off every tile edge (block tile 128 x 128 x 8; a test
# below checks these against the sizes the compiled kernels report).
SHAPES = [
    (1, 1, 1),
    (37, 61, 45),
    (128, 128, 8),
    (129, 127, 9),
    (127, 129, 7),
    (1, 130, 17),
    (130, 1, 33),
    (3, 5, 0),
]
# Aligned, contiguous, row lengths a multiple of 4: every operand takes the wide-load path,
# the second with partial runs at the M and K edges.
WIDE_SHAPES = [(64, 64, 64), (130, 68, 12)]
LAYOUTS = ["contiguous", "transposed", "misaligned", "strided"]


def quarters(*shape, generator):
    """Random multiples of 1/4 in [-2, 2]: exact in every dtype, products exact in float32."""
    return torch.randint(-8, 9, shape, generator=generator).double() / 4


def lay_out(values, layout):
    """(storage, offset, strides) holding the 2-D `values` in the given memory layout."""
    rows, cols = values.shape
    if layout == "contiguous":
        return values.flatten(), 0, (cols, 1)
    if layout == "transposed":
        return values.t().flatten(), 0, (1, rows)
    if layout == "misaligned":  # one element in: no wide load may be used
        return torch.cat([torch.zeros(1, dtype=values.dtype), values.flatten()]), 1, (cols, 1)
    if layout == "strided":  # every other column of a wider, padded row
        row_stride = 2 * cols + 3
        storage = torch.zeros(max(rows * row_stride, 1), dtype=values.dtype)
        torch.as_strided(storage, (rows, cols), (row_stride, 2)).copy_(values)
        return storage, 0, (row_stride, 2)
    raise ValueError(layout)


def write_operand(directory, name, values, layout, dtype):
    """Writes `values` (2-D, or 1-D for a bias) and returns the driver's operand spec."""
    matrix = values if values.dim() == 2 else values.unsqueeze(1)
    storage, offset, (row_stride, col_stride) = lay_out(matrix, layout if values.dim() == 2 else "contiguous")
    path = directory / name
    storage.to(dtype).contiguous().view(torch.uint8).numpy().tofile(path)
    rows, cols = matrix.shape
    return f"{path},{offset},{rows},{cols},{row_stride},{col_stride}"


def run_driver(variant, args, env=None):
    """Runs a driver build; retries TSan once without address-space randomisation if the
    kernel's mmap layout is one TSan cannot map (some kernels with large mmap_rnd_bits)."""
    command = [str(driver_path(variant)), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if "ThreadSanitizer" in result.stderr and "memory mapping" in result.stderr:
        command = ["setarch", platform.machine(), "-R", *command]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    return result


def read_output(path, dtype, shape):
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)


def make_case(op, shape, seed=0):
    """The op's inputs (float64) and its exact reference result (float64)."""
    M, N, K = shape
    g = torch.Generator().manual_seed(seed)
    if op in ("linear", "linear_relu"):
        x, w, b = quarters(M, K, generator=g), quarters(N, K, generator=g), quarters(N, generator=g)
        y = F.linear(x, w, b)
        return {"x": x, "w": w, "bias": b}, (torch.relu(y) if op == "linear_relu" else y)
    dy = quarters(M, N, generator=g)
    if op == "backward_input":
        w = quarters(N, K, generator=g)
        return {"dy": dy, "w": w}, dy @ w
    if op == "backward_weight":
        x = quarters(M, K, generator=g)
        return {"dy": dy, "x": x}, dy.t() @ x
    return {"dy": dy}, dy.sum(0)


def run_case(tmp_path, op, dtype_name, shape, layout="contiguous", variant="plain", env=None, seed=0):
    """Runs one op through a driver build; returns (result, output or None, exact reference)."""
    dtype = DTYPES[dtype_name]
    inputs, reference = make_case(op, shape, seed)
    specs = [write_operand(tmp_path, name, values, layout, dtype) for name, values in inputs.items()]
    out_path = tmp_path / "out"
    result = run_driver(variant, [op, dtype_name, str(out_path), *specs], env)
    output = read_output(out_path, dtype, reference.shape) if result.returncode == 0 else None
    return result, output, reference.to(dtype)


def assert_matches(result, output, expected):
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_kernels_match_torch_on_awkward_shapes(tmp_path, op, dtype_name, shape):
    assert_matches(*run_case(tmp_path, op, dtype_name, shape))


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_kernels_read_any_layout(tmp_path, op, dtype_name, layout):
    assert_matches(*run_case(tmp_path, op, dtype_name, (37, 61, 45), layout))


@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", GEMM_OPS)
def test_aligned_operands_take_the_wide_load_path(tmp_path, op, dtype_name, shape):
    result, output, expected = run_case(tmp_path, op, dtype_name, shape)
    assert_matches(result, output, expected)
    assert "wide_loads a=1 b=1" in result.stdout


@pytest.mark.parametrize("layout", ["misaligned", "strided"])
def test_misaligned_or_strided_operands_fall_back_to_scalar_loads(tmp_path, layout):
    result, output, expected = run_case(tmp_path, "linear", "float32", (64, 64, 64), layout)
    assert_matches(result, output, expected)
    assert "wide_loads a=0 b=0" in result.stdout


def test_nan_passes_through_fused_relu(tmp_path):
    x = torch.tensor([[float("nan"), 1.0], [-1.0, 1.0]])
    w = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    specs = [write_operand(tmp_path, name, t, "contiguous", torch.float32) for name, t in (("x", x), ("w", w))]
    result = run_driver("plain", ["linear_relu", "float32", str(tmp_path / "out"), *specs])
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(read_output(tmp_path / "out", torch.float32, (2, 2)), torch.relu(F.linear(x, w)),
                               equal_nan=True, rtol=0, atol=0)


# ---- the emulated float16 / bfloat16 conversions agree with PyTorch's ----

def all_bit_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def narrowing_inputs(dtype):
    """Every representable value, every midpoint between neighbours (ties to even), random
    float32 bit patterns (including NaNs and infinities), and the overflow edges."""
    values = all_bit_patterns(dtype).float()
    finite = values[values.isfinite()].double().unique()
    midpoints = ((finite[1:] + finite[:-1]) / 2).float()
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 3.4e38, 2.0**-25, 3 * 2.0**-26, 2.0**-24, -0.0])
    return torch.cat([values, midpoints, random_bits.view(torch.float32), edges])


def assert_same_values(actual, expected):
    assert torch.equal(actual.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(actual[keep].view(torch.int16 if actual.element_size() == 2 else torch.int32),
                       expected[keep].view(torch.int16 if expected.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_emulated_widening_matches_torch(tmp_path, dtype_name):
    patterns = all_bit_patterns(DTYPES[dtype_name])
    patterns.view(torch.uint8).numpy().tofile(tmp_path / "in")
    result = run_driver("plain", ["to_float", dtype_name, str(tmp_path / "out"), str(tmp_path / "in")])
    assert result.returncode == 0, result.stderr
    assert_same_values(read_output(tmp_path / "out", torch.float32, patterns.shape), patterns.float())


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_emulated_rounding_matches_torch(tmp_path, dtype_name):
    values = narrowing_inputs(DTYPES[dtype_name])
    values.numpy().tofile(tmp_path / "in")
    result = run_driver("plain", ["to_dtype", dtype_name, str(tmp_path / "out"), str(tmp_path / "in")])
    assert result.returncode == 0, result.stderr
    assert_same_values(read_output(tmp_path / "out", DTYPES[dtype_name], values.shape), values.to(DTYPES[dtype_name]))


# ---- sanitizers: the real kernels are clean, each broken variant is caught ----

# Tiny shapes: TSan runs 256 instrumented threads per block. K = 20 is three K tiles, so both
# shared buffers are written and reread; N = 130 is two blocks.
SANITIZER_CASES = [("linear", (5, 130, 20)), ("backward_input", (6, 20, 9)), ("backward_weight", (20, 6, 9)),
                   ("backward_bias", (20, 40, 1))]


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
@pytest.mark.parametrize("op,shape", SANITIZER_CASES, ids=[case[0] for case in SANITIZER_CASES])
def test_real_kernels_are_clean_under_thread_sanitizer(tmp_path, op, shape, dtype_name):
    result, output, expected = run_case(tmp_path, op, dtype_name, shape, variant="tsan")
    assert "ThreadSanitizer" not in result.stderr, result.stderr
    assert_matches(result, output, expected)


@pytest.mark.parametrize("layout", ["contiguous", "misaligned", "transposed"])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_real_kernels_are_clean_under_address_sanitizer(tmp_path, op, dtype_name, layout):
    result, output, expected = run_case(tmp_path, op, dtype_name, (37, 61, 45), layout, variant="asan")
    assert "AddressSanitizer" not in result.stderr, result.stderr
    assert_matches(result, output, expected)


def test_missing_barrier_is_reported_as_a_data_race(tmp_path):
    result, _, _ = run_case(tmp_path, "linear", "float32", (5, 9, 20), variant="break_sync")
    assert result.returncode == TSAN_RACE_EXIT
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    assert "gemm.cuh" in result.stderr  # the race is located in the kernel


def test_out_of_bounds_tile_load_is_reported(tmp_path):
    result, _, _ = run_case(tmp_path, "linear", "float32", (37, 61, 45), variant="break_bounds")
    assert result.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in result.stderr
    assert "fetch_run" in result.stderr


def test_barrier_not_reached_by_every_thread_times_out_with_an_error(tmp_path):
    env = {"EMU_BARRIER_TIMEOUT_S": "1", "PATH": "/usr/bin:/bin"}
    result, _, _ = run_case(tmp_path, "linear", "float32", (5, 9, 20), variant="break_barrier", env=env)
    assert result.returncode == BARRIER_TIMEOUT_EXIT
    assert "__syncthreads() timed out after 1 s in block (0,0,0): 255 of 256 threads arrived" in result.stderr


# ---- precision: random inputs and long reductions, so the accumulator's type shows ----
#
# The tests above use exact inputs: they pin the indexing, not the arithmetic. Here the inputs
# are random, the reductions thousands long, and each result is held to the error that its
# accumulator allows. A float64 kernel that accumulated in float32, or a 16-bit kernel that
# accumulated in its own type, fails by orders of magnitude.

REDUCTION = 3001  # long, odd, and not a multiple of the K tile: the last tile is partial
# Each op's (M, N, K) with the reduced dimension long: linear and linear_relu reduce K,
# backward_input N, backward_weight and backward_bias M.
LONG_REDUCTIONS = {"linear": (3, 5, REDUCTION), "linear_relu": (3, 5, REDUCTION),
                   "backward_input": (3, REDUCTION, 5), "backward_weight": (REDUCTION, 3, 5),
                   "backward_bias": (REDUCTION, 5, 1)}
# The probabilistic bound on a sum of n rounded terms (Higham and Mary, SIAM J. Sci. Comput.
# 41(5), 2019): |error| <= LAMBDA * sqrt(n) * u * sum(|a_i b_i|) with probability at least
# 1 - 2n exp(-LAMBDA^2 / 2); for LAMBDA = 8 and n = 3001 that is 1 - 8e-11. The worst-case
# bound n * u is 55 times looser here, loose enough to let a float16 accumulator pass.
LAMBDA = 8.0


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def accumulator_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32  # the README's promise


def random_values(*shape, dtype, generator):
    """Normal values, representable in dtype, whose pairwise products are exact in float64
    (float64 values are cut to 26 significant bits), so the reference below is exact."""
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    if dtype == torch.float64:
        return torch.round(values * 2**24) / 2**24
    return values.to(dtype).double()


def random_case(op, dtype, seed=0):
    """The op's random inputs, and the product A·B (+ bias) it computes, as (A, B, bias):
    every result is a dot product of a row of A with a column of B."""
    M, N, K = LONG_REDUCTIONS[op]
    g = torch.Generator().manual_seed(seed)
    if op in ("linear", "linear_relu"):
        x, w, b = (random_values(*s, dtype=dtype, generator=g) for s in ((M, K), (N, K), (N,)))
        return {"x": x, "w": w, "bias": b}, (x, w.t(), b)
    dy = random_values(M, N, dtype=dtype, generator=g)
    if op == "backward_input":
        w = random_values(N, K, dtype=dtype, generator=g)
        return {"dy": dy, "w": w}, (dy, w, None)
    if op == "backward_weight":
        x = random_values(M, K, dtype=dtype, generator=g)
        return {"dy": dy, "x": x}, (dy.t(), x, None)
    return {"dy": dy}, (torch.ones(1, M, dtype=torch.float64), dy, None)


def exact_product(a, b, bias):
    """A·B + bias rounded once to float64 (math.fsum of exact products), and the magnitude
    sum |a_i b_i| + |bias| that rounding errors scale with."""
    rows, cols = a.shape[0], b.shape[1]
    exact = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            terms = (a[i] * b[:, j]).tolist() + ([bias[j].item()] if bias is not None else [])
            exact[i, j] = math.fsum(terms)
    magnitude = a.abs() @ b.abs() + (bias.abs() if bias is not None else 0)
    return exact, magnitude


def run_random_case(tmp_path, op, dtype_name, seed=0):
    dtype = DTYPES[dtype_name]
    inputs, product = random_case(op, dtype, seed)
    specs = [write_operand(tmp_path, name, values, "contiguous", dtype) for name, values in inputs.items()]
    result = run_driver("plain", [op, dtype_name, str(tmp_path / "out"), *specs])
    assert result.returncode == 0, result.stderr
    exact, magnitude = exact_product(*product)
    if op == "backward_bias":
        exact, magnitude = exact.flatten(), magnitude.flatten()
    if op == "linear_relu":
        exact, magnitude = exact.clamp(min=0), magnitude  # ReLU is exact
    return read_output(tmp_path / "out", dtype, exact.shape), exact, magnitude, product


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_long_reductions_stay_within_the_accumulators_error_bound(tmp_path, op, dtype_name):
    dtype = DTYPES[dtype_name]
    output, exact, magnitude, (a, _, bias) = run_random_case(tmp_path, op, dtype_name)
    terms = a.shape[1] + (bias is not None)
    factor = LAMBDA * math.sqrt(terms) * unit_roundoff(accumulator_dtype(dtype))
    stored = unit_roundoff(dtype) * exact.abs()  # the one rounding to the output dtype
    error = (output.double() - exact).abs()
    assert (error <= factor * magnitude + stored).all(), (
        f"worst error {((error - stored) / magnitude).max():.3g} x sum|ab|, allowed {factor:.3g}")


def float32_sequential_sum(a, b, bias):
    """A·B + bias as the GEMM kernel adds it: a float32 accumulator from 0, k = 0, 1, ... in
    order, then the bias. With 16-bit inputs every product is exact in float32, so fused or
    separate multiply-adds give these same bits."""
    products = a.float().unsqueeze(2) * b.float().unsqueeze(0)  # rows x k x cols, exact
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k in range(products.shape[1]):
        total = total + products[:, k]
    return total + bias.float() if bias is not None else total


def float32_lane_sum(dy, lanes):
    """The sum over rows as sum_rows.cuh adds it: lane l sums rows l, l + lanes, ... in
    float32, then the lane sums are added in lane order."""
    total = torch.zeros(dy.shape[1], dtype=torch.float32)
    for lane in range(lanes):
        lane_sum = torch.zeros(dy.shape[1], dtype=torch.float32)
        for row in dy[lane::lanes].float():
            lane_sum = lane_sum + row
        total = total + lane_sum
    return total


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_16_bit_results_are_float32_sums_rounded_once_to_nearest_even(tmp_path, op, dtype_name):
    output, _, _, (a, b, bias) = run_random_case(tmp_path, op, dtype_name)
    if op == "backward_bias":
        expected = float32_lane_sum(b, kernel_constants()["sum_row_lanes"])
    else:
        expected = float32_sequential_sum(a, b, bias)
        if op == "linear_relu":
            expected = torch.relu(expected)
    assert torch.equal(output, expected.to(DTYPES[dtype_name]))  # .to rounds to nearest even


def kernel_constants():
    """The kernels' tile sizes, as the compiled driver reports them (never copied here)."""
    result = run_driver("plain", ["constants", "float32", "-"])
    assert result.returncode == 0, result.stderr
    return {name: int(value) for name, value in (line.split("=") for line in result.stdout.split())}


def test_the_awkward_shapes_cross_every_tile_edge_of_the_kernels():
    c = kernel_constants()
    ms, ns, ks = (set(dims) for dims in zip(*SHAPES, strict=True))
    for size, dims in ((c["block_m"], ms), (c["block_n"], ns), (c["block_k"], ks)):
        assert {size - 1, size, size + 1} <= dims
    assert REDUCTION % c["block_k"] != 0  # the long reductions end in a partial K tile
