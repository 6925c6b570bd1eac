"""The CUDA ops' host code (ext/csrc/cuda/linear_host.h: the code linear_cuda.cu runs) on the CPU,
through tests/cuda_emu/host_ops.cpp: the same checks, allocation, empty-output return, dtype
dispatch, bias handling, launch-size check and autocast rule, with the kernels emulated.

The ops are those of a library of their own, torch.ops.ext_cuda_emu, on CPU tensors. Inputs are
multiples of 1/4 (tests/test_cuda_emulation.py): results are exact, so compared bit for bit.
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tf32_round

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from build import host_ops_library  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulation harness needs Linux and g++")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    host_ops_library()
    return torch.ops.ext_cuda_emu


def quarters(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g).double() / 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_reaches_its_own_kernel(ops, dtype):
    x, w, b, dy = (quarters(*shape, dtype=dtype, seed=seed) for seed, shape in enumerate([(5, 9), (7, 9), (7,), (5, 7)]))
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    results = {
        "linear": (ops.linear(x, w, b), F.linear(x64, w64, b64)),
        "linear_relu": (ops.linear_relu(x, w, b), F.linear(x64, w64, b64).relu()),
        "backward_input": (ops.linear_backward_input(dy, w), dy64 @ w64),
        "backward_weight": (ops.linear_backward_weight(dy, x), dy64.t() @ x64),
        "backward_bias": (ops.linear_backward_bias(dy), dy64.sum(0)),
    }
    for name, (ours, exact) in results.items():
        assert ours.dtype == dtype, name
        torch.testing.assert_close(ours, exact.to(dtype), rtol=0, atol=0, msg=name)


def test_a_strided_bias_is_read_as_its_values(ops):
    x, w = quarters(4, 6, dtype=torch.float32), quarters(5, 6, dtype=torch.float32, seed=1)
    wide = quarters(10, dtype=torch.float32, seed=2)
    bias = wide[::2]  # every other element: the kernel reads a dense bias, the host code makes one
    assert not bias.is_contiguous()
    torch.testing.assert_close(ops.linear(x, w, bias), F.linear(x, w, bias.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("M,N,K", [(0, 5, 3), (4, 0, 3), (0, 0, 0)])
def test_empty_outputs_return_before_any_launch(ops, M, N, K):
    x, w, dy = torch.ones(M, K), torch.ones(N, K), torch.ones(M, N)
    assert ops.linear(x, w, torch.ones(N)).shape == (M, N)
    assert torch.equal(ops.linear_backward_input(dy, w), torch.zeros(M, K))
    # a sum over no rows: zeros, not whatever the freshly allocated output held
    assert torch.equal(ops.linear_backward_weight(dy, x), torch.zeros(N, K))
    assert torch.equal(ops.linear_backward_bias(dy), torch.zeros(N))


def test_zero_depth_gives_the_bias_alone(ops):
    bias = quarters(6, dtype=torch.float32)
    torch.testing.assert_close(ops.linear(torch.ones(3, 0), torch.ones(6, 0), bias), bias.expand(3, 6), rtol=0, atol=0)
    assert torch.equal(ops.linear_backward_input(torch.ones(3, 0), torch.ones(0, 4)), torch.zeros(3, 4))


def test_an_output_wider_than_the_grid_is_refused_in_one_line(ops):
    columns = 65535 * 128 + 1  # gemm.cuh kMaxGemmN + 1: weight (columns x 0) holds no data
    with pytest.raises(RuntimeError, match=r"an output with 8388481 columns exceeds the grid limit of 8388480"):
        ops.linear(torch.ones(1, 0), torch.ones(columns, 0), None)


@pytest.mark.parametrize("call, message", [
    (lambda ops: ops.linear(torch.ones(2, 3, dtype=torch.int32), torch.ones(4, 3, dtype=torch.int32), None),
     r"ext.linear: dtype Int is not supported; use float32, float64, float16 or bfloat16"),
    (lambda ops: ops.linear(torch.ones(2, 3), torch.ones(4, 5), None), r"ext.linear: input has 3 features but weight expects 5"),
    (lambda ops: ops.linear(torch.ones(2, 3), torch.ones(4, 3).double(), None), r"ext.linear: input is Float but weight is Double"),
    (lambda ops: ops.linear_backward_bias(torch.ones(2, 3, dtype=torch.int64)),
     r"ext.linear_backward_bias: dtype Long is not supported; use float32, float64, float16 or bfloat16"),
    (lambda ops: ops.linear_backward_input(torch.ones(2, 3), torch.ones(4, 5)), r"grad_output shape \[2, 3\] does not match weight"),
])
def test_bad_arguments_get_the_cuda_kernels_messages(ops, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def test_the_guard_is_set_to_the_inputs_device(ops):
    ops.linear(torch.ones(2, 3), torch.ones(4, 3), None)
    assert ops.last_guarded_device() == "cpu"


@pytest.mark.parametrize("relu", [False, True])
def test_autocast_runs_the_op_in_the_autocast_dtype_and_leaves_float64_alone(ops, relu):
    op = ops.linear_relu if relu else ops.linear
    x, w, b = quarters(3, 8, dtype=torch.float32), quarters(5, 8, dtype=torch.float32, seed=1), quarters(5, dtype=torch.float32, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = op(x, w, b)
        y64 = op(x.double(), w.double(), b.double())
    assert y.dtype == torch.bfloat16  # as nn.Linear on a GPU: unlike ext's CPU kernels, which run float32
    expected = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(y, (expected.relu() if relu else expected).bfloat16(), rtol=0, atol=0)
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64, expected.relu() if relu else expected, rtol=0, atol=0)  # quarters: exact


def tf32_products_summed(x, w):
    """x · wᵀ from inputs rounded to TF32, in float32, k by k."""
    xr, wr = tf32_round(x), tf32_round(w)
    total = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        total = total + xr[:, k:k + 1] * wr[:, k].unsqueeze(0)
    return total


def test_float32_follows_torch_allow_tf32(ops, allow_tf32):
    # Random values have bits below TF32's 10-bit mantissa: with TF32 allowed the product must
    # be that of the rounded inputs (the tensor-core kernel), and exact float32 again without.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 40, generator=g), torch.randn(17, 40, generator=g)
    assert torch.equal(ops.linear(x, w, None), tf32_products_summed(x, w))
    torch.backends.cuda.matmul.allow_tf32 = False
    full = ops.linear(x, w, None)
    torch.testing.assert_close(full, (x.double() @ w.double().t()).float(), rtol=1e-6, atol=1e-5)
    assert (full - tf32_products_summed(x, w)).abs().max() > 1e-4  # the two paths really differ here


def test_float64_never_takes_tf32(ops, allow_tf32):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 20, generator=g, dtype=torch.float64), torch.randn(7, 20, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ops.linear(x, w, None), x @ w.t(), rtol=1e-14, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_runs_through_the_host_code_exactly(ops, dtype):
    # A 3 x 5 output reduced over 1500: split-K (split_k.cuh), its partials allocated by the host code.
    x, w, b, dy = (quarters(*shape, dtype=dtype, seed=seed) for seed, shape in
                   enumerate([(3, 1500), (5, 1500), (5,), (3, 5)]))
    x64, w64, b64 = (t.double() for t in (x, w, b))
    torch.testing.assert_close(ops.linear_relu(x, w, b), F.linear(x64, w64, b64).relu().to(dtype), rtol=0, atol=0)
    dy_long = quarters(1500, 5, dtype=dtype, seed=9)  # dW reduces over the batch: 1500 rows
    torch.testing.assert_close(ops.linear_backward_weight(dy_long, w.t().contiguous()),
                               (dy_long.double().t() @ w64.t()).to(dtype), rtol=0, atol=0)
