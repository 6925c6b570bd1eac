"""ext.conv2d and ext.Conv2d against F.conv2d and nn.Conv2d: forward and every gradient in float64 (to
rounding) and float32, PyTorch's own samples, drawn shapes, memory formats, registration, refusals."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

import ext
from conftest import FunctionCalls, OpLog, assert_within_rounding, num_threads
from test_op import TRANSFORMS


def with_grads(x, w, b):
    return [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]


def conv_and_grads(conv, x, w, b, grad, **kwargs):
    x, w, b = with_grads(x, w, b)
    y = conv(x, w, b, **kwargs)
    inputs = [t for t in (x, w, b) if t is not None]
    return y, torch.autograd.grad(y, inputs, grad)


def assert_matches_torch(x, w, b=None, **kwargs):
    """ext.conv2d's output and gradients within rounding of F.conv2d's in float64, from the same inputs; the
    magnitudes (the sums of |terms|) are the same convolution of the absolute values."""
    y = ext.conv2d(x, w, b, **kwargs)
    reference = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kwargs)
    assert y.dtype == x.dtype and y.shape == reference.shape
    grad = torch.randn_like(reference)
    abs_in = with_grads(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    magnitude = F.conv2d(*abs_in, **kwargs)
    mag_grads = torch.autograd.grad(magnitude, [t for t in abs_in if t is not None], grad.abs())
    y_ext, grads = conv_and_grads(ext.conv2d, x, w, b, grad.to(x.dtype), **kwargs)
    _, grads_ref = conv_and_grads(F.conv2d, x.double(), w.double(), None if b is None else b.double(), grad,
                                  **kwargs)
    patch = w[0].numel()
    pixels = reference.shape[0] * reference.shape[2] * reference.shape[3] if reference.dim() == 4 else \
        reference.shape[1] * reference.shape[2]
    assert_within_rounding(y, reference, magnitude.detach(), patch + 1)
    terms = [w.shape[0] * w.shape[2] * w.shape[3], pixels, pixels]
    for ours, ref, mag, n, name in zip(grads, grads_ref, mag_grads, terms, ("input", "weight", "bias")):
        assert ours.shape == ref.shape, name
        assert_within_rounding(ours, ref, mag, n)
    return y


def same_layout(a, b):
    """The same strides wherever they matter: dimensions of size 1 (or an empty tensor) have any stride."""
    return a.numel() == 0 or all(sa == sb for sa, sb, size in zip(a.stride(), b.stride(), a.shape) if size > 1)


SHAPES = [  # (N, C, H, W), (K, R, S), stride, padding, dilation
    ((2, 3, 8, 8), (4, 3, 3), 1, 1, 1),
    ((2, 3, 8, 9), (5, 3, 2), 2, 1, 1),
    ((1, 4, 5, 7), (3, 1, 1), 1, 0, 1),          # pointwise: the input is im2col
    ((3, 2, 7, 6), (4, 3, 3), (2, 1), (1, 2), (1, 2)),
    ((2, 5, 4, 4), (6, 5, 5), 1, 2, 1),
    ((2, 3, 3, 3), (2, 5, 5), 1, 2, 1),          # a kernel larger than the input, padded
    ((2, 1, 1, 1), (1, 1, 1), 1, 0, 1),
    ((32, 6, 4, 4), (7, 3, 3), 1, 1, 1),         # small images: chunks span images (staged output)
    ((2, 16, 40, 40), (8, 3, 3), 1, 1, 1),       # several chunks per image
    ((2, 8, 33, 35), (24, 1, 1), 2, 0, 1),       # strided 1x1 downsample
    ((3, 7, 20, 21), (5, 2, 3), 3, 2, 2),
    ((2, 4, 9, 9), (3, 3, 3), 4, 0, 1),          # stride larger than the kernel
    ((1, 70, 6, 6), (9, 3, 3), 1, 1, 1),         # patch 630 > one K block of doubles (400)
    ((5, 20, 12, 12), (130, 3, 3), 2, 1, 1),     # more than 128 output channels: col is packed
    # Images of at most a chunk are gathered from a padded copy (conv.cpp, gathers_padded): rows
    # that reach past the top and bottom and (dilated, 5-wide, even kernels) skip rows or columns.
    ((3, 5, 6, 6), (7, 3, 3), 1, 1, 1),
    ((2, 4, 7, 5), (6, 5, 5), 1, 2, 1),
    ((2, 3, 9, 10), (4, 3, 3), 1, 2, 2),
    ((2, 3, 6, 6), (4, 2, 2), 1, "same", 1),
    ((3, 4, 16, 16), (6, 3, 3), 2, 1, 1),        # strided, from a padded copy
    # The direct gather (gathers_padded says no): a padded 1x1 kernel, a dilated kernel over a tiny output.
    ((2, 3, 7, 8), (4, 1, 1), 2, 1, 1),
    ((2, 3, 5, 5), (4, 3, 3), 1, 1, 3),
    # Images of more than 1024 output pixels (more than any chunk): chunks within an image, each
    # padded copy a window of the rows under the chunk's output rows.
    ((1, 3, 36, 36), (4, 3, 3), 1, 1, 1),
    ((1, 2, 33, 40), (3, 5, 5), 1, 2, 1),
    ((1, 2, 36, 34), (3, 3, 3), 1, 2, 2),
    ((1, 2, 33, 33), (3, 2, 2), 1, "same", 1),
    ((4, 6, 12, 3), (520, 3, 3), 1, 1, 1),       # 6x64 tiles: chunks in 64-pixel panels
    ((2, 3, 5, 1), (2, 3, 1), 1, (1, 0), 1),     # one-column images
    # The direct convolution (conv.cpp, convolves_directly: stride 1 down the rows, output rows of at
    # least a vector): from one padded copy where OW is whole vectors, else from shifted planes; dX as
    # the convolution of dY with W flipped (transposed_geometry) where the padding allows.
    ((2, 5, 16, 16), (6, 3, 3), 1, 1, 1),        # padded copy (float32 and float64); a ragged 16-pixel panel
    ((2, 3, 16, 16), (4, 2, 2), 1, "same", 1),   # uneven padding, flipped for dX
    ((2, 3, 16, 32), (4, 3, 3), 1, 2, 2),        # dilated
    ((1, 2, 16, 16), (3, 3, 3), 1, 3, 1),        # padding past the kernel's reach: dX by col2im
    ((2, 3, 4, 64), (4, 3, 3), (1, 2), 1, 1),    # strided along rows only: shifted planes
    ((8, 4, 2, 16), (5, 3, 3), 1, 1, 1),         # chunks span images
    ((2, 3, 6, 24), (9, 5, 3), 1, (2, 1), 1),    # shifted planes in float32 (24 columns)
    ((1, 3, 16, 16), (520, 3, 3), 1, 1, 1),      # 6x64 tiles
    # Strided down the rows, with output rows of whole vectors: gathered (the direct convolution, which
    # could read these, measured slower).
    ((2, 3, 32, 32), (4, 3, 3), 2, 1, 1),
    ((2, 3, 8, 16), (4, 3, 3), (2, 1), 1, 1),
    # By output position (conv.cpp, convolves_by_position: at most 64 pixels in and out, a batch of at least
    # 64): only the taps inside the input, in all three products; dX as the convolution of dY where
    # transposed_geometry allows.
    ((64, 6, 4, 4), (7, 3, 3), 1, 1, 1),
    ((100, 5, 6, 7), (9, 3, 3), 1, 1, 1),        # the batch in panels of 48 and a ragged one
    ((64, 3, 8, 8), (5, 3, 3), 2, 1, 1),         # strided: dX by col2im
    ((70, 3, 9, 6), (4, 2, 3), (1, 2), (0, 1), (2, 1)),
    ((64, 2, 2, 2), (3, 3, 3), 1, 4, 1),         # positions with no tap inside the input
    ((64, 3, 1, 1), (4, 3, 3), 1, 1, 1),         # taps with no position inside the input (dW's zeros)
    ((64, 420, 3, 3), (4, 3, 3), 1, 1, 1),       # channels in K blocks of doubles (400)
    ((64, 810, 2, 3), (3, 2, 2), 1, 1, 1),       # ... and of floats (800)
    ((64, 3, 3, 3), (520, 3, 3), 1, 1, 1),       # 6x64 tiles: the batch in 64-image panels
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_match_torch(shape, bias, dtype):
    (n, c, h, w), (k, r, s), stride, padding, dilation = shape
    torch.manual_seed(0)
    x, weight = torch.randn(n, c, h, w, dtype=dtype), torch.randn(k, c, r, s, dtype=dtype)
    b = torch.randn(k, dtype=dtype) if bias else None
    assert_matches_torch(x, weight, b, stride=stride, padding=padding, dilation=dilation)


@given(n=st.integers(0, 4), c=st.integers(1, 9), k=st.integers(1, 20), h=st.integers(1, 14), w=st.integers(1, 14),
       r=st.integers(1, 5), s=st.integers(1, 5), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)), bias=st.booleans(),
       channels_last=st.booleans())
def test_drawn_shapes_match_torch(n, c, k, h, w, r, s, stride, padding, dilation, bias, channels_last):
    reach_h, reach_w = dilation[0] * (r - 1) + 1, dilation[1] * (s - 1) + 1
    if h + 2 * padding[0] < reach_h or w + 2 * padding[1] < reach_w:
        return  # no output: the refusal is tested below
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = assert_matches_torch(x, torch.randn(k, c, r, s, dtype=torch.float64),
                             torch.randn(k, dtype=torch.float64) if bias else None,
                             stride=stride, padding=padding, dilation=dilation)
    expected = F.conv2d(x, torch.randn(k, c, r, s, dtype=torch.float64), stride=stride, padding=padding,
                        dilation=dilation)
    assert same_layout(y, expected)


def test_gradcheck_float64():
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: ext.conv2d(*a, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
                                    (x, w, b))


def pytorch_samples(dtype):
    """The samples PyTorch's own OpInfo tests F.conv2d with, groups=1 only."""
    from torch.testing._internal.common_methods_invocations import op_db
    info = next(op for op in op_db if op.name == "nn.functional.conv2d")
    return [sample for sample in info.sample_inputs("cpu", dtype) if sample.kwargs.get("groups", 1) == 1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pytorch_opinfo_samples(dtype):
    samples = pytorch_samples(dtype)
    assert len(samples) >= 8
    for sample in samples:
        weight, *rest = sample.args
        bias = rest[0] if rest else sample.kwargs.get("bias")
        kwargs = {key: value for key, value in sample.kwargs.items() if key not in ("bias", "groups")}
        assert_matches_torch(sample.input, weight, bias, **kwargs)


def test_pytorch_module_samples():
    """nn.Conv2d's samples from PyTorch's module_db, through ext.Conv2d built from the same constructor."""
    from torch.testing._internal.common_modules import module_db
    info = next(m for m in module_db if m.module_cls is nn.Conv2d)
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True, training=True)
    assert samples
    for sample in samples:
        args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        torch.manual_seed(0)
        theirs = nn.Conv2d(*args, **kwargs, dtype=torch.float64)
        torch.manual_seed(0)
        ours = ext.Conv2d(*args, **kwargs, dtype=torch.float64)
        x = sample.forward_input.args[0].detach()
        for module in (theirs, ours):
            module.zero_grad()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [module(xi) for module, xi in zip((theirs, ours), xs)]
        torch.testing.assert_close(outs[1], outs[0])
        for out in outs:
            out.sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
        assert (ours.bias is None) == (theirs.bias is None)
        if theirs.bias is not None:
            torch.testing.assert_close(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("kernel", [(3, 3), (4, 2), (2, 5)])
def test_string_paddings_including_even_kernels(padding, kernel):
    x, w = torch.randn(2, 3, 9, 11, dtype=torch.float64), torch.randn(4, 3, *kernel, dtype=torch.float64)
    for dilation in (1, 2):
        assert_matches_torch(x, w, padding=padding, dilation=dilation)


def test_unbatched_input_and_batch_zero():
    w = torch.randn(5, 3, 3, 3, dtype=torch.float64)
    y = assert_matches_torch(torch.randn(3, 7, 6, dtype=torch.float64), w, padding=1)
    assert y.shape == (5, 7, 6)
    empty = torch.randn(0, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    y = ext.conv2d(empty, w.requires_grad_(), padding=1)
    assert y.shape == (0, 5, 7, 6)
    y.sum().backward()
    assert empty.grad.shape == empty.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("layout", ["channels_last_input", "channels_last_weight", "strided", "transposed"])
def test_memory_formats_and_strides(layout):
    x, w = torch.randn(3, 6, 10, 12, dtype=torch.float64), torch.randn(8, 6, 3, 3, dtype=torch.float64)
    if layout == "channels_last_input":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "channels_last_weight":
        w = w.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.randn(3, 12, 20, 12, dtype=torch.float64)[:, ::2, ::2]
    else:
        x = x.transpose(2, 3)
    y = assert_matches_torch(x, w, padding=1)
    assert same_layout(y, F.conv2d(x, w, padding=1))
    x, w = with_grads(x, w, None)[:2]
    ext.conv2d(x, w, padding=1).sum().backward()
    x_ref, w_ref = with_grads(x, w, None)[:2]
    F.conv2d(x_ref, w_ref, padding=1).sum().backward()
    assert same_layout(w.grad, w_ref.grad) and same_layout(x.grad, x_ref.grad)


def test_results_are_the_same_bits_on_any_thread_count():
    """Threads split pixels (forward), dW's columns and dX's channels, never a sum."""
    torch.manual_seed(0)
    cases = [((16, 32, 16, 16), (48, 32, 3, 3)), ((64, 40, 4, 4), (72, 40, 3, 3)), ((4, 24, 30, 30), (16, 24, 1, 1))]
    for x_shape, w_shape in cases:
        x, w, b = torch.randn(x_shape), torch.randn(w_shape), torch.randn(w_shape[0])
        grad = torch.randn(F.conv2d(x, w, padding=1).shape if w_shape[2] == 3 else F.conv2d(x, w).shape)
        padding = 1 if w_shape[2] == 3 else 0
        results = []
        for threads in (1, 2, 3):
            with num_threads(threads):
                results.append(conv_and_grads(ext.conv2d, x, w, b, grad, padding=padding))
        for y, grads in results[1:]:
            assert torch.equal(y, results[0][0])
            assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


@pytest.mark.parametrize("path", ["portable", "avx2+fma"])
def test_every_cpu_path_computes_the_same_convolution(path):
    if path == "avx2+fma" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    x, w = torch.randn(4, 12, 9, 9, dtype=torch.float64), torch.randn(20, 12, 3, 3, dtype=torch.float64)
    previous = torch.ops.ext.cpu_path()
    torch.ops.ext.set_cpu_path(path)
    try:
        assert_matches_torch(x, w, torch.randn(20, dtype=torch.float64), stride=2, padding=1)
        assert_matches_torch(x.float(), w.float(), padding=1)
        small = torch.randn(64, 5, 4, 4, dtype=torch.float64)  # by output position
        assert_matches_torch(small, w[:, :5], padding=1)
        assert_matches_torch(small.float(), w[:, :5].float(), padding=1)
    finally:
        torch.ops.ext.set_cpu_path(previous)


def test_cpu_autocast_runs_float32():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ext.conv2d(x.bfloat16(), w, padding=1)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.conv2d(x.bfloat16().float(), w, padding=1))


@pytest.mark.parametrize("make_call, message", [
    (lambda: ext.conv2d(torch.randn(2, 4, 5, 5), torch.randn(4, 2, 3, 3), groups=2), "groups=2 is not supported"),
    (lambda: ext.conv2d(torch.randn(2, 4, 5, 5), torch.randn(4, 3, 3, 3)), "input has 4 channels but weight "
                                                                           "expects 3"),
    (lambda: ext.conv2d(torch.randn(2, 4, 5, 5).half(), torch.randn(4, 4, 3, 3).half()), "dtype Half is not "
                                                                                          "supported on the CPU"),
    (lambda: ext.conv2d(torch.randn(2, 4, 5, 5), torch.randn(4, 4, 3, 3).double()), "cast both to the same dtype"),
    (lambda: ext.conv2d(torch.randn(4, 5), torch.randn(4, 4, 3, 3)), "input must be 4-D"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3)), "weight must be 4-D"),
    (lambda: ext.conv2d(torch.randn(1, 4, 2, 2), torch.randn(4, 4, 3, 3)), "smaller than the kernel's reach"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3), stride=0), "stride must be positive"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3), padding=-1), "must not be negative"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3), stride=2, padding="same"),
     "padding='same' is not supported for strided"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3), padding="full"), "'valid' or 'same'"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3), torch.randn(3)), "bias must have "
                                                                                          "shape [4]"),
    (lambda: ext.conv2d(torch.randn(1, 4, 5, 5).to_sparse(), torch.randn(4, 4, 3, 3)), ".to_dense()"),
    (lambda: ext.Conv2d(4, 8, 3, groups=2), "groups=2 is not supported"),
    (lambda: ext.conv2d(torch.nested.nested_tensor([torch.randn(4, 5, 5)]), torch.randn(4, 4, 3, 3)),
     "nested tensors are not supported"),
    (lambda: ext.conv2d(torch.randn(2, 4, 5, 5), torch.randn(4, 4, 3, 3), groups="1"), "groups='1' is not supported"),
    (lambda: ext.conv2d(torch.randn(2, 3, 5, 5), torch.randn(4, 3, 0, 3)), "the kernel must be at least 1x1, got 0x3"),
    (lambda: ext.conv2d(torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3, device="meta")),
     "weight is on meta but input is on cpu"),
    (lambda: torch.ops.ext.conv2d(torch.empty(1, 3, 5, 5, device="meta"), torch.empty(4, 3, 3, 3, device="meta"),
                                  None, [0, 1], [0, 0, 0, 0], [1, 1]), "stride and dilation must be positive"),
    # the 1x1 channels_last path (ext.linear on the pixels' rows) refuses what the op refuses, in its words
    (lambda: ext.conv2d(torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last), torch.randn(6, 4, 1, 1),
                        torch.randn(1)), "ext.conv2d: bias must have shape [6]"),
    (lambda: ext.conv2d(torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last), torch.randn(6, 4, 1, 1),
                        torch.randn(6, dtype=torch.float64)), "ext.conv2d: bias is Double but weight is Float"),
    (lambda: ext.conv2d(torch.randn(2, 4, 3, 3).half().to(memory_format=torch.channels_last),
                        torch.randn(6, 4, 1, 1).half()), "ext.conv2d: dtype Half is not supported on the CPU"),
    # the backward ops called by hand: input_size or weight_size that cannot be the forward's
    (lambda: torch.ops.ext.conv2d_backward_input(torch.randn(1, 1, 3, 3), torch.randn(1, 2, 3, 3), [1, 3, 5, 5],
                                                 [1, 1], [0, 0, 0, 0], [1, 1]),
     "input_size has 3 channels but weight has 2"),
    (lambda: torch.ops.ext.conv2d_backward_input(torch.randn(1, 1, 3, 3), torch.randn(1, 2, 3, 3), [1, 2, -5, 5],
                                                 [1, 1], [0, 0, 0, 0], [1, 1]), "input_size must not be negative"),
    (lambda: torch.ops.ext.conv2d_backward_weight(torch.randn(1, 1, 3, 3), torch.randn(1, 2, 5, 5), [1, 2, 3, -3],
                                                  [1, 1], [0, 0, 0, 0], [1, 1]), "weight_size must not be negative"),
])
def test_refusals_say_what_to_do_in_one_line(make_call, message):
    with pytest.raises((RuntimeError, ValueError, TypeError)) as error:
        make_call()
    text = str(error.value).splitlines()[0]
    assert message in text, text
    assert "Traceback" not in str(error.value)


def test_double_backward_is_refused_in_one_line():
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(ext.conv2d(x, w).sum(), x, create_graph=False)
    assert grad.shape == x.shape
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(ext.conv2d(x, w).sum(), x, create_graph=True)


def test_every_conv_op_answers_cuda_tensors():
    # Its CUDA kernels (cuda/conv_cuda.cu), or in a CPU-only build one line saying how to rebuild with them;
    # tests/test_cuda_ops.py runs them on a GPU, tests/test_cuda_conv.py in the emulation.
    for name in ("conv2d", "conv2d_backward_input", "conv2d_backward_weight", "conv2d_backward_bias"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ext::{name}", "CUDA"), name


@pytest.mark.parametrize("case", ["plain", "strided_pointwise", "staged"])
def test_opcheck(case):
    shapes = {"plain": ((2, 3, 7, 6), (4, 3, 3, 3), [1, 1], [1, 1, 0, 2]),
              "strided_pointwise": ((2, 5, 6, 6), (4, 5, 1, 1), [2, 2], [0, 0, 0, 0]),
              "staged": ((9, 4, 3, 3), (6, 4, 3, 3), [1, 1], [1, 1, 1, 1])}[case]
    x_shape, w_shape, stride, padding = shapes
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(w_shape[0], dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.ext.conv2d.default, (x, w, b, stride, padding, [1, 1]))


def test_torch_compile_traces_without_graph_breaks():
    model = nn.Sequential(ext.Conv2d(3, 8, 3, padding=1), nn.ReLU(), ext.Conv2d(8, 4, 1, stride=2))
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 10, 10)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager(x))
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


# ext.Conv2d and replace_convs


@pytest.mark.parametrize("bias", [True, False])
def test_module_has_nn_conv2ds_init_state_dict_and_repr(bias):
    args = (3, 8, (3, 2))
    kwargs = dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), bias=bias, dtype=torch.float64)
    torch.manual_seed(0)
    theirs = nn.Conv2d(*args, **kwargs)
    torch.manual_seed(0)
    ours = ext.Conv2d(*args, **kwargs)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    back = nn.Conv2d(*args, **kwargs)
    back.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(ours(x), back(x))


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_every_padding_mode_matches_nn_conv2d(padding_mode):
    torch.manual_seed(0)
    theirs = nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode=padding_mode, dtype=torch.float64)
    ours = ext.Conv2d.from_conv2d(theirs)
    assert ours.weight is theirs.weight and ours.padding_mode == padding_mode
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [ours(xs[0]), theirs(xs[1])]
    torch.testing.assert_close(outs[0], outs[1])
    grads = [torch.autograd.grad(out, (xi, ours.weight, ours.bias), torch.ones_like(out))
             for out, xi in zip(outs, xs)]  # the shared weight and bias: each side's own gradient
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


def test_from_conv2d_refuses_grouped_and_computed_weights_saying_what_to_do():
    with pytest.raises(ValueError, match="keep this layer an nn.Conv2d"):
        ext.Conv2d.from_conv2d(nn.Conv2d(4, 4, 3, groups=4))
    with pytest.raises(TypeError, match="use ext.replace_convs"):
        ext.Conv2d.from_conv2d(nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 3)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.shared = nn.Conv2d(8, 8, 1)
        self.normed = nn.utils.parametrizations.weight_norm(nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.shared(self.shared(self.depthwise(self.stem(x)).relu()))
        return self.head(self.normed(x).mean((2, 3)))


def test_replace_convs_converts_in_place_and_names_what_it_left():
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = model(x)
    stem, hook_calls = model.stem, []
    stem.register_forward_hook(lambda *args: hook_calls.append(1))
    left = ext.replace_convs(model)
    assert left == ["depthwise (groups != 1)"]
    assert model.stem is stem and type(stem) is ext.Conv2d and type(model.shared) is ext.Conv2d
    assert isinstance(model.normed, ext.Conv2d) and type(model.depthwise) is nn.Conv2d
    torch.testing.assert_close(model(x), expected)
    assert hook_calls == [1]
    nn.utils.parametrize.remove_parametrizations(model.normed, "weight")
    assert type(model.normed) is ext.Conv2d


def test_a_resnet_trains_the_same_with_either_convolution():
    """ResNet-18 (CIFAR stem) from the same weights, three SGD steps each way: the same losses and weights."""
    import models
    torch.manual_seed(0)
    reference = models.build_model("resnet18", num_classes=10, small_input=True).double()
    ours = models.build_model("resnet18", num_classes=10, small_input=True).double()
    ours.load_state_dict(reference.state_dict())
    assert ext.replace_convs(ours) == []
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (4,))
    losses = {}
    for name, model in (("torch", reference), ("ext", ours)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses[name] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["ext"] == pytest.approx(losses["torch"], rel=1e-9)
    for (key, a), b in zip(reference.state_dict().items(), ours.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10, msg=key)


def test_a_pointwise_convolution_in_channels_last_is_our_linear_op():
    """1x1, stride 1, no padding, channels_last input: ext.linear on the (N·H·W) x C rows, no copies."""
    x = torch.randn(3, 16, 7, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    w, b = torch.randn(24, 16, 1, 1, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    y = assert_matches_torch(x, w, b)
    assert y.is_contiguous(memory_format=torch.channels_last)
    with OpLog() as log:
        ext.conv2d(x, w, b)
    assert "ext.linear" in log.ops and "ext.conv2d" not in log.ops and "aten.clone" not in log.ops
    with OpLog() as log:  # NCHW, or any other kernel, goes through the convolution
        ext.conv2d(x.contiguous(), w, b)
        ext.conv2d(x, w, b, stride=2)
    assert log.ops.count("ext.conv2d") == 2 and "ext.linear" not in log.ops


def test_torch_export_records_our_op():
    model = nn.Sequential(ext.Conv2d(3, 8, 3, padding=1, stride=2), nn.ReLU()).eval()
    x = torch.randn(2, 3, 9, 9)
    exported = torch.export.export(model, (x,))
    assert "ext.conv2d" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), model(x))


def test_a_linear_by_conv_sweep_runs_and_compares_each_choice(tmp_path):
    """The README's sweep, small: four ResNet-18 jobs, their summary with both comparisons and the shares."""
    from test_resume import train_command
    sweep_dir = tmp_path / "sweep"
    result = train_command(["-m", "model=resnet18", "data=fake", "data.train_size=32", "data.val_size=16",
                            "data.batch_size=16", "data.image_size=[3,8,8]", "trainer.epochs=1",
                            "linear=torch,custom", "conv=torch,custom", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = sorted(path.name for path in sweep_dir.iterdir() if (path / "summary.json").is_file())
    assert len(jobs) == 4 and sum("conv=custom" in job for job in jobs) == 2
    markdown = (sweep_dir / "summary.md").read_text()
    linear_part, conv_part = markdown.split("## conv=custom vs conv=torch")
    assert "## linear=custom vs linear=torch" in linear_part and "not a kernel comparison" in linear_part
    assert conv_part.count(" linear=torch` |") == 1 and conv_part.count(" linear=custom` |") == 1
    assert conv_part.count("100% of the FLOPs") == 2


def test_torch_fx_records_one_call_per_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, stride=2))
    ext.replace_convs(model)
    traced = torch.fx.symbolic_trace(model)
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert targets.count(ext.conv2d) == 2
    input = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(traced(input), model(input))


def test_torch_function_modes_see_ext_conv2d():
    input, weight = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with FunctionCalls() as log:
        output = ext.conv2d(input, weight, padding=1)
    assert log.functions == [ext.conv2d]
    torch.testing.assert_close(output, F.conv2d(input, weight, padding=1))


script_is_deprecated = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(script|save|load)` is deprecated:FutureWarning")

SCRIPTED_LAYERS = {  # nn.Conv2d's forms of the arguments, each as TorchScript sees them (constants of the module)
    "ints": dict(padding=1),
    "pairs": dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
    "same": dict(padding="same", dilation=2),
    "valid": dict(padding="valid"),
    "reflect": dict(padding=1, padding_mode="reflect"),
}


@script_is_deprecated
@pytest.mark.parametrize("layer", SCRIPTED_LAYERS)
def test_torch_jit_script_of_a_model_matches_eager(layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, **SCRIPTED_LAYERS[layer]), nn.ReLU(), nn.Conv2d(4, 2, 1)).double()
    ext.replace_convs(model)
    scripted = torch.jit.script(model)
    input = torch.randn(2, 3, 8, 9, dtype=torch.float64)
    for batch in (input, input[0]):  # and unbatched
        with OpLog() as log:
            output = scripted(batch)
        assert log.ops.count("ext.conv2d") == 2 and "aten.convolution" not in log.ops
        torch.testing.assert_close(output, model(batch), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(scripted(input).square().sum(), list(scripted.parameters()))
    expected = torch.autograd.grad(model(input).square().sum(), list(model.parameters()))
    torch.testing.assert_close(grads, expected, rtol=1e-12, atol=1e-12)


@script_is_deprecated
def test_scripted_conv2d_function_matches_f_conv2d():
    scripted = torch.jit.script(ext.conv2d)
    x, w, b = torch.randn(2, 3, 7, 8, dtype=torch.float64), torch.randn(4, 3, 3, 2, dtype=torch.float64), None
    for kwargs in (dict(), dict(stride=2, padding=[1, 0]), dict(padding="same", dilation=(2, 1)), dict(padding="valid")):
        for bias in (b, torch.randn(4, dtype=torch.float64)):
            torch.testing.assert_close(scripted(x, w, bias, **kwargs), F.conv2d(x, w, bias, **kwargs),
                                       rtol=1e-12, atol=1e-12)
    with pytest.raises(Exception, match="only groups=1 is supported"):
        scripted(x, w, None, groups=3)


# test_op's transforms of fn(input, weight, bias), each on a batch of images (per sample: one unbatched image)
CONV_TRANSFORMS = [name for name in TRANSFORMS if name != "grad of a 3-D input"]
CONV_TRANSFORM_ARGUMENTS = [dict(), dict(stride=2, padding=1), dict(padding=(2, 0), dilation=(1, 2)),
                            dict(padding="same"), dict(padding=1, images=0)]


@pytest.mark.parametrize("arguments", CONV_TRANSFORM_ARGUMENTS, ids=str)
@pytest.mark.parametrize("transform", CONV_TRANSFORMS)
def test_torch_func_transforms_match_f_conv2d(transform, arguments, vmap_needs_batching_rules):
    # The op's C++ autograd serves no transform: ext.conv2d runs as ext.linear (which does) on the input's patches.
    torch.manual_seed(0)
    arguments = dict(arguments)
    images = arguments.pop("images", 2)  # 0: an empty batch
    x, w, b = torch.randn(images, 3, 5, 6, dtype=torch.float64), torch.randn(4, 3, 3, 2, dtype=torch.float64), \
        torch.randn(4, dtype=torch.float64)

    def ours(x, w, b):
        return ext.conv2d(x, w, b, **arguments)

    def reference(x, w, b):
        return F.conv2d(x, w, b, **arguments)

    with OpLog() as log:
        result = TRANSFORMS[transform](ours, x, w, b)
    assert "aten.convolution" not in log.ops and "ext.linear" in log.ops
    try:
        expected = TRANSFORMS[transform](reference, x, w, b)
    except RuntimeError:  # torch's own rules refuse some transforms of an empty batch (per-sample grads, jacrev)
        assert images == 0
        assert all(leaf.count_nonzero() == 0 for leaf in torch.utils._pytree.tree_leaves(result))  # no image: all 0
        return
    torch.testing.assert_close(result, expected, rtol=1e-10, atol=1e-10)


def test_under_a_transform_the_output_keeps_f_conv2ds_layout():
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        for input in (dual, dual.contiguous()):
            output = torch.autograd.forward_ad.unpack_dual(ext.conv2d(input, w, padding=1)).primal
            expected = F.conv2d(input.detach(), w, padding=1)
            assert output.stride() == expected.stride()
            torch.testing.assert_close(output, expected)



@pytest.mark.parametrize("image, kwargs, message", [
    ((1, 4, 5, 5), dict(), "input has 4 channels but weight expects 3"),
    ((1, 3, 2, 2), dict(), "smaller than the kernel's reach"),
    ((1, 3, 5, 5), dict(padding=(-1, 0)), "padding must not be negative"),
    ((1, 3, 5, 5), dict(bias=torch.randn(2)), "bias must have shape [4]"),
])
def test_under_a_transform_refusals_are_the_ops_own_line(image, kwargs, message):
    w = torch.randn(4, 3, 3, 3)
    with pytest.raises(RuntimeError) as error:
        torch.func.grad(lambda w: ext.conv2d(torch.randn(image), w, **kwargs).sum())(w)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize("integer", [np.int64, torch.tensor], ids=["numpy", "0-d tensor"])
def test_integers_of_other_types_are_taken_as_f_conv2d_takes_them(integer):
    x, w = torch.randn(2, 3, 9, 11, dtype=torch.float64), torch.randn(4, 3, 3, 2, dtype=torch.float64)
    assert_matches_torch(x, w, stride=integer(2), padding=(integer(1), 2), dilation=[integer(2), 1],
                         groups=integer(1))
    if integer is torch.tensor:
        return  # nn.Conv2d itself refuses a tensor there
    ours, theirs = (module(3, 4, 3, stride=integer(2), padding=integer(1), dtype=torch.float64)
                    for module in (ext.Conv2d, nn.Conv2d))
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)


def test_flop_counter_counts_what_it_counts_for_f_conv2d():
    from torch.utils.flop_counter import FlopCounterMode
    x, w, b = torch.randn(2, 3, 9, 8), torch.randn(4, 3, 3, 2), torch.randn(4)
    counts = []
    for conv in (F.conv2d, ext.conv2d):
        with FlopCounterMode(display=False) as forward:
            conv(x, w, b, stride=2, padding=(1, 2), dilation=(1, 2))
        with FlopCounterMode(display=False) as step:
            conv(*with_grads(x, w, b), stride=2, padding=(1, 2), dilation=(1, 2)).sum().backward()
        counts.append((forward.get_total_flops(), step.get_total_flops()))
    assert counts[1] == counts[0] and counts[0][1] == 3 * counts[0][0] > 0
