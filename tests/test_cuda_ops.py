"""The CUDA kernels through the real ops, against PyTorch: forward and every gradient in
every dtype, awkward shapes and layouts, autocast, streams and CUDA graphs, determinism.

Needs a GPU and a build with the CUDA kernels; on this project's machines (no GPU) the
kernels are instead run on the CPU by tests/test_cuda_emulation.py.

Inputs are multiples of 1/4 in [-2, 2], so every product and sum is exact in float32 and
each result must equal the float64 reference rounded to the dtype, bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here; the CUDA kernels are checked by test_cuda_emulation.py")

if torch.cuda.is_available():
    import ext

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (M, N, K): degenerate, prime, just off every edge of both kernels' tiles (128 x 128 x 8 on the FMA
# units; 128 x 128 x 32, 64 x 32 warp tiles and 3 stages on the tensor cores), and products that
# split K (split_k.cuh: few output tiles, long K).
SHAPES = [(1, 1, 1), (37, 61, 45), (128, 128, 8), (129, 127, 9), (127, 129, 7), (130, 68, 12), (3, 5, 0),
          (0, 4, 3), (65, 33, 31), (64, 32, 96), (17, 9, 97), (136, 72, 40), (128, 256, 784), (5, 7, 2049)]
LAYOUTS = ["contiguous", "transposed", "misaligned", "strided"]


def quarters(*shape, generator):
    return (torch.randint(-8, 9, shape, generator=generator).double() / 4).cuda()


def lay_out(values, layout):
    """The same values in another memory layout (the kernels read any strides)."""
    if layout == "contiguous":
        return values.contiguous()
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "misaligned":  # storage offset of one element: the scalar-load path
        flat = torch.cat([values.new_zeros(1), values.flatten()])
        return flat[1:].view(values.shape)
    if layout == "strided":
        wide = values.new_zeros(values.shape[0], 2 * values.shape[1] + 3)
        wide[:, : 2 * values.shape[1] : 2] = values
        return wide[:, : 2 * values.shape[1] : 2]
    raise ValueError(layout)


def exact_case(shape, dtype, layout="contiguous", seed=0):
    """input, weight, bias (leaf tensors in dtype) and a grad_output, all exact in dtype."""
    M, N, K = shape
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = quarters(M, K, generator=g), quarters(N, K, generator=g), quarters(N, generator=g), \
        quarters(M, N, generator=g)
    leaves = [lay_out(t.to(dtype), layout).requires_grad_() for t in (x, w)] + [b.to(dtype).requires_grad_()]
    return leaves, dy.to(dtype)


def reference(op, leaves, grad_output):
    """Forward and gradients in float64 (exact here), rounded to the dtype."""
    x, w, b = (t.detach().double().requires_grad_() for t in leaves)
    y = F.linear(x, w, b)
    if op is ext.linear_relu:
        y = torch.relu(y)
    y.backward(grad_output.double())
    dtype = leaves[0].dtype
    return [t.to(dtype) for t in (y.detach(), x.grad, w.grad, b.grad)]


def ours(op, leaves, grad_output):
    y = op(*leaves)
    y.backward(grad_output)
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("op", ["linear", "linear_relu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_are_exact(op, shape, dtype):
    op = getattr(ext, op)
    leaves, grad_output = exact_case(shape, dtype)
    for got, expected in zip(ours(op, leaves, grad_output), reference(op, leaves, grad_output), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_layout(layout, dtype):
    leaves, grad_output = exact_case((37, 61, 45), dtype, layout)
    for got, expected in zip(ours(ext.linear, leaves, grad_output), reference(ext.linear, leaves, grad_output), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tf32_forward_and_gradients_are_exact_on_exact_inputs(shape, allow_tf32):
    # Multiples of 1/4 are exact in TF32 too: the tensor-core path must give the exact result.
    leaves, grad_output = exact_case(shape, torch.float32)
    for got, expected in zip(ours(ext.linear, leaves, grad_output), reference(ext.linear, leaves, grad_output),
                             strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_tf32_follows_torch_flag_and_matches_cublas_tf32(allow_tf32):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = torch.randn(256, 1024, device="cuda", generator=g), torch.randn(512, 1024, device="cuda", generator=g)
    exact = x.double() @ w.double().t()
    with_tf32, cublas_tf32 = ext.linear(x, w, None), F.linear(x, w)
    torch.backends.cuda.matmul.allow_tf32 = False
    without = ext.linear(x, w, None)
    error = lambda y: ((y.double() - exact).abs().max() / exact.abs().max()).item()  # noqa: E731
    assert error(without) < 1e-5 < error(with_tf32) < 5e-3  # TF32's 10-bit mantissa shows, and no more
    assert error(with_tf32) < 4 * error(cublas_tf32) + 1e-6  # about cuBLAS's own TF32 error


def test_float32_random_values_match_f_linear_with_large_k():
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(shape, device="cuda", generator=g) for shape in ((67, 4099), (131, 4099), (131,)))
    reference = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(ext.linear(x, w, b), reference, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op_name", ["linear", "linear_relu"])
def test_autocast_casts_like_nn_linear(autocast_dtype, op_name):
    leaves, grad_output = exact_case((37, 61, 45), torch.float32)
    with torch.autocast("cuda", dtype=autocast_dtype):
        y = getattr(ext, op_name)(*leaves)
        torch_y = F.linear(*(t.detach() for t in leaves))
    assert y.dtype == torch_y.dtype == autocast_dtype
    expected = reference(getattr(ext, op_name), [t.detach().to(autocast_dtype) for t in leaves],
                         grad_output.to(autocast_dtype))
    torch.testing.assert_close(y, expected[0], rtol=0, atol=0)
    y.backward(grad_output.to(autocast_dtype))
    for leaf, want in zip(leaves, expected[1:], strict=True):  # computed in the autocast dtype, exact here
        assert leaf.grad.dtype == torch.float32  # grads reach fp32 params
        torch.testing.assert_close(leaf.grad, want.float(), rtol=0, atol=0)


def test_autocast_leaves_float64_alone():
    leaves, _ = exact_case((5, 7, 3), torch.float64)
    with torch.autocast("cuda", dtype=torch.float16):
        assert ext.linear(*leaves).dtype == F.linear(*(t.detach() for t in leaves)).dtype == torch.float64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_results_repeat_bit_for_bit(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_()
               for shape in ((300, 257), (129, 257), (129,)))
    grad_output = torch.randn(300, 129, device="cuda", generator=g).to(dtype)

    def run():
        for leaf in (x, w, b):
            leaf.grad = None
        return ours(ext.linear, [x, w, b], grad_output)

    for first, second in zip(run(), run(), strict=True):
        assert torch.equal(first, second)


def test_runs_on_the_current_stream_and_in_cuda_graphs():
    leaves, _ = exact_case((37, 61, 45), torch.float32)
    x, w, b = (t.detach() for t in leaves)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = ext.linear(x, w, b)  # warm-up, and a launch on a side stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails or records nothing if the kernel ignores the capture stream
        graph_y = ext.linear(x, w, b)
    x.copy_(-x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_y, F.linear(x, w, b), rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device_not_the_current_one():
    leaves, _ = exact_case((37, 61, 45), torch.float32)
    x, w, b = (t.detach().to("cuda:1") for t in leaves)
    with torch.cuda.device(0):
        y = ext.linear(x, w, b)
    assert y.device == torch.device("cuda:1")
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)


# ---- the convolution (conv.cuh) against torch's (cuDNN), through ext.conv2d and ext.Conv2d ----

# (input, weight, stride, padding, dilation): tile edges (129 output channels, 130 input channels),
# strided and dilated, a kernel larger than the input, a stride past the kernel, and dW's split-K.
CONV_CASES = [((2, 3, 7, 6), (4, 3, 3, 3), 1, 1, 1), ((1, 3, 11, 12), (129, 3, 3, 3), 1, 1, 1),
              ((2, 130, 5, 5), (7, 130, 1, 1), 1, 0, 1), ((3, 5, 12, 11), (9, 5, 5, 3), (3, 2), (2, 1), (2, 1)),
              ((2, 2, 3, 2), (3, 2, 5, 4), 1, 2, 1), ((2, 4, 9, 9), (5, 4, 2, 2), 3, 0, 1),
              ((4, 8, 16, 16), (8, 8, 3, 3), 1, "same", 1), ((16, 64, 8, 8), (64, 64, 3, 3), 1, 1, 1)]


@pytest.mark.parametrize("case", range(len(CONV_CASES)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv2d_forward_and_gradients_are_exact(case, dtype):
    x_shape, w_shape, stride, padding, dilation = CONV_CASES[case]
    g = torch.Generator().manual_seed(case)
    x, w, b = quarters(*x_shape, generator=g), quarters(*w_shape, generator=g), quarters(w_shape[0], generator=g)
    expected = F.conv2d(x, w, b, stride, padding, dilation)
    dy = quarters(*expected.shape, generator=g)
    # Copies, so that in float64 the leaves and the reference's are distinct tensors.
    leaves = [t.to(dtype, copy=True).requires_grad_() for t in (x, w, b)]
    ours = ext.conv2d(*leaves, stride=stride, padding=padding, dilation=dilation)
    ours.backward(dy.to(dtype))
    reference = [t.clone().requires_grad_() for t in (x, w, b)]
    F.conv2d(*reference, stride, padding, dilation).backward(dy)
    torch.testing.assert_close(ours, expected.to(dtype), rtol=0, atol=0)
    for leaf, exact in zip(leaves, reference):
        torch.testing.assert_close(leaf.grad, exact.grad.to(dtype), rtol=0, atol=0)


def test_conv2d_channels_last_and_autocast_as_nn_conv2d():
    x = torch.randn(4, 8, 9, 9, device="cuda").to(memory_format=torch.channels_last)
    ours, theirs = ext.Conv2d(8, 16, 3, padding=1).cuda(), torch.nn.Conv2d(8, 16, 3, padding=1).cuda()
    theirs.load_state_dict(ours.state_dict())
    assert ours(x).is_contiguous(memory_format=torch.channels_last)
    # Ours runs float32 on the FMA units; cuDNN would use TF32 by default (1e-3 off).
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert ours(x).dtype == theirs(x).dtype == torch.bfloat16
