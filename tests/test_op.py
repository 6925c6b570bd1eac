"""ext.linear and the torch.ops.ext ops against PyTorch: values, every gradient, the
F.linear contract, registrations (opcheck), errors and determinism."""
import gc
import math
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import ext
from conftest import OpLog, assert_within_rounding, num_threads


def edge_sizes(*edges):
    """Each size, one below and one above: where a tile or block ends."""
    return sorted({size + delta for size in edges for delta in (-1, 0, 1)} - {0})


def block_edges(key):
    """Every active path's size for key (ext.cpu_block_sizes), both dtypes."""
    path = torch.ops.ext.cpu_path()
    return {torch.ops.ext.cpu_block_sizes(path, dtype)[key] for dtype in ("float32", "float64")}


# Sizes around every register tile and cache block edge of the kernels this CPU runs (read from
# the extension, so they follow the kernels), plus 1, small primes and powers of two.
EDGE_SIZES = edge_sizes(2, 3, 7, 13, 32, 64, 128, *block_edges("wide_mr"), *block_edges("wide_nr"),
                        *block_edges("narrow_nr"), *block_edges("mc"), *block_edges("b_in_place_max_rows"))
K_SIZES = edge_sizes(2, 3, 7, 13, 32, 64, 128, *block_edges("kc"), *block_edges("max_single_k_block"))
LARGE_K = 3001  # prime, crosses several K blocks


def make_operands(M, N, K, dtype, bias=True, transposed_input=False, transposed_weight=False,
                  seed=0):
    generator = torch.Generator().manual_seed(seed)
    input = torch.randn(K, M, dtype=dtype, generator=generator).t() if transposed_input else \
        torch.randn(M, K, dtype=dtype, generator=generator)
    weight = torch.randn(K, N, dtype=dtype, generator=generator).t() if transposed_weight else \
        torch.randn(N, K, dtype=dtype, generator=generator)
    b = torch.randn(N, dtype=dtype, generator=generator) if bias else None
    return input, weight, b


def forward_and_grads(fn, input, weight, bias, grad_output):
    """fn's output and the gradients of (output * grad_output).sum() w.r.t. every operand."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (input, weight, bias)]
    output = fn(*leaves)
    output.backward(grad_output)
    return output.detach(), [t.grad if t is not None else None for t in leaves]


def check_against_torch(fn, reference_fn, input, weight, bias):
    """Forward and every gradient of fn against reference_fn computed in float64."""
    M, K = math.prod(input.shape[:-1]), input.shape[-1]  # rows after flattening, in-features
    N = weight.shape[0] if weight.dim() == 2 else 1
    grad_output = torch.randn(fn(input, weight, bias).shape, dtype=input.dtype, device=input.device)
    ours, our_grads = forward_and_grads(fn, input, weight, bias, grad_output)
    as64 = [t.double() if t is not None else None for t in (input, weight, bias)]
    expected, expected_grads = forward_and_grads(reference_fn, *as64, grad_output.double())
    # The op is linear in each operand, so the same computation on absolute values gives each
    # result's sum of |terms|: |X|·|W|ᵀ + |b|, |dY|·|W|, |dY|ᵀ·|X|, the column sums of |dY|.
    abs64 = [t.abs() if t is not None else None for t in as64]
    magnitude, grad_magnitudes = forward_and_grads(reference_fn, *abs64, grad_output.double().abs())
    assert ours.dtype == input.dtype and ours.shape == expected.shape
    assert_within_rounding(ours, expected, magnitude, K + 1)
    for got, want, size, reduction_len in zip(our_grads, expected_grads, grad_magnitudes, (N, M, M), strict=True):
        if want is not None:
            assert got is not None and got.shape == want.shape
            assert_within_rounding(got, want, size, reduction_len)


def torch_linear_relu(input, weight, bias):
    return torch.relu(F.linear(input, weight, bias))


# ---- property tests: random shapes around the tile edges, both dtypes, every layout ----

@given(M=st.sampled_from(EDGE_SIZES), N=st.sampled_from(EDGE_SIZES), K=st.sampled_from(K_SIZES),
       dtype=st.sampled_from([torch.float32, torch.float64]), bias=st.booleans(),
       transposed_input=st.booleans(), transposed_weight=st.booleans(), relu=st.booleans())
def test_matches_torch_on_random_shapes(M, N, K, dtype, bias, transposed_input, transposed_weight,
                                        relu):
    operands = make_operands(M, N, K, dtype, bias, transposed_input, transposed_weight)
    if relu:
        check_linear_relu_against_torch(*operands)
    else:
        check_against_torch(ext.linear, F.linear, *operands)


def check_linear_relu_against_torch(input, weight, bias):
    """The forward against relu(F.linear); the gradients with ReLU's mask taken from our own
    output, because rounding may flip the sign of a pre-activation within rounding of 0."""
    ours = ext.linear_relu(input, weight, bias)
    as64 = [t.double() if t is not None else None for t in (input, weight, bias)]
    magnitude = F.linear(*[t.abs() if t is not None else None for t in as64])
    assert_within_rounding(ours, torch_linear_relu(*as64), magnitude, input.shape[-1] + 1)
    mask = (ours > 0).double()
    check_against_torch(ext.linear_relu, lambda x, w, b: F.linear(x, w, b) * mask, input, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("M,N", [(1, 1), (7, 17), (65, 33)])
def test_matches_torch_with_large_k(M, N, dtype):
    check_against_torch(ext.linear, F.linear, *make_operands(M, N, LARGE_K, dtype))


# ---- the F.linear contract: every input shape F.linear accepts ----


CONTRACT_CASES = {
    "1-D input": ((7,), (5, 7), True),
    "1-D input, no bias": ((7,), (5, 7), False),
    "3-D input": ((2, 3, 7), (5, 7), True),
    "4-D input": ((2, 1, 3, 7), (5, 7), True),
    "empty batch": ((0, 7), (5, 7), True),
    "empty leading dim": ((2, 0, 7), (5, 7), True),
    "zero in-features": ((4, 0), (5, 0), True),
    "zero in-features, 3-D": ((2, 3, 0), (5, 0), False),
    "zero out-features": ((4, 7), (0, 7), True),
    "1-D weight": ((3, 7), (7,), False),
    "1-D input and weight": ((7,), (7,), False),
}


@pytest.mark.parametrize("case", CONTRACT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_f_linear_contract(case, dtype):
    input_shape, weight_shape, has_bias = CONTRACT_CASES[case]
    input = torch.randn(input_shape, dtype=dtype)
    weight = torch.randn(weight_shape, dtype=dtype)
    bias = torch.randn(weight_shape[0], dtype=dtype) if has_bias else None
    check_against_torch(ext.linear, F.linear, input, weight, bias)


@pytest.mark.parametrize("bias_shape", [(), (1,)])
def test_one_element_bias_broadcasts_like_f_linear(bias_shape):
    input, weight = torch.randn(4, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    check_against_torch(ext.linear, F.linear, input, weight, torch.randn(bias_shape, dtype=torch.float64))


# (input, bias) shapes with weight (5, 7): biases F.linear broadcasts to the output
BROADCAST_BIASES = [((4, 7), (1, 5)), ((4, 7), (4, 5)), ((4, 7), (1, 1)), ((2, 4, 7), (1, 5)), ((2, 4, 7), (4, 5)),
                    ((7,), (1, 5)), ((0, 7), (1, 5))]


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
@pytest.mark.parametrize("input_shape, bias_shape", BROADCAST_BIASES, ids=str)
def test_biases_that_broadcast_like_f_linear(fn, reference, input_shape, bias_shape):
    input, weight = torch.randn(input_shape, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    check_against_torch(fn, reference, input, weight, torch.randn(bias_shape, dtype=torch.float64))


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
@pytest.mark.parametrize("bias_shape", [(1, 5), (4, 5)], ids=str)
def test_meta_tensors_with_a_broadcast_bias_give_f_linears_shape(fn, reference, bias_shape):
    # autocast has no meta device: asking whether it is on for one raised "unknown device type"
    input, weight, bias = (torch.empty(shape, device="meta") for shape in ((4, 7), (5, 7), bias_shape))
    assert fn(input, weight, bias).shape == reference(input, weight, bias).shape == (4, 5)


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
@pytest.mark.parametrize("bias_shape", [(1, 5), (4, 5)], ids=str)
def test_under_cpu_autocast_a_broadcast_bias_of_any_float_dtype_is_cast_as_f_linears(fn, reference, bias_shape):
    input, weight = torch.randn(4, 7), torch.randn(5, 7)
    for bias in (torch.randn(bias_shape).bfloat16(), torch.randn(bias_shape, dtype=torch.float64)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = fn(input.bfloat16(), weight, bias)
        assert output.dtype == torch.float32  # our op runs float32 under CPU autocast
        expected = reference(input.bfloat16().float(), weight, bias.float())  # every operand as float32
        torch.testing.assert_close(output, expected)


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
@pytest.mark.parametrize("layout, component_shapes", [
    (torch.jagged, [(2, 7), (5, 7), (1, 7)]),
    (torch.jagged, [(2, 3, 7), (4, 3, 7)]),  # more dimensions after the ragged one
    (torch.strided, [(2, 7), (5, 7)]),
], ids=str)
def test_nested_inputs_like_f_linear(fn, reference, layout, component_shapes):
    """nn.Linear takes nested tensors (variable-length sequences); so do we: values and every
    gradient against torch's, in float64."""
    components = [torch.randn(shape, dtype=torch.float64) for shape in component_shapes]
    weight = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    grad_outputs = None
    results = []
    for linear in (fn, reference):
        input = torch.nested.nested_tensor(components, layout=layout, requires_grad=True)
        output = linear(input, weight, bias)
        assert output.is_nested and output.layout == layout
        outputs = output.unbind()
        grad_outputs = grad_outputs or [torch.randn_like(out) for out in outputs]
        loss = sum((out * grad).sum() for out, grad in zip(outputs, grad_outputs, strict=True))
        grads = torch.autograd.grad(loss, (input, weight, bias))
        results.append((outputs, grads[0].unbind(), grads[1:]))
    (ours, our_input_grads, our_grads), (theirs, their_input_grads, their_grads) = results
    for a, b in zip([*ours, *our_input_grads, *our_grads], [*theirs, *their_input_grads, *their_grads], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_nested_input_of_1d_components_is_not_taken_for_a_2d_input():
    # Its dim() is 2, as a plain 2-D input's; torch's F.linear refuses it, ours maps each component.
    components = _floats((7,), (7,), dtype=torch.float64)
    weight, bias = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    output = ext.linear(torch.nested.nested_tensor(components), weight, bias)
    assert output.is_nested
    for out, component in zip(output.unbind(), components, strict=True):
        torch.testing.assert_close(out, F.linear(component, weight, bias), rtol=1e-12, atol=1e-12)


def test_jagged_output_keeps_the_input_structure():
    """A jagged output shares the input's offsets, so it adds to tensors of the same structure
    (a residual connection), as F.linear's does."""
    input = torch.nested.nested_tensor(_floats((2, 7), (5, 7)), layout=torch.jagged)
    output = ext.linear(input, torch.randn(7, 7))
    assert output.shape == input.shape and (output + input).shape == input.shape
    assert output.offsets() is input.offsets()


def test_non_contiguous_views():
    input = torch.randn(2, 9, 20, dtype=torch.float64)[:, ::2, 1:15:2]  # (2, 5, 7), strided
    weight = torch.randn(7, 12, dtype=torch.float64)[:, ::2].t()  # (6, 7), transposed and strided
    bias = torch.randn(12, dtype=torch.float64)[::2]
    assert not (input.is_contiguous() or weight.is_contiguous() or bias.is_contiguous())
    check_against_torch(ext.linear, F.linear, input, weight, bias)


# ---- autograd ----

@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (3, 5, 7), (17, 6, 16), (2, 3, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(fn, M, N, K, bias):
    input, weight, b = make_operands(M, N, K, torch.float64, bias)
    operands = [t.requires_grad_() for t in (input, weight, b) if t is not None]
    assert torch.autograd.gradcheck(lambda *args: fn(*args), operands)


@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_gradgradcheck(fn, bias):
    # create_graph=True builds the gradients from ext ops too, so second derivatives work
    input, weight, b = make_operands(5, 4, 3, torch.float64, bias)
    operands = [t.requires_grad_() for t in (input, weight, b) if t is not None]
    assert torch.autograd.gradgradcheck(lambda *args: fn(*args), operands)


# The backward products as ops of their own, each with torch's expression for it and its operands' shapes
# from (M, N, K): dX = dY·W, dW = dYᵀ·X, db = dY's column sums.
BACKWARD_OPS = {
    "linear_backward_input": (lambda dy, w: dy @ w, lambda M, N, K: [(M, N), (N, K)]),
    "linear_backward_weight": (lambda dy, x: dy.t() @ x, lambda M, N, K: [(M, N), (M, K)]),
    "linear_backward_bias": (lambda dy: dy.sum(0), lambda M, N, K: [(M, N)]),
}


def _backward_op_operands(op, M, N, K, dtype):
    generator = torch.Generator().manual_seed(M * 10007 + N * 101 + K)
    return [torch.randn(shape, dtype=dtype, generator=generator) for shape in BACKWARD_OPS[op][1](M, N, K)]


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (3, 5, 7), (17, 6, 16), (2, 3, 0)])
def test_backward_ops_are_differentiable(op, M, N, K):
    # Without an autograd kernel of their own, torch's fallback gave their operands zero gradients (with
    # only a warning); now each is recorded through ext.linear (autograd.cpp), twice differentiable.
    operands = [t.requires_grad_() for t in _backward_op_operands(op, M, N, K, torch.float64)]
    fn = getattr(torch.ops.ext, op)
    assert torch.autograd.gradcheck(fn, operands)
    assert torch.autograd.gradgradcheck(fn, operands)


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (13, 7, 130), (130, 33, 50), (64, 10, 257)])
def test_backward_ops_gradients_match_torch_in_float32(op, M, N, K):
    fn, reference = getattr(torch.ops.ext, op), BACKWARD_OPS[op][0]
    operands = _backward_op_operands(op, M, N, K, torch.float32)
    grad_output = torch.randn(reference(*operands).shape)

    def output_and_grads(f, tensors, upstream):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        output = f(*leaves)
        output.backward(upstream)
        return output.detach(), [t.grad for t in leaves]

    ours, our_grads = output_and_grads(fn, operands, grad_output)
    as64 = [t.double() for t in operands]
    expected, expected_grads = output_and_grads(reference, as64, grad_output.double())
    # Each is linear in each operand: the same on absolute values bounds every result's sum of |terms|.
    magnitude, grad_magnitudes = output_and_grads(reference, [t.abs() for t in as64], grad_output.double().abs())
    terms = max(M, N, K) + 1
    assert_within_rounding(ours, expected, magnitude, terms)
    for got, want, size in zip(our_grads, expected_grads, grad_magnitudes, strict=True):
        assert got.dtype == torch.float32
        assert_within_rounding(got, want, size, terms)


def test_forward_mode_ad_through_the_op_still_refuses():
    # A call that needs no graph runs below autograd (autograd.cpp); a forward-mode tangent still counts as
    # needing one, so the op says it has no jvp rather than dropping the tangent.
    input, weight, bias = make_operands(3, 5, 4, torch.float64)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(input, torch.ones_like(input))
        with pytest.raises(RuntimeError, match="jvp is not implemented"):
            torch.ops.ext.linear(dual, weight, bias)


@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
def test_autograd_never_enters_python(fn):
    # The autograd kernel is C++: a Python one costs ~10 µs per layer per step, as much as a small GEMM.
    input, weight, bias = (t.requires_grad_() for t in make_operands(8, 6, 5, torch.float32))
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code) if event == "call" else None)
    try:
        output = torch.ops.ext.linear_relu(input, weight, bias) if fn is ext.linear_relu else \
            torch.ops.ext.linear.default(input, weight, bias)
        torch.autograd.backward(output, torch.ones_like(output))
    finally:
        sys.setprofile(None)
    # a Python autograd kernel would run ext/ops.py's backward through torch/_library's wrappers
    entered = {code.co_filename for code in calls}
    assert [f for f in entered if "/ext/" in f or "/torch/_library/" in f or "autograd/function.py" in f] == []
    assert type(output.grad_fn).__name__ != "BackwardCFunction"  # what a Python autograd.Function records
    assert all(t.grad is not None for t in (input, weight, bias))


def test_gradcheck_n_d_input():
    input = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ext.linear, (input, weight, None))


@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
@pytest.mark.parametrize("wanted,expected_ops", [
    ("input", {"ext.linear_backward_input"}),
    ("weight", {"ext.linear_backward_weight"}),
    ("bias", {"ext.linear_backward_bias"}),
    ("all", {"ext.linear_backward_input", "ext.linear_backward_weight", "ext.linear_backward_bias"}),
])
def test_backward_computes_only_needed_grads(fn, wanted, expected_ops):
    input, weight, bias = make_operands(4, 3, 5, torch.float32)
    for name, tensor in zip(("input", "weight", "bias"), (input, weight, bias), strict=True):
        tensor.requires_grad_(wanted in (name, "all"))
    output = fn(input, weight, bias)
    with OpLog() as log:
        output.sum().backward()
    assert {op for op in log.ops if op.startswith("ext.")} == expected_ops


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, lambda *a: F.linear(*a).relu())],
                         ids=["linear", "linear_relu"])
@pytest.mark.parametrize("input_shape", [(7, 5), (2, 3, 5), (5,)], ids=str)
@pytest.mark.parametrize("wanted", ["all", "input", "weight"])
def test_flop_counter_counts_what_it_counts_for_f_linear(fn, reference, input_shape, wanted):
    from torch.utils.flop_counter import FlopCounterMode
    counts = []
    for linear in (reference, fn):
        input, weight, bias = torch.randn(input_shape), torch.randn(4, 5), torch.randn(4)
        input.requires_grad_(wanted in ("input", "all"))
        weight.requires_grad_(wanted in ("weight", "all"))
        with FlopCounterMode(display=False) as step:
            linear(input, weight, bias).sum().backward()
        counts.append(step.get_total_flops())
    flops = 2 * math.prod(input_shape) * 4
    assert counts == [counts[0]] * 2 and counts[0] == flops * (3 if wanted == "all" else 2)


def test_relu_gradient_is_zero_where_output_is_not_positive():
    # Rows chosen so that pre-activations are exactly 0, negative and positive.
    input = torch.tensor([[1.0, -1.0], [2.0, 1.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    output, grads = forward_and_grads(ext.linear_relu, input, weight, None, torch.ones(3, 1, dtype=torch.float64))
    expected, expected_grads = forward_and_grads(torch_linear_relu, input, weight, None, torch.ones(3, 1, dtype=torch.float64))
    assert torch.equal(output, expected)
    for got, want in zip(grads[:2], expected_grads[:2], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
def test_graph_is_freed_without_the_garbage_collector(fn):
    input, weight, bias = make_operands(4, 3, 5, torch.float32)
    gc.disable()
    try:
        output = fn(input, weight.requires_grad_(), bias)
        freed = weakref.ref(output)
        del output
        assert freed() is None  # no reference cycle through the autograd graph
    finally:
        gc.enable()


def test_relu_gradient_at_nan_outputs_matches_torch():
    input = torch.tensor([[float("nan"), 1.0], [1.0, 2.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 1.0], [-1.0, 0.5]], dtype=torch.float64)
    grad_output = torch.ones(2, 2, dtype=torch.float64)
    ours = forward_and_grads(ext.linear_relu, input, weight, None, grad_output)
    expected = forward_and_grads(torch_linear_relu, input, weight, None, grad_output)
    torch.testing.assert_close(ours[0], expected[0], equal_nan=True)
    # torch masks where output <= 0, so a NaN output passes its gradient through: into the input's gradient,
    # and into the weight's through the NaN input column
    torch.testing.assert_close(ours[1][0], expected[1][0], equal_nan=True)
    torch.testing.assert_close(ours[1][1], expected[1][1], equal_nan=True)


# ---- torch.func transforms and forward-mode AD ----

def _forward_ad_tangent(fn, input, weight, bias):
    with torch.autograd.forward_ad.dual_level():
        dual_input = torch.autograd.forward_ad.make_dual(input, torch.ones_like(input))
        dual_weight = torch.autograd.forward_ad.make_dual(weight, weight.flip(0))
        dual_bias = torch.autograd.forward_ad.make_dual(bias, torch.full_like(bias, 0.5))
        return torch.autograd.forward_ad.unpack_dual(fn(dual_input, dual_weight, dual_bias)).tangent


TRANSFORMS = {  # fn(input, weight, bias) -> what the transform computes through fn
    "grad": lambda fn, x, w, b: torch.func.grad(lambda x, w, b: fn(x, w, b).square().sum(), argnums=(0, 1, 2))(x, w, b),
    "vmap over inputs": lambda fn, x, w, b: torch.func.vmap(lambda x: fn(x, w, b))(torch.stack([x, 2 * x, -x])),
    "vmap over weights": lambda fn, x, w, b: torch.func.vmap(lambda w, b: fn(x, w, b))(torch.stack([w, -w]),
                                                                                        torch.stack([b, 3 * b])),
    "per-sample grads": lambda fn, x, w, b: torch.func.vmap(
        torch.func.grad(lambda w, b, row: fn(row, w, b).square().sum(), argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x),
    "jacrev": lambda fn, x, w, b: torch.func.jacrev(fn, argnums=(0, 1, 2))(x, w, b),
    "jacfwd": lambda fn, x, w, b: torch.func.jacfwd(fn, argnums=(0, 1, 2))(x, w, b),
    "hessian": lambda fn, x, w, b: torch.func.hessian(lambda w: fn(x, w, b).square().sum())(w),
    "grad of a 3-D input": lambda fn, x, w, b: torch.func.grad(lambda x: fn(x, w, b).sum())(x.unsqueeze(1)),
    "forward-mode AD": _forward_ad_tangent,
    "jvp of the input alone": lambda fn, x, w, b: torch.func.jvp(lambda x: fn(x, w, b), (x,), (x.flip(0),)),
    "jvp of the bias alone": lambda fn, x, w, b: torch.func.jvp(lambda b: fn(x, w, b), (b,), (torch.ones_like(b),)),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
def test_torch_func_transforms_match_f_linear(fn, reference, transform, vmap_needs_batching_rules):
    # The ops' C++ autograd has no jvp and no functorch support: ext.linear switches to a
    # Python autograd.Function (same kernels) while a transform or a dual level is active.
    input, weight, bias = make_operands(5, 4, 3, torch.float64)
    ours, theirs = TRANSFORMS[transform](fn, input, weight, bias), TRANSFORMS[transform](reference, input, weight, bias)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn, reference", [(ext.linear, F.linear), (ext.linear_relu, torch_linear_relu)],
                         ids=["linear", "linear_relu"])
def test_vmap_over_no_samples_gives_an_empty_result_as_f_linear(fn, reference, vmap_needs_batching_rules):
    input, weights, biases = torch.randn(3, 4), torch.randn(0, 5, 4), torch.randn(0, 5)
    # per-sample weights (one product per sample: none here), with and without per-sample biases
    expected = torch.func.vmap(lambda w, b: reference(input, w, b))(weights, biases)
    assert torch.func.vmap(lambda w, b: fn(input, w, b))(weights, biases).shape == expected.shape == (0, 3, 5)
    assert torch.func.vmap(lambda w: fn(input, w))(weights).shape == (0, 3, 5)


@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
def test_plain_calls_keep_the_cpp_autograd(fn):
    input, weight, bias = (t.requires_grad_() for t in make_operands(8, 6, 5, torch.float32))
    assert type(fn(input, weight, bias).grad_fn).__name__ != "BackwardCFunction"  # not the Python fallback


# ---- registrations ----

OPCHECK_SHAPES = [(1, 1, 1), (5, 7, 3), (17, 16, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("M,N,K", OPCHECK_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_opcheck(dtype, M, N, K, layout):
    transposed = layout == "transposed"
    input, weight, bias = make_operands(M, N, K, dtype, True, transposed, transposed)
    grad_output = torch.randn(N, M, dtype=dtype).t() if transposed else torch.randn(M, N, dtype=dtype)
    input.requires_grad_()
    weight.requires_grad_()
    calls = [
        (torch.ops.ext.linear.default, (input, weight, bias)),
        (torch.ops.ext.linear.default, (input, weight, None)),
        (torch.ops.ext.linear_relu.default, (input, weight, bias)),
        (torch.ops.ext.linear_backward_input.default, (grad_output, weight.detach())),
        (torch.ops.ext.linear_backward_weight.default, (grad_output, input.detach())),
        (torch.ops.ext.linear_backward_bias.default, (grad_output,)),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args)


def test_meta_tensors_get_shapes_and_shape_errors():
    output = ext.linear(torch.empty(2, 3, 7, device="meta"), torch.empty(5, 7, device="meta"))
    assert output.shape == (2, 3, 5) and output.device.type == "meta"
    with pytest.raises(RuntimeError, match="input has 7 features but weight expects 6"):
        ext.linear_relu(torch.empty(4, 7, device="meta"), torch.empty(5, 6, device="meta"))


def test_backward_ops_match_their_definitions():
    grad_output, weight, input = (torch.randn(*shape, dtype=torch.float64) for shape in [(5, 3), (3, 7), (5, 7)])
    torch.testing.assert_close(torch.ops.ext.linear_backward_input(grad_output, weight), grad_output @ weight)
    torch.testing.assert_close(torch.ops.ext.linear_backward_weight(grad_output, input), grad_output.t() @ input)
    torch.testing.assert_close(torch.ops.ext.linear_backward_bias(grad_output), grad_output.sum(0))


# ---- the direct calls: ext._calls, which ext.linear makes in eager mode ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (5, 7, 3), (17, 16, 33), (129, 65, 385)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_direct_calls_give_the_ops_results_bit_for_bit(dtype, M, N, K, layout):
    transposed = layout == "transposed"
    input, weight, bias = make_operands(M, N, K, dtype, True, transposed, transposed)
    grad_output = torch.randn(N, M, dtype=dtype).t() if transposed else torch.randn(M, N, dtype=dtype)
    ops, calls = torch.ops.ext, ext._calls
    pairs = [(calls.linear(input, weight, bias), ops.linear(input, weight, bias)),
             (calls.linear(input, weight, None), ops.linear(input, weight, None)),
             (calls.linear_relu(input, weight, bias), ops.linear_relu(input, weight, bias)),
             (calls.linear_backward_input(grad_output, weight), ops.linear_backward_input(grad_output, weight)),
             (calls.linear_backward_weight(grad_output, input), ops.linear_backward_weight(grad_output, input)),
             (calls.linear_backward_bias(grad_output), ops.linear_backward_bias(grad_output))]
    for direct, through_torch_ops in pairs:
        assert direct.dtype == dtype and torch.equal(direct, through_torch_ops)


@pytest.mark.parametrize("call", [ext._calls.linear, ext._calls.linear_relu], ids=["linear", "linear_relu"])
@pytest.mark.parametrize("args", [
    (torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)),  # leading dimensions
    (torch.randn(4), torch.randn(5, 4), None),  # 1-D input
    (torch.randn(3, 4), torch.randn(4), None),  # 1-D weight
    (torch.randn(3, 4), torch.randn(5, 4), torch.randn(1, 5)),  # a bias to broadcast
    (torch.randn(3, 4), torch.randn(5, 4), torch.randn(1)),  # a one-element bias
    (torch.randn(3, 4), torch.randn(5, 4), torch.randn(6)),  # a bias of the wrong length: ext.linear says so
    (torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)]), torch.randn(5, 4), None),
    ([[1.0] * 4], torch.randn(5, 4), None),  # not tensors: ext.linear says so
    (torch.randn(3, 4), torch.randn(5, 4), 1.0),
], ids=["3-D input", "1-D input", "1-D weight", "bias 1xN", "one-element bias", "bias of 6", "nested", "list",
        "float bias"])
def test_direct_linear_declines_all_but_2d_tensors(call, args):
    # None sends ext.linear to its general path, which gives the call F.linear's meaning or a clear error
    assert call(*args) is None


@pytest.mark.parametrize("fn, call", [(ext.linear, "linear"), (ext.linear_relu, "linear_relu")],
                         ids=["linear", "linear_relu"])
def test_eager_calls_go_through_the_direct_call(fn, call, monkeypatch):
    made = []

    def spy(*args):
        made.append(args)
        return getattr(ext._calls, call)(*args)

    monkeypatch.setattr(ext.ops, "_calls", type("Spy", (), {call: staticmethod(spy)}))
    input, weight, bias = make_operands(6, 5, 4, torch.float32)
    assert torch.equal(fn(input, weight, bias), getattr(torch.ops.ext, call)(input, weight, bias))
    assert len(made) == 1
    assert fn(input.unsqueeze(0), weight, bias).shape == (1, 6, 5)  # declined, then the general path's
    assert len(made) == 2


def test_direct_calls_go_through_the_dispatcher():
    # Dispatch modes (profilers, FlopCounterMode, FakeTensor) and autograd see the op as through torch.ops.ext
    input, weight, bias = (t.requires_grad_() for t in make_operands(6, 5, 4, torch.float32))
    with OpLog() as log:
        output = ext._calls.linear(input, weight, bias)
    assert log.ops == ["ext.linear"]
    assert output.grad_fn is not None and type(output.grad_fn).__name__ != "BackwardCFunction"
    input, weight = input.detach(), weight.detach()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = ext.linear(mode.from_tensor(input), mode.from_tensor(weight), None)
    assert fake.shape == (6, 5)
    with pytest.raises(RuntimeError, match="grad_output shape \\[6, 4\\] does not match weight shape \\[5, 4\\]") as error:
        ext._calls.linear_backward_input(input, weight)
    assert "Exception raised from" not in str(error.value)  # the op's own message, without C++'s backtrace


# ---- determinism ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_identical_across_runs_and_thread_counts(dtype):
    input, weight, bias = make_operands(129, 65, 385, dtype)
    grad_output = torch.randn(129, 65, dtype=dtype)
    first = forward_and_grads(ext.linear, input, weight, bias, grad_output)
    for count in (torch.get_num_threads(), 1):
        with num_threads(count):
            again = forward_and_grads(ext.linear, input, weight, bias, grad_output)
        assert torch.equal(again[0], first[0])
        assert all(torch.equal(a, b) for a, b in zip(again[1], first[1], strict=True))


# (batch, out, in): each product is 2·batch·out·in flops, on either side of gemm.h's
# kParallelMinFlops (5e5), below which dX and dW run one after the other.
@pytest.mark.parametrize("shape, threads_used_of_two", [((128, 64, 64), 2), ((64, 48, 40), 1)],
                         ids=["1.05 Mflop", "0.25 Mflop"])
@pytest.mark.parametrize("fn", [ext.linear, ext.linear_relu], ids=["linear", "linear_relu"])
def test_dx_and_dw_run_side_by_side_on_two_threads_when_big_enough(fn, shape, threads_used_of_two):
    input, weight, bias = (t.requires_grad_() for t in make_operands(*shape, torch.float32))
    for count, expected_threads in ((2, threads_used_of_two), (1, 1)):
        with num_threads(count), torch.profiler.profile() as profile:
            output = fn(input, weight, bias)
            output.backward(torch.ones_like(output))
        backward_names = ("ext::linear_backward", "ext::linear_relu_backward")
        names = [event.name for event in profile.events() if event.name.startswith(backward_names)]
        # Each product profiled once, under its op's name; with the ReLU, db is summed in the pass
        # that applies ReLU's mask to dY, before the products (autograd.cpp).
        bias_pass = "ext::linear_relu_backward_mask" if fn is ext.linear_relu else "ext::linear_backward_bias"
        assert sorted(names) == sorted([bias_pass, "ext::linear_backward_input", "ext::linear_backward_weight"])
        thread_of = {event.name: event.thread for event in profile.events() if event.name.startswith("ext::")}
        ran_on = {thread_of["ext::linear_backward_input"], thread_of["ext::linear_backward_weight"]}
        assert len(ran_on) == expected_threads
        # db rides with dX, the faster of the two products (autograd.cpp), or before both.
        assert thread_of[bias_pass] == thread_of["ext::linear_backward_input"]


# ---- errors: one clear message per mistake ----

def _floats(*shapes, dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype) for shape in shapes]


ERROR_CASES = {
    "int dtype": (lambda: ext.linear(torch.ones(2, 3, dtype=torch.int32), torch.ones(4, 3, dtype=torch.int32)),
                  RuntimeError, "dtype Int is not supported on the CPU; use float32 or float64"),
    "half on CPU": (lambda: ext.linear(*_floats((2, 3), (4, 3), dtype=torch.float16)),
                    RuntimeError, "dtype Half is not supported on the CPU"),
    "mixed dtypes": (lambda: ext.linear(torch.randn(2, 3), torch.randn(4, 3, dtype=torch.float64)),
                     RuntimeError, "input is Float but weight is Double; cast both to the same dtype"),
    "bias dtype": (lambda: ext.linear(*_floats((2, 3), (4, 3)), torch.randn(4, dtype=torch.float64)),
                   RuntimeError, "bias is Double but weight is Float"),
    "feature mismatch": (lambda: ext.linear(*_floats((2, 3), (4, 5))),
                         RuntimeError, "input has 3 features but weight expects 5"),
    "feature mismatch, 3-D": (lambda: ext.linear(*_floats((6, 2, 3), (4, 5))),
                              RuntimeError, "input has 3 features but weight expects 5 (input shape [6, 2, 3], "
                                            "weight shape [4, 5])"),  # the caller's shapes, not the flattened ones
    "feature mismatch, 1-D weight": (lambda: ext.linear(*_floats((6, 2, 3), (5,))),
                                     RuntimeError, "input has 3 features but weight expects 5 (input shape "
                                                   "[6, 2, 3], weight shape [5])"),
    "bias shape, 3-D": (lambda: ext.linear(*_floats((6, 2, 3), (4, 3), (5,))),
                        RuntimeError, "bias of shape [5] does not broadcast to the output's shape [6, 2, 4]"),
    "bias shape": (lambda: ext.linear(*_floats((2, 3), (4, 3), (5,))),
                   RuntimeError, "bias of shape [5] does not broadcast to the output's shape [2, 4]; give it shape [4]"),
    "bias shape, 2-D": (lambda: ext.linear(*_floats((2, 3), (4, 3), (3, 4))),
                        RuntimeError, "bias of shape [3, 4] does not broadcast to the output's shape [2, 4]"),
    "3-D weight": (lambda: ext.linear(*_floats((2, 3), (4, 3, 1))),
                   RuntimeError, "weight must be 2-D (out_features x in_features) or 1-D"),
    "input not a tensor": (lambda: ext.linear([[1.0, 2.0]], torch.randn(3, 2)),
                           TypeError, "ext.linear: input must be a torch.Tensor, got list"),
    "bias not a tensor": (lambda: ext.linear(*_floats((4, 2), (3, 2)), 1.0),
                          TypeError, "ext.linear: bias must be a torch.Tensor or None, got float"),
    "0-D input": (lambda: ext.linear(torch.tensor(1.0), torch.randn(4, 1)),
                  RuntimeError, "input and weight must be at least 1-D"),
    "op given 3-D input": (lambda: torch.ops.ext.linear(*_floats((2, 2, 3), (4, 3)), None),
                           RuntimeError, "input must be 2-D (batch x in_features), got shape [2, 2, 3]"),
    "backward_input shapes": (lambda: torch.ops.ext.linear_backward_input(*_floats((2, 4), (5, 3))),
                              RuntimeError, "grad_output shape [2, 4] does not match weight shape [5, 3]"),
    "backward_weight shapes": (lambda: torch.ops.ext.linear_backward_weight(*_floats((2, 4), (3, 3))),
                               RuntimeError, "grad_output shape [2, 4] does not match input shape [3, 3]"),
    "backward_bias 1-D": (lambda: torch.ops.ext.linear_backward_bias(torch.randn(4)),
                          RuntimeError, "grad_output must be 2-D"),
    # Dense GEMM kernels: other layouts are named, with how to make them dense (F.linear takes some)
    "sparse COO input": (lambda: ext.linear(torch.randn(2, 3).to_sparse(), torch.randn(4, 3)),
                         RuntimeError, "ext.linear: input's layout is Sparse, not Strided; its kernels take dense "
                                       "(strided) tensors: pass input.to_dense()"),
    "sparse CSR weight": (lambda: ext.linear_relu(torch.randn(2, 3), torch.randn(4, 3).to_sparse_csr()),
                          RuntimeError, "ext.linear_relu: weight's layout is SparseCsr, not Strided"),
    "sparse input requiring grad": (lambda: ext.linear(torch.randn(2, 3).to_sparse().requires_grad_(),
                                                       torch.randn(4, 3, requires_grad=True)),
                                    RuntimeError, "input's layout is Sparse, not Strided"),
    "sparse grad_output": (lambda: torch.ops.ext.linear_backward_weight(torch.randn(2, 4).to_sparse(),
                                                                        torch.randn(2, 3)),
                           RuntimeError, "ext.linear_backward_weight: grad_output's layout is Sparse"),
    "mkldnn input": (lambda: ext.linear(torch.randn(2, 3).to_mkldnn(), torch.randn(4, 3)),
                     RuntimeError, "input's layout is Mkldnn, not Strided; its kernels take dense (strided) "
                                   "tensors: pass input.to_dense()"),
    "quantized input": (lambda: ext.linear(torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.qint8),
                                           torch.randn(4, 3)),
                        RuntimeError, "input is a quantized tensor (QInt8); its kernels take float tensors: "
                                      "pass input.dequantize()"),
    "nested, feature mismatch": (lambda: ext.linear(torch.nested.nested_tensor(_floats((2, 5), (3, 5)),
                                                                               layout=torch.jagged),
                                                    torch.randn(4, 3)),
                                 RuntimeError, "but weight expects 3 features in every component"),
    "unknown cpu path": (lambda: torch.ops.ext.set_cpu_path("sse9"),
                         RuntimeError, "unknown path 'sse9'; use 'portable', 'avx2+fma' or 'avx512'"),
    # A meta tensor among CPU ones sends the call to the fake kernel, whose result would be uninitialised
    "meta bias, cpu input": (lambda: ext.linear(torch.ones(2, 3), torch.ones(5, 3), torch.ones(5, device="meta")),
                             RuntimeError, "ext.linear: bias is on meta but input is on cpu; move them to the same "
                                           "device"),
    "meta weight of a module": (lambda: ext.Linear(3, 5, device="meta")(torch.ones(2, 3)),
                                RuntimeError, "weight is on meta but input is on cpu"),
    "meta weight, backward": (lambda: torch.ops.ext.linear_backward_input(torch.ones(2, 4),
                                                                          torch.ones(4, 3, device="meta")),
                              RuntimeError, "ext.linear_backward_input: weight is on meta but grad_output is on cpu"),
    "integer meta tensors": (lambda: ext.linear(torch.empty(2, 3, dtype=torch.int64, device="meta"),
                                                torch.empty(4, 3, dtype=torch.int64, device="meta")),
                             RuntimeError, "ext.linear: dtype torch.int64 is not supported"),
    # F.linear refuses a bias of another dtype; adding one that broadcasts would promote the output
    "broadcast bias of another dtype": (lambda: ext.linear(torch.randn(2, 3), torch.randn(5, 3),
                                                           torch.randn(1, 5, dtype=torch.float64)),
                                        RuntimeError, "ext.linear: bias is torch.float64 on cpu but input is "
                                                      "torch.float32 on cpu"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_raises_clear_error(case):
    call, error_type, message = ERROR_CASES[case]
    with pytest.raises(error_type) as info:
        call()
    assert message in str(info.value)
    assert len(str(info.value).splitlines()) <= 2  # one clear message, not a C++ backtrace


@pytest.mark.skipif(ext.build_manifest["cuda"]["enabled"], reason="this build has CUDA kernels")
@pytest.mark.parametrize("op", ["linear", "linear_relu", "linear_backward_input", "linear_backward_weight",
                                "linear_backward_bias"])
def test_cuda_tensor_on_cpu_only_build_says_how_to_rebuild(op):
    # Reach the CUDA kernel without a GPU: redispatch CPU tensors to the CUDA key.
    cuda_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    packet = getattr(torch.ops.ext, op)
    args = {"linear": (*_floats((2, 3), (4, 3)), None), "linear_relu": (*_floats((2, 3), (4, 3)), None),
            "linear_backward_input": _floats((2, 4), (4, 3)), "linear_backward_weight": _floats((2, 4), (2, 3)),
            "linear_backward_bias": _floats((2, 4))}[op]
    with pytest.raises(RuntimeError, match="no CUDA kernels.*LINEAR_LAB_CUDA=1 python -m ext"):
        packet.default.redispatch(cuda_only, *args)


# ---- CUDA (needs a GPU): the op's registrations and errors; the kernels' numbers are in test_cuda_ops.py ----

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cuda_opcheck(dtype):
    input, weight, bias = (t.cuda().to(dtype) for t in make_operands(5, 7, 3, torch.float32))
    grad_output = torch.randn(5, 7, device="cuda", dtype=dtype)
    input.requires_grad_()
    calls = [
        (torch.ops.ext.linear.default, (input, weight, bias)),
        (torch.ops.ext.linear_relu.default, (input, weight, None)),
        (torch.ops.ext.linear_backward_input.default, (grad_output, weight)),
        (torch.ops.ext.linear_backward_weight.default, (grad_output, input.detach())),
        (torch.ops.ext.linear_backward_bias.default, (grad_output,)),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args)


@requires_gpu
def test_cuda_gradients_match_torch_through_the_f_linear_contract():
    input, weight, bias = (t.cuda() for t in make_operands(17, 33, 65, torch.float64, transposed_weight=True))
    check_against_torch(ext.linear, F.linear, input, weight, bias)
    check_against_torch(ext.linear_relu, torch_linear_relu, input.unsqueeze(0), weight, bias)


@requires_gpu
def test_cuda_device_mismatch_error():
    with pytest.raises(RuntimeError, match="input is on cuda:0 but weight is on cpu; move both to the same device"):
        ext.linear(torch.randn(2, 3, device="cuda"), torch.randn(4, 3))
