"""The real CUDA kernels (ext/csrc/cuda/*.cuh), run on the CPU through the emulation of
the CUDA execution model in tests/cuda_emu/cuda_emu.h and compared with PyTorch.

Also under ThreadSanitizer and AddressSanitizer: the real kernels must be clean, and the
deliberately broken variants (EMU_BREAK_* switches in gemm.cuh) must each be caught.

Inputs are multiples of 1/4 in [-2, 2]: every product and sum is exact in float32, so each
result must equal PyTorch's float64 result rounded to the dtype, bit for bit. That checks
the indexing exactly, and the rounding of float16/bfloat16 stores too.
"""
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

# (M, N, K): degenerate, prime, and just off every tile edge (block tile 128 x 128 x 8).
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
