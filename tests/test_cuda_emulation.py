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
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tf32_round

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from build import driver_path  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulation harness needs Linux and g++")

# "tf32": float32 data with TF32 allowed (torch.backends.cuda.matmul.allow_tf32 on the GPU).
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "tf32": torch.float32}
GEMM_OPS = ["linear", "linear_relu", "backward_input", "backward_weight"]
OPS = [*GEMM_OPS, "backward_bias"]
BARRIER_TIMEOUT_EXIT = 86  # emu::kBarrierTimeoutExit in cuda_emu.h
MISUSE_EXIT = 87  # emu::kMisuseExit: an instruction used against its rules
TSAN_RACE_EXIT = 66  # ThreadSanitizer's exit code when it reported something

TENSOR_CORE_DTYPES = ["float16", "bfloat16", "tf32"]  # gemm_tc.cuh; float32 and float64 run gemm.cuh
CHUNK = {"float16": 8, "bfloat16": 8, "tf32": 4}  # elements in the tensor-core kernel's 16-byte copies

# (M, N, K): degenerate, prime, and just off every tile edge: the FMA kernel's block tile
# 128 x 128 x 8, the tensor-core kernel's 128 x 128 x 32 (x 16 for TF32) with 64 x 32 warp
# tiles and 3 stages (96 is exactly the stages, 97 and 130 wrap around them). A test below
# checks these against the sizes the compiled kernels report.
SHAPES = [
    (1, 1, 1),
    (37, 61, 45),
    (128, 128, 8),
    (129, 127, 9),
    (127, 129, 7),
    (1, 130, 17),
    (130, 1, 33),
    (3, 5, 0),
    (65, 33, 31),
    (63, 31, 32),
    (64, 32, 96),
    (17, 9, 97),
    (5, 7, 130),
    (31, 17, 15),
    (33, 9, 16),
]
# Aligned and contiguous: every operand takes the wide-load path (runs of 4 elements) or, on
# the tensor cores, 16-byte cp.async copies. (130, 68, 12) has partial runs at the M and K
# edges, (136, 72, 40) a partial block and a partial K tile; both have row lengths a multiple
# of 8, as 16-byte copies of 16-bit rows need.
WIDE_SHAPES = [(64, 64, 64), (130, 68, 12), (136, 72, 40)]
LAYOUTS = ["contiguous", "transposed", "misaligned", "strided", "padded"]


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
    if layout == "padded":  # contiguous rows, each padded to a multiple of 8 elements plus 8
        row_stride = (cols + 7) // 8 * 8 + 8
        storage = torch.zeros(max(rows * row_stride, 1), dtype=values.dtype)
        torch.as_strided(storage, (rows, cols), (row_stride, 1)).copy_(values)
        return storage, 0, (row_stride, 1)
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


def load_path(dtype_name, wide):
    """What the driver prints for a GEMM whose operands both take (or both miss) the wide path."""
    if dtype_name in TENSOR_CORE_DTYPES:
        return f"tensor_cores chunk_loads a={int(wide)} b={int(wide)}"
    return f"wide_loads a={int(wide)} b={int(wide)}"


# Row lengths are N and K in every op's operands: wide when they are multiples of a run or chunk.
WIDE_CASES = [(dtype_name, shape) for dtype_name in DTYPES for shape in WIDE_SHAPES
              if all(size % CHUNK.get(dtype_name, 4) == 0 for size in shape[1:])]


@pytest.mark.parametrize("dtype_name,shape", WIDE_CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s in WIDE_CASES])
@pytest.mark.parametrize("op", GEMM_OPS)
def test_aligned_operands_take_the_wide_load_path(tmp_path, op, dtype_name, shape):
    result, output, expected = run_case(tmp_path, op, dtype_name, shape)
    assert_matches(result, output, expected)
    assert load_path(dtype_name, wide=True) in result.stdout


@pytest.mark.parametrize("dtype_name", TENSOR_CORE_DTYPES)
@pytest.mark.parametrize("op", GEMM_OPS)
def test_padded_rows_take_16_byte_copies_with_partial_chunks_zero_filled(tmp_path, op, dtype_name):
    # 45 and 61 are not multiples of 8: each row's last copy reads only what exists (cp.async's
    # src-size) and zero-fills the rest, which must not reach the result.
    result, output, expected = run_case(tmp_path, op, dtype_name, (37, 61, 45), "padded")
    assert_matches(result, output, expected)
    assert load_path(dtype_name, wide=True) in result.stdout


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["misaligned", "strided"])
def test_misaligned_or_strided_operands_fall_back_to_scalar_loads(tmp_path, layout, dtype_name):
    result, output, expected = run_case(tmp_path, "linear", dtype_name, (64, 64, 64), layout)
    assert_matches(result, output, expected)
    assert load_path(dtype_name, wide=False) in result.stdout


# ---- split-K: products whose output tiles do not fill the GPU (split_k.cuh) ----

# (shape, splits on an H100's 132 SMs on the FMA kernel, on the tensor cores): the MLP's first
# layer, an awkward one, a long thin one. The FMA kernel's splits go 64 deep, the tensor cores' 256.
SPLIT_SHAPES = [((128, 256, 784), (9, 3)), ((37, 61, 1000), (11, 3)), ((5, 7, 2049), (13, 8))]


@pytest.mark.parametrize("shape,splits", SPLIT_SHAPES, ids=[f"{'x'.join(map(str, s))}" for s, _ in SPLIT_SHAPES])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", GEMM_OPS)
def test_small_outputs_split_k_and_stay_exact(tmp_path, op, dtype_name, shape, splits):
    M, N, K = shape
    shape = {"backward_input": (M, K, N), "backward_weight": (K, M, N)}.get(op, shape)  # reduce over the long one
    result, output, expected = run_case(tmp_path, op, dtype_name, shape)
    assert_matches(result, output, expected)
    assert split_k_of(result.stdout)[0] == splits[dtype_name in TENSOR_CORE_DTYPES]


@pytest.mark.parametrize("sm_count", [1, 8, 132])
@pytest.mark.parametrize("dtype_name,min_depth", [("float32", 64), ("bfloat16", 256)])
def test_split_k_rule(tmp_path, sm_count, dtype_name, min_depth):
    # Split exactly when the output tiles leave at least half the SMs idle and K holds two splits
    # of the kernel's least depth; every split a multiple of 32 and at least that deep; at most 16;
    # K covered exactly.
    env = {"EMU_SM_COUNT": str(sm_count), "PATH": "/usr/bin:/bin"}
    for M, N, K in [(128, 256, 784), (1, 1, 127), (1, 1, 128), (1, 1, 511), (1, 1, 512), (300, 300, 1024),
                    (5, 3, 2600)]:
        result, output, expected = run_case(tmp_path, "linear", dtype_name, (M, N, K), env=env)
        assert_matches(result, output, expected)
        splits, depth = split_k_of(result.stdout)
        tiles = -(-M // 128) * -(-N // 128)
        assert (splits > 1) == (sm_count // tiles >= 2 and K >= 2 * min_depth), (M, N, K)
        if splits > 1:
            assert depth >= min_depth and depth % 32 == 0 and splits <= min(16, sm_count // tiles)
            assert (splits - 1) * depth < K <= splits * depth


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

# Both kernels' tile edges: M 129 and N 127 cross the block tile, K 9 the FMA kernel's K tile;
# (65, 33, 97) crosses the tensor-core warp tiles and wraps around its 3 stages; (17, 9, 600)
# is split in two along K.
SANITIZER_SHAPES = [(129, 127, 9), (65, 33, 97), (17, 9, 600)]


@pytest.mark.parametrize("shape", SANITIZER_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_real_kernels_are_clean_under_thread_sanitizer(tmp_path, op, dtype_name, shape):
    result, output, expected = run_case(tmp_path, op, dtype_name, shape, variant="tsan")
    assert "ThreadSanitizer" not in result.stderr, result.stderr
    assert_matches(result, output, expected)


@pytest.mark.parametrize("layout", ["contiguous", "misaligned", "transposed", "padded"])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_real_kernels_are_clean_under_address_sanitizer(tmp_path, op, dtype_name, layout):
    result, output, expected = run_case(tmp_path, op, dtype_name, (37, 61, 45), layout, variant="asan")
    assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr
    assert_matches(result, output, expected)


@pytest.mark.parametrize("dtype_name,shape", WIDE_CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s in WIDE_CASES])
@pytest.mark.parametrize("op", GEMM_OPS)
def test_wide_load_paths_are_clean_under_address_sanitizer(tmp_path, op, dtype_name, shape):
    result, output, expected = run_case(tmp_path, op, dtype_name, shape, variant="asan")
    assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, result.stderr
    assert_matches(result, output, expected)
    assert load_path(dtype_name, wide=True) in result.stdout


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


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_wide_load_through_a_misaligned_pointer_is_reported(tmp_path, dtype_name):
    # The broken variant takes the wide path without checking the pointer's alignment.
    result, _, _ = run_case(tmp_path, "linear", dtype_name, (64, 64, 64), "misaligned", variant="break_alignment")
    assert result.returncode != 0
    if dtype_name in TENSOR_CORE_DTYPES:  # cp.async's rule, checked by the emulation
        assert result.returncode == MISUSE_EXIT
        assert "cp.async: a source address is not 16-byte aligned" in result.stderr
    else:  # UndefinedBehaviorSanitizer's alignment check
        assert "misaligned address" in result.stderr and "gemm.cuh" in result.stderr  # the wide load in fetch_run


# ---- the tensor-core kernel's broken variants (EMU_BREAK_* in gemm_tc.cuh) are each caught ----

@pytest.mark.parametrize("variant", ["break_no_wait", "break_wait_group"])
def test_missing_or_too_weak_cp_async_wait_reads_poisoned_shared_memory(tmp_path, variant):
    # No wait, or a wait for one group fewer, multiplies a stage whose copies have not landed: in
    # the emulation they land as late as allowed, so the kernel reads shared memory's NaN poison.
    result, output, expected = run_case(tmp_path, "linear", "float16", (64, 64, 96), variant=variant)
    assert result.returncode == 0, result.stderr
    assert output.isnan().any() and not expected.isnan().any()


def test_wrong_fragment_register_is_caught(tmp_path):
    result, output, expected = run_case(tmp_path, "linear", "bfloat16", (37, 61, 45), variant="break_fragment")
    assert result.returncode == 0, result.stderr
    assert not torch.equal(output, expected)


def test_missing_barrier_between_pipeline_stages_is_reported_as_a_data_race(tmp_path):
    result, _, _ = run_case(tmp_path, "linear", "float16", (64, 64, 130), variant="break_stage_barrier")
    assert result.returncode == TSAN_RACE_EXIT
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    assert "gemm_tc.cuh" in result.stderr


# ---- the emulated warp-level instructions, each against a plain reference ----

def run_warp_test(tmp_path, op, dtype_name="-", inputs=()):
    files = []
    for index, values in enumerate(inputs):
        path = tmp_path / f"in{index}"
        values.contiguous().view(torch.uint8).numpy().tofile(path)
        files.append(str(path))
    result = run_driver("tsan", [op, dtype_name, str(tmp_path / "out"), *files])
    assert result.returncode == 0 and "ThreadSanitizer" not in result.stderr, result.stderr
    return (tmp_path / "out").read_bytes()


def run_warp_mma(tmp_path, dtype_name, a, b, c):
    dtype = DTYPES[dtype_name]
    out = run_warp_test(tmp_path, "warp_mma", dtype_name, [a.to(dtype), b.to(dtype), c.float()])
    return torch.frombuffer(bytearray(out), dtype=torch.float32).reshape(16, 8)


@pytest.mark.parametrize("dtype_name", TENSOR_CORE_DTYPES)
def test_mma_computes_a_times_b_plus_c_with_the_isa_fragment_layouts(tmp_path, dtype_name):
    k = 8 if dtype_name == "tf32" else 16  # m16n8k8 for TF32, m16n8k16 for 16-bit
    g = torch.Generator().manual_seed(1)
    a, b, c = quarters(16, k, generator=g), quarters(k, 8, generator=g), quarters(16, 8, generator=g)
    assert torch.equal(run_warp_mma(tmp_path, dtype_name, a, b, c), (a @ b + c).float())


def test_tf32_inputs_are_rounded_to_nearest_ties_away(tmp_path):
    # Values with low mantissa bits set, ties among them: the product must use the rounded inputs.
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 8, generator=g), torch.randn(8, 8, generator=g)
    a[0, :4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-12])  # ties, and one below
    c = torch.zeros(16, 8)
    expected = torch.zeros(16, 8)
    for k in range(8):  # in k order, each product exact in float32
        expected = expected + tf32_round(a[:, k:k + 1]) * tf32_round(b[k:k + 1, :])
    assert torch.equal(tf32_round(a[0, :4]), torch.tensor([1 + 2**-10, 1 + 4 * 2**-11, -(1 + 2**-10), 1.0]))
    assert torch.equal(run_warp_mma(tmp_path, "tf32", a, b, c), expected)


def halves(words):
    """Each 32-bit register as (low 16 bits, high 16 bits): the element order of a .b16 pair."""
    return torch.stack([words & 0xFFFF, words >> 16], dim=-1)


@pytest.mark.parametrize("transposed", [False, True], ids=["ldmatrix", "ldmatrix.trans"])
def test_ldmatrix_x4_deals_rows_out_as_the_isa_says(tmp_path, transposed):
    matrices = torch.arange(256, dtype=torch.int32).to(torch.int16).reshape(4, 8, 8)  # distinct values
    out = run_warp_test(tmp_path, "warp_ldmatrix_trans" if transposed else "warp_ldmatrix", inputs=[matrices])
    registers = halves(torch.frombuffer(bytearray(out), dtype=torch.int32).reshape(32, 4).long() & 0xFFFFFFFF)
    for lane in range(32):
        for m in range(4):
            first, fixed = 2 * (lane % 4), lane // 4
            source = matrices[m].t() if transposed else matrices[m]  # .trans: of column lane / 4
            assert registers[lane, m].tolist() == source[fixed, first:first + 2].tolist(), (lane, m)


def test_cp_async_groups_land_at_their_wait_with_the_rest_zero_filled(tmp_path):
    g = torch.Generator().manual_seed(2)
    source = torch.randint(1, 255, (3, 32, 16), generator=g, dtype=torch.uint8)
    out = run_warp_test(tmp_path, "warp_cp_async", inputs=[source])
    seen = torch.frombuffer(bytearray(out), dtype=torch.uint8).reshape(3, 32, 3, 16)  # moment, lane, group, byte
    poison = torch.full((16,), 0xFF, dtype=torch.uint8)
    for lane in range(32):
        for group in range(3):
            n = (lane + 5 * group) % 17
            landed = torch.cat([source[group, lane, :n], torch.zeros(16 - n, dtype=torch.uint8)])
            # the emulation lands a group only at the wait that covers it: as late as the rules allow
            assert torch.equal(seen[0, lane, group], poison)
            assert torch.equal(seen[1, lane, group], landed if group < 2 else poison)
            assert torch.equal(seen[2, lane, group], landed)


def test_lanes_diverging_at_a_warp_instruction_is_an_error(tmp_path):
    result = run_driver("plain", ["warp_diverge", "-", str(tmp_path / "out")])
    assert result.returncode == MISUSE_EXIT
    assert "diverged" in result.stderr and "must be executed by every lane of the warp together" in result.stderr


def test_a_lane_missing_from_a_warp_instruction_times_out_with_an_error(tmp_path):
    env = {"EMU_BARRIER_TIMEOUT_S": "1", "PATH": "/usr/bin:/bin"}
    result = run_driver("plain", ["warp_skip", "-", str(tmp_path / "out")], env=env)
    assert result.returncode == BARRIER_TIMEOUT_EXIT
    assert "shfl.sync.bfly timed out after 1" in result.stderr and "31 of 32 lanes arrived" in result.stderr


def test_warp_shuffles_match_their_definitions(tmp_path):
    out = torch.frombuffer(bytearray(run_warp_test(tmp_path, "warp_shuffle")), dtype=torch.int32).reshape(32, 4)
    for lane in range(32):
        down = lane + 3 if lane + 3 < 32 else lane  # past the warp's end a lane keeps its own value
        assert out[lane].tolist() == [1007, 1000 + (lane ^ 5), 1000 + down, 1000 + (lane // 8) * 8 + 3]


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


TF32_UNIT_ROUNDOFF = 2.0**-11  # 10 stored mantissa bits


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
    return read_output(tmp_path / "out", dtype, exact.shape), exact, magnitude, product, result.stdout


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_long_reductions_stay_within_the_accumulators_error_bound(tmp_path, op, dtype_name):
    dtype = DTYPES[dtype_name]
    output, exact, magnitude, (a, _, bias), _ = run_random_case(tmp_path, op, dtype_name)
    terms = a.shape[1] + (bias is not None)
    factor = LAMBDA * math.sqrt(terms) * unit_roundoff(accumulator_dtype(dtype))
    if dtype_name == "tf32" and op != "backward_bias":  # inputs rounded to TF32: each product off by <= 2u + u^2
        factor += LAMBDA * math.sqrt(terms) * (2 * TF32_UNIT_ROUNDOFF + TF32_UNIT_ROUNDOFF**2)
    stored = unit_roundoff(dtype) * exact.abs()  # the one rounding to the output dtype
    error = (output.double() - exact).abs()
    assert (error <= factor * magnitude + stored).all(), (
        f"worst error {((error - stored) / magnitude).max():.3g} x sum|ab|, allowed {factor:.3g}")


def float32_sequential_sum(a, b, bias, k_split=0):
    """A·B + bias as the GEMM kernels add it: a float32 accumulator from 0, k = 0, 1, ... in
    order, then the bias. With 16-bit (and TF32) inputs every product is exact in float32, so
    fused or separate multiply-adds give these same bits. Split K (k_split > 0): each split's
    sum so, then the splits' sums added in order from 0, then the bias (split_k.cuh)."""
    products = a.float().unsqueeze(2) * b.float().unsqueeze(0)  # rows x k x cols, exact
    depth = products.shape[1]
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for begin in range(0, depth, k_split or max(depth, 1)):
        partial = torch.zeros_like(total)
        for k in range(begin, min(depth, begin + (k_split or depth))):
            partial = partial + products[:, k]
        total = total + partial if k_split else partial
    return total + bias.float() if bias is not None else total


def split_k_of(stdout):
    """(splits, K per split) as the driver reports for its GEMM."""
    match = re.search(r"split_k splits=(\d+) k_split=(\d+)", stdout)
    return int(match[1]), int(match[2])


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


@pytest.mark.parametrize("dtype_name", TENSOR_CORE_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_tensor_core_results_are_float32_sums_rounded_once_to_nearest_even(tmp_path, op, dtype_name):
    # In the emulation's mma order (k by k, see ptx_emu.h); TF32 inputs rounded first, as cvt.rna does.
    output, _, _, (a, b, bias), stdout = run_random_case(tmp_path, op, dtype_name)
    if op == "backward_bias":
        expected = float32_lane_sum(b, kernel_constants()["sum_row_lanes"])
    else:
        splits, k_split = split_k_of(stdout)
        assert splits > 1  # a 3 x 5 output reduced over 3001: split-K's case, its order modelled above
        rounded = tf32_round if dtype_name == "tf32" else (lambda x: x)
        expected = float32_sequential_sum(rounded(a), rounded(b), bias, k_split)
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
    edges = [(c["block_m"], ms), (c["block_n"], ns), (c["block_k"], ks), (c["tc_block_m"], ms), (c["tc_block_n"], ns),
             (c["tc_block_k"], ks), (c["tc_block_k_tf32"], ks), (c["tc_warp_m"], ms), (c["tc_warp_n"], ns)]
    for size, dims in edges:
        assert {size - 1, size, size + 1} <= dims
    stages_k = c["tc_stages"] * c["tc_block_k"]
    assert stages_k in ks and any(k > stages_k + c["tc_block_k"] for k in ks)  # the pipeline wraps around
    for shape in SANITIZER_SHAPES:  # and the sanitizers' shapes cross the blocks, K tiles and warp tiles
        assert shape[0] > c["block_m"] or shape[0] % c["tc_warp_m"] != 0
    assert all(REDUCTION % c[name] for name in ("block_k", "tc_block_k", "tc_block_k_tf32"))  # a partial last K tile
