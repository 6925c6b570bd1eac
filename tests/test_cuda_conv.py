"""The CUDA convolution (ext/csrc/cuda/conv.cuh and conv_host.h) on the CPU, through the emulation of
the CUDA execution model (tests/cuda_emu), against PyTorch's convolution and its autograd.

Two ways in:
- the driver (tests/cuda_emu/driver.cpp): the kernels' launches as they are, plain and under
  ThreadSanitizer and AddressSanitizer (each tensor in a file of exactly its size), and the
  deliberately broken variants (EMU_BREAK_*), each caught;
- the ops' host code, registered as torch.ops.ext_cuda_emu (tests/cuda_emu/host_ops.cpp): checks,
  layouts, dtype dispatch, autocast, and PyTorch's own OpInfo samples for F.conv2d.

Inputs are multiples of 1/4 (as in test_cuda_emulation.py): every product and sum is exact in
float32, so each result must equal PyTorch's float64 result rounded once to the dtype, bit for bit.
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_cuda_emulation import DTYPES, TSAN_RACE_EXIT, read_output, run_driver

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
from build import host_ops_library  # noqa: E402

import ext.conv  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the emulation harness needs Linux and g++")

CONV_DTYPES = ["float32", "float64", "float16", "bfloat16"]
CONV_OPS = ["conv_forward", "conv_backward_input", "conv_backward_weight", "conv_backward_bias"]


def quarters(*shape, generator):
    return torch.randint(-8, 9, shape, generator=generator).double() / 4


class Case:
    """A convolution: N, C, H, W, K, R, S, stride, padding (top, bottom, left, right), dilation.
    Its three GEMMs (conv.cuh): forward K x N·OH·OW over C·R·S, dX C x N·H·W over R·S·K,
    dW K x C·R·S over N·OH·OW."""

    def __init__(self, n, c, h, w, k, r, s, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1)):
        self.input_shape, self.weight_shape = (n, c, h, w), (k, c, r, s)
        self.stride, self.padding, self.dilation = stride, padding, dilation

    def reference(self, x, w, b, dy=None):
        """Y, and with dy: dX, dW and db, all exact in float64 (asymmetric padding through F.pad)."""
        top, bottom, left, right = self.padding
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = F.conv2d(F.pad(x, (left, right, top, bottom)), w, b, self.stride, 0, self.dilation)
        if dy is None:
            return y.detach()
        y.backward(dy)
        return y.detach(), x.grad, w.grad, dy.sum((0, 2, 3))

    def output_shape(self):
        n, _, h, w = self.input_shape
        k, _, r, s = self.weight_shape
        top, bottom, left, right = self.padding
        oh = (h + top + bottom - self.dilation[0] * (r - 1) - 1) // self.stride[0] + 1
        ow = (w + left + right - self.dilation[1] * (s - 1) - 1) // self.stride[1] + 1
        return n, k, oh, ow

    def driver_shape(self):
        n, c, h, w = self.input_shape
        k, _, r, s = self.weight_shape
        _, _, oh, ow = self.output_shape()
        return ",".join(map(str, [n, c, h, w, k, r, s, *self.stride, *self.dilation, self.padding[0],
                                  self.padding[2], oh, ow]))


# Each crosses tile edges of conv.cuh's GEMMs (128 x 128 blocks, 8-deep K tiles, runs of 4).
CASES = {
    "3x3_padded": Case(2, 3, 7, 6, 4, 3, 3, padding=(1, 1, 1, 1)),
    # forward 129 x 132 over 27; dW 129 x 27 over 132; dX 3 x 132 over 1161
    "past_the_block_tile": Case(1, 3, 11, 12, 129, 3, 3, padding=(1, 1, 1, 1)),
    # dX 130 x 50 over 7, forward 7 x 50 over 130
    "pointwise_130_channels": Case(2, 130, 5, 5, 7, 1, 1),
    "strided_dilated": Case(3, 5, 12, 11, 9, 5, 3, stride=(3, 2), padding=(2, 2, 1, 1), dilation=(2, 1)),
    "kernel_larger_than_the_input": Case(2, 2, 3, 2, 3, 5, 4, padding=(2, 2, 2, 2)),
    "stride_past_the_kernel": Case(2, 4, 9, 9, 5, 2, 2, stride=(3, 3)),  # dX has pixels no output reads
    "asymmetric_same_padding": Case(2, 3, 6, 7, 4, 2, 2, padding=(0, 1, 0, 1)),  # padding="same", even kernel
    "one_pixel_images": Case(5, 6, 1, 1, 3, 1, 1),  # dW's runs of dY cross an image at every pixel
    "split_k_weight_gradient": Case(4, 8, 16, 16, 8, 3, 3, padding=(1, 1, 1, 1)),  # dW 8 x 72 over 1024
}


def write(tmp_path, name, values, dtype):
    path = tmp_path / name
    values.to(dtype).contiguous().view(torch.uint8).numpy().tofile(path)
    return str(path)


def run_conv_ops(tmp_path, case, dtype_name, variant="plain", ops=CONV_OPS, seed=0):
    """Runs the ops through a driver build; yields (op, driver result, output or None, exact reference)."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seed)
    x, w = quarters(*case.input_shape, generator=g), quarters(*case.weight_shape, generator=g)
    b = quarters(case.weight_shape[0], generator=g)
    dy = quarters(*case.output_shape(), generator=g)
    y, dx, dw, db = case.reference(x, w, b, dy)
    files = {name: write(tmp_path, name, t, dtype) for name, t in (("x", x), ("w", w), ("b", b), ("dy", dy))}
    plan = {"conv_forward": (["x", "w", "b"], y), "conv_backward_input": (["dy", "w"], dx),
            "conv_backward_weight": (["dy", "x"], dw), "conv_backward_bias": (["dy"], db)}
    for op in ops:
        names, expected = plan[op]
        out = tmp_path / f"{op}.out"
        result = run_driver(variant, [op, dtype_name, str(out), case.driver_shape(), *(files[n] for n in names)])
        output = read_output(out, dtype, expected.shape) if result.returncode == 0 else None
        yield op, result, output, expected.to(dtype)


@pytest.mark.parametrize("dtype_name", CONV_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_product_matches_torch_bit_for_bit(tmp_path, case, dtype_name):
    for op, result, output, expected in run_conv_ops(tmp_path, CASES[case], dtype_name):
        assert result.returncode == 0, (op, result.stderr)
        assert torch.equal(output, expected), op


def weight_gradient_splits(stdout):
    return int(stdout.split("conv_backward_weight splits=")[1].split()[0])


def test_the_weight_gradient_splits_k_by_the_gemm_rule(tmp_path):
    # 1 output tile of 8 x 72 over 1024 pixels, on the FMA units: min(132 SMs, 1024 / 64, 16) = 16 splits,
    # summed in order.
    ((_, result, output, expected),) = run_conv_ops(tmp_path, CASES["split_k_weight_gradient"], "float32",
                                                    ops=["conv_backward_weight"])
    assert weight_gradient_splits(result.stdout) == 16
    assert torch.equal(output, expected)
    ((_, result, _, _),) = run_conv_ops(tmp_path, CASES["3x3_padded"], "float32", ops=["conv_backward_weight"])
    assert weight_gradient_splits(result.stdout) == 1  # 84 pixels: too short to split (under 2 x 64)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["past_the_block_tile", "split_k_weight_gradient"], ids=str)
def test_real_kernels_are_clean_under_thread_sanitizer(tmp_path, case, dtype_name):
    for op, result, output, expected in run_conv_ops(tmp_path, CASES[case], dtype_name, variant="tsan"):
        assert "ThreadSanitizer" not in result.stderr, (op, result.stderr)
        assert result.returncode == 0 and torch.equal(output, expected), op


@pytest.mark.parametrize("dtype_name", CONV_DTYPES)
@pytest.mark.parametrize("case", ["strided_dilated", "kernel_larger_than_the_input", "stride_past_the_kernel",
                                  "asymmetric_same_padding"], ids=str)
def test_real_kernels_are_clean_under_address_sanitizer(tmp_path, case, dtype_name):
    # Every gather that reaches into the padding is tested against the image's bounds: a read
    # outside a tensor's file (exactly its size) would be an error here.
    for op, result, output, expected in run_conv_ops(tmp_path, CASES[case], dtype_name, variant="asan"):
        assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, (op, result.stderr)
        assert result.returncode == 0 and torch.equal(output, expected), op


def test_a_gather_one_row_past_the_image_is_reported(tmp_path):
    # EMU_BREAK_PADDING lets a window read the row below the image: the next channel's first row
    # inside the batch (wrong values), past the end of the input for the last one (ASan).
    ((_, result, _, _),) = run_conv_ops(tmp_path, CASES["3x3_padded"], "float32", "break_padding",
                                        ops=["conv_forward"])
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in result.stderr
    assert "window_element" in result.stderr


def test_reading_the_column_table_before_it_is_complete_is_a_data_race(tmp_path):
    ((_, result, _, _),) = run_conv_ops(tmp_path, CASES["3x3_padded"], "float32", "break_table_barrier",
                                        ops=["conv_forward"])
    assert result.returncode == TSAN_RACE_EXIT
    assert "WARNING: ThreadSanitizer: data race" in result.stderr and "conv.cuh" in result.stderr


def test_a_missing_tile_barrier_is_a_data_race_in_the_convolution_too(tmp_path):
    ((_, result, _, _),) = run_conv_ops(tmp_path, CASES["strided_dilated"], "float32", "break_sync",
                                        ops=["conv_backward_input"])
    assert result.returncode == TSAN_RACE_EXIT
    assert "WARNING: ThreadSanitizer: data race" in result.stderr


# ---- the ops' host code (conv_host.h) as torch.ops.ext_cuda_emu ----

@pytest.fixture(scope="module")
def ops():
    host_ops_library()
    return torch.ops.ext_cuda_emu


def call(ops, x, w, b=None, stride=1, padding=0, dilation=1):
    """ext.conv2d's argument forms (ext/conv.py), on the emulated CUDA op."""
    stride, dilation = ext.conv._pair("stride", stride), ext.conv._pair("dilation", dilation)
    paddings = ext.conv._paddings(padding, tuple(w.shape[2:]), stride, dilation)
    unbatched = x.dim() == 3
    out = ops.conv2d(x.unsqueeze(0) if unbatched else x, w, b, stride, paddings, dilation)
    return out.squeeze(0) if unbatched else out


def backward(ops, x, w, dy, stride, padding, dilation):
    """dX, dW and db through the emulated backward ops."""
    return (ops.conv2d_backward_input(dy, w, list(x.shape), stride, padding, dilation),
            ops.conv2d_backward_weight(dy, x, list(w.shape), stride, padding, dilation),
            ops.conv2d_backward_bias(dy))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 3), c=st.integers(1, 9), k=st.integers(1, 9), h=st.integers(1, 9), w=st.integers(1, 9),
       r=st.integers(1, 4), s=st.integers(1, 4), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(*[st.integers(0, 3)] * 4), dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
def test_drawn_shapes_match_torch(ops, n, c, k, h, w, r, s, stride, padding, dilation, dtype, seed):
    case = Case(n, c, h, w, k, r, s, stride, padding, dilation)
    _, _, oh, ow = case.output_shape()
    if oh < 1 or ow < 1:
        return  # the input is smaller than the kernel's reach: test_refusals covers the message
    g = torch.Generator().manual_seed(seed)
    x, wt, b = quarters(n, c, h, w, generator=g), quarters(k, c, r, s, generator=g), quarters(k, generator=g)
    dy = quarters(n, k, oh, ow, generator=g)
    y, dx, dw, db = case.reference(x, wt, b, dy)
    args = (list(stride), list(padding), list(dilation))
    assert torch.equal(ops.conv2d(x.to(dtype), wt.to(dtype), b.to(dtype), *args), y.to(dtype))
    for ours, exact in zip(backward(ops, x.to(dtype), wt.to(dtype), dy.to(dtype), *args), (dx, dw, db)):
        assert torch.equal(ours, exact.to(dtype))


def pytorch_samples(dtype):
    from torch.testing._internal.common_methods_invocations import op_db
    info = next(op for op in op_db if op.name == "nn.functional.conv2d")
    return [sample for sample in info.sample_inputs("cpu", dtype) if sample.kwargs.get("groups", 1) == 1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_pytorch_opinfo_samples(ops, dtype):
    # Random values here: the result is compared with the exact (float64) convolution of the same
    # dtype-rounded inputs, within the dtype's rounding plus the float32 accumulator's.
    samples = pytorch_samples(torch.float64)
    assert len(samples) >= 8
    for sample in samples:
        weight, *rest = sample.args
        bias = rest[0] if rest else sample.kwargs.get("bias")
        kwargs = {key: value for key, value in sample.kwargs.items() if key not in ("bias", "groups")}
        cast = [t.to(dtype) if t is not None else None for t in (sample.input, weight, bias)]
        expected = F.conv2d(*[t.double() if t is not None else None for t in cast], **kwargs)
        ours = call(ops, *cast, **kwargs)
        assert ours.dtype == dtype and ours.shape == expected.shape
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2 * torch.finfo(dtype).eps)
        torch.testing.assert_close(ours.double(), expected, rtol=tolerance, atol=tolerance * 10)


def test_memory_formats_and_strides(ops):
    g = torch.Generator().manual_seed(1)
    x, w, b = quarters(2, 6, 7, 5, generator=g), quarters(4, 6, 3, 3, generator=g), quarters(4, generator=g)
    expected = F.conv2d(x, w, b, padding=1).float()
    channels_last = ops.conv2d(x.float().to(memory_format=torch.channels_last), w.float(), b.float(), [1, 1],
                               [1, 1, 1, 1], [1, 1])
    assert channels_last.is_contiguous(memory_format=torch.channels_last)  # as F.conv2d gives it
    assert torch.equal(channels_last, expected)
    wide = quarters(2, 6, 7, 10, generator=g)
    wide[..., ::2] = x
    strided = ops.conv2d(wide.float()[..., ::2], w.float(), b.float(), [1, 1], [1, 1, 1, 1], [1, 1])
    assert torch.equal(strided, expected)


def test_empty_batches_and_channels(ops):
    w, b = torch.ones(4, 3, 3, 3), torch.arange(4.0)
    assert ops.conv2d(torch.ones(0, 3, 5, 5), w, b, [1, 1], [0, 0, 0, 0], [1, 1]).shape == (0, 4, 3, 3)
    # no input channels: the output is the bias
    out = ops.conv2d(torch.ones(2, 0, 5, 5), torch.ones(4, 0, 3, 3), b, [1, 1], [0, 0, 0, 0], [1, 1])
    assert torch.equal(out, b.view(1, 4, 1, 1).expand(2, 4, 3, 3))
    # batch 0: dW is zeros
    dw = ops.conv2d_backward_weight(torch.ones(0, 4, 3, 3), torch.ones(0, 3, 5, 5), [4, 3, 3, 3], [1, 1],
                                    [0, 0, 0, 0], [1, 1])
    assert torch.equal(dw, torch.zeros(4, 3, 3, 3))


def test_autocast_casts_like_nn_conv2d(ops):
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with torch.autocast("cpu", dtype=torch.float16):  # the emulated device's autocast key is CPU's
        out = ops.conv2d(x, w, None, [1, 1], [0, 0, 0, 0], [1, 1])
    assert out.dtype == torch.float16
    assert torch.equal(out, ops.conv2d(x.half(), w.half(), None, [1, 1], [0, 0, 0, 0], [1, 1]))


@pytest.mark.parametrize("make_call,message", [
    (lambda ops: ops.conv2d(torch.ones(1, 2, 5, 5, dtype=torch.int32), torch.ones(3, 2, 3, 3, dtype=torch.int32),
                            None, [1, 1], [0] * 4, [1, 1]), "use float32, float64, float16 or bfloat16"),
    (lambda ops: ops.conv2d(torch.ones(1, 4, 5, 5), torch.ones(3, 2, 3, 3), None, [1, 1], [0] * 4, [1, 1]),
     "grouped convolutions are not supported: use conv=torch"),
    (lambda ops: ops.conv2d(torch.ones(1, 2, 2, 2), torch.ones(3, 2, 3, 3), None, [1, 1], [0] * 4, [1, 1]),
     "smaller than the kernel's reach"),
    # 2^32 pixels (an expanded input: no memory), refused before anything is allocated
    (lambda ops: ops.conv2d(torch.ones(1, 1, 1, 1).expand(2**16, 1, 2**8, 2**8), torch.ones(1, 1, 1, 1), None,
                            [1, 1], [0] * 4, [1, 1]), "more than the CUDA kernels' 32-bit indices reach"),
], ids=["dtype", "channels", "reach", "too_large"])
def test_refusals_say_what_to_do_in_one_line(ops, make_call, message):
    with pytest.raises(RuntimeError, match=message) as error:
        make_call(ops)
    assert len(str(error.value).splitlines()) == 1
