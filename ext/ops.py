"""The Python side of the ext ops: fake kernels (for torch.compile), a vmap rule, and
`linear`, which gives torch.ops.ext.linear the full F.linear contract.

The ops themselves (schemas, kernels and autograd) live in ext/csrc; they take 2-D
operands only. Autograd is C++ (ext/csrc/autograd.cpp) so that no step enters Python;
only under torch.func transforms and forward-mode AD, which C++ autograd cannot serve,
does a Python autograd.Function take over (_TransformableLinear).
"""
from __future__ import annotations

import math
import operator

import torch
from torch.autograd import forward_ad
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils.flop_counter import register_flop_formula

from ext import _calls


def check_same_device(op, **tensors):
    """Every tensor given (None skipped) on one device, for the fake kernels: a meta tensor among CPU ones
    sends the whole call to them, and the empty result they make on the input's device would be garbage."""
    named = [(name, tensor) for name, tensor in tensors.items() if tensor is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        torch._check(tensor.device == first.device,
                     lambda: f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}; "
                             f"move them to the same device")


def autocast_enabled(device_type):
    """Autocast is on for `device_type` (never for one it does not know, such as meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _linear_fake(input, weight, bias):
    """Shape and dtype of linear and linear_relu, with the shape checks of checks.h."""
    check_same_device("ext.linear", input=input, weight=weight, bias=bias)
    torch._check(input.dtype.is_floating_point,
                 lambda: f"ext.linear: dtype {input.dtype} is not supported; use a floating-point dtype")
    torch._check(input.dim() == 2 and weight.dim() == 2,
                 lambda: f"ext.linear: input and weight must be 2-D, got {tuple(input.shape)} "
                         f"and {tuple(weight.shape)}")
    torch._check(input.shape[1] == weight.shape[1],
                 lambda: f"ext.linear: input has {input.shape[1]} features but weight expects "
                         f"{weight.shape[1]}")
    torch._check(bias is None or tuple(bias.shape) == (weight.shape[0],),
                 lambda: f"ext.linear: bias must have shape [{weight.shape[0]}]")
    return input.new_empty((input.shape[0], weight.shape[0]))


torch.library.register_fake("ext::linear", _linear_fake)
torch.library.register_fake("ext::linear_relu", _linear_fake)


@torch.library.register_fake("ext::linear_backward_input")
def _linear_backward_input_fake(grad_output, weight):
    check_same_device("ext.linear_backward_input", grad_output=grad_output, weight=weight)
    torch._check(grad_output.shape[1] == weight.shape[0])
    return grad_output.new_empty((grad_output.shape[0], weight.shape[1]))


@torch.library.register_fake("ext::linear_backward_weight")
def _linear_backward_weight_fake(grad_output, input):
    check_same_device("ext.linear_backward_weight", grad_output=grad_output, input=input)
    torch._check(grad_output.shape[0] == input.shape[0])
    return grad_output.new_empty((grad_output.shape[1], input.shape[1]))


@torch.library.register_fake("ext::linear_backward_bias")
def _linear_backward_bias_fake(grad_output):
    return grad_output.new_empty((grad_output.shape[1],))


# FLOP counts for torch.utils.flop_counter (FlopCounterMode, MFU): torch's own for a matrix product,
# 2·M·N·K, from the shapes the op receives (2-D operands) and returns. The bias's additions, as torch's, are
# not counted.
@register_flop_formula([torch.ops.ext.linear, torch.ops.ext.linear_relu, torch.ops.ext.linear_backward_input])
def _linear_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs):
    return 2 * math.prod(out_shape) * input_shape[-1]  # backward_input: (M, N) · (N, K), N = grad_output's last


@register_flop_formula(torch.ops.ext.linear_backward_weight)
def _linear_backward_weight_flops(grad_output_shape, input_shape, *args, out_shape=None, **kwargs):
    return 2 * math.prod(grad_output_shape) * input_shape[-1]


# The ops' overloads: what torch.compile traces into its graph, and what the general path, the Python autograd
# Function and the vmap rule call. In eager mode, linear and linear_relu call the library's direct calls
# (ext._calls) first: the same ops, called from C++ without the overloads' Python argument parsing (why and
# how much: csrc/python_calls.cpp).
_LINEAR = torch.ops.ext.linear.default
_LINEAR_RELU = torch.ops.ext.linear_relu.default


def _eager() -> bool:
    """No torch.func transform or forward-mode AD level is active, and torch.compile is not tracing."""
    return not (torch.compiler.is_compiling() or _transforms_active())


def _is_plain_2d(input, weight, bias) -> bool:
    """The shapes the 2-D op takes as they are: no flattening or broadcasting needed."""
    try:
        return input.ndim == 2 and weight.ndim == 2 and not input.is_nested and (
            bias is None or (bias.ndim == 1 and bias.shape[0] == weight.shape[0]))
    except AttributeError:  # not tensors: _apply says which
        return False


def _nested(linear_fn, input, weight, bias):
    """linear_fn on a nested tensor, as nn.Linear takes one. A jagged tensor ragged in its
    second dimension holds its components as the rows of values(): they go through one product,
    and the result keeps the input's offsets, so it adds to tensors of the same structure.
    Other nested tensors go component by component."""
    if input.layout == torch.jagged:
        if input._ragged_idx == input.dim() - 1 or input.shape[-1] != weight.shape[-1]:
            raise RuntimeError(f"ext.linear: input has shape {list(input.shape)} but weight expects "
                               f"{weight.shape[-1]} features in every component (weight shape {list(weight.shape)})")
        if input._ragged_idx == 1:
            return torch.nested.nested_tensor_from_jagged(linear_fn(input.values(), weight, bias),
                                                           offsets=input.offsets(), lengths=input.lengths())
    outputs = [linear_fn(component, weight, bias) for component in input.unbind()]
    return torch.nested.as_nested_tensor(outputs, layout=input.layout)


class _TransformableLinear(torch.autograd.Function):
    """linear / linear_relu for torch.func transforms (grad, vmap, jacrev, jacfwd, ...) and
    forward-mode AD, which cannot go through the ops' C++ autograd (a C++ autograd Function
    has neither). The same kernels; only the autograd bookkeeping is Python, which costs
    ~10 us per call, so it runs only while a transform or a dual level is active.
    The backward and the jvp are built from this Function again, so they compose to any order.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias, relu):
        return (_LINEAR_RELU if relu else _LINEAR)(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, relu = inputs
        ctx.save_for_backward(input, weight, output if relu else None)
        ctx.save_for_forward(input, weight, output if relu else None)
        ctx.relu, ctx.has_bias = relu, bias is not None

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, output = ctx.saved_tensors
        if ctx.relu:
            grad_output = torch.ops.aten.threshold_backward(grad_output, output, 0)
        needs_input, needs_weight, needs_bias, _ = ctx.needs_input_grad
        # dX = dY·W = linear(dY, Wᵀ) and dW = dYᵀ·X = linear(dYᵀ, Xᵀ)
        grad_input = _TransformableLinear.apply(grad_output, weight.t(), None, False) if needs_input else None
        grad_weight = _TransformableLinear.apply(grad_output.t(), input.t(), None, False) if needs_weight else None
        grad_bias = grad_output.sum(0) if ctx.has_bias and needs_bias else None
        return grad_input, grad_weight, grad_bias, None

    @staticmethod
    def jvp(ctx, input_tangent, weight_tangent, bias_tangent, _):
        input, weight, output = ctx.saved_tensors
        # d(X·Wᵀ + b) = dX·Wᵀ + X·dWᵀ + db, through the ReLU's mask
        terms = [] if bias_tangent is None else [bias_tangent.expand(input.shape[0], weight.shape[0])]
        if input_tangent is not None:
            terms.append(_TransformableLinear.apply(input_tangent, weight, None, False))
        if weight_tangent is not None:
            terms.append(_TransformableLinear.apply(input, weight_tangent, None, False))
        tangent = sum(terms[1:], terms[0])
        return torch.ops.aten.threshold_backward(tangent, output, 0) if ctx.relu else tangent


def _vmap_rule(op):
    """torch.func.vmap of op: with one weight and bias for all samples, the samples join
    the rows of one product; with per-sample weights or biases, one product per sample."""
    def rule(info, in_dims, input, weight, bias):
        input_dim, weight_dim, bias_dim = in_dims
        if weight_dim is None and bias_dim is None:
            samples = input.movedim(input_dim, 0)
            output = op(samples.flatten(0, -2), weight, bias)  # flatten: reshape(-1, 0) is ambiguous
            return output.view(samples.shape[0], samples.shape[1], output.shape[-1]), 0

        def sample(tensor, dim, index):
            return tensor if dim is None else tensor.select(dim, index)

        if info.batch_size == 0:  # no sample to run: the output's shape, from one sample of zeros
            def zeros(tensor, dim):
                return tensor if dim is None else tensor.new_zeros(tensor.shape[:dim] + tensor.shape[dim + 1:])
            bias_zeros = None if bias is None else zeros(bias, bias_dim)
            shape = op(zeros(input, input_dim), zeros(weight, weight_dim), bias_zeros).shape
            return input.new_empty((0, *shape)), 0
        outputs = [op(sample(input, input_dim, i), sample(weight, weight_dim, i),
                      None if bias is None else sample(bias, bias_dim, i)) for i in range(info.batch_size)]
        return torch.stack(outputs), 0
    return rule


torch.library.register_vmap("ext::linear", _vmap_rule(_LINEAR))
torch.library.register_vmap("ext::linear_relu", _vmap_rule(_LINEAR_RELU))


def _transformable_linear(input, weight, bias):
    return _TransformableLinear.apply(input, weight, bias, False)


def _transformable_linear_relu(input, weight, bias):
    return _TransformableLinear.apply(input, weight, bias, True)


def _transforms_active() -> bool:
    """A torch.func transform or a forward-mode AD level is active (see _TransformableLinear)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Y = input · weightᵀ + bias with our kernels; the same contract as F.linear.

    input (*, in_features) with any number of leading dimensions (or 1-D), weight
    (out_features, in_features) or (in_features,), bias (out_features,), one element, or None.
    In TorchScript (torch.jit.script), weight must be 2-D and bias (out_features,) or None.

    Example:
        >>> y = ext.linear(torch.randn(8, 3, 784), torch.randn(256, 784), torch.randn(256))
        >>> y.shape
        torch.Size([8, 3, 256])
    """
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        return _scripted_linear(input, weight, bias, False)
    if has_torch_function((input, weight, bias)):  # fx Proxies, tensor subclasses, torch function modes
        return handle_torch_function(linear, (input, weight, bias), input, weight, bias)
    if _eager():  # every layer, every step: 2-D tensors go straight to the op
        output = _calls.linear(input, weight, bias)  # None unless 2-D tensors and a bias of [out_features] or None
        if output is not None:
            return output
    op = _transformable_linear if _transforms_active() else _LINEAR
    if _is_plain_2d(input, weight, bias):
        return op(input, weight, bias)
    if getattr(input, "is_nested", False):
        return _nested(linear, input, weight, bias)
    if _bias_to_broadcast(weight, bias):
        return _add_broadcast_bias(_apply(op, input, weight, None), input, bias)
    return _apply(op, input, weight, bias)


def linear_relu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(linear(input, weight, bias)) in one pass: the ReLU is fused into the GEMM's store.

    Example:
        >>> y = ext.linear_relu(torch.randn(128, 784), torch.randn(256, 784), torch.randn(256))
    """
    if torch.jit.is_scripting():
        return _scripted_linear(input, weight, bias, True)
    if has_torch_function((input, weight, bias)):
        return handle_torch_function(linear_relu, (input, weight, bias), input, weight, bias)
    if _eager():
        output = _calls.linear_relu(input, weight, bias)  # None unless 2-D tensors and a bias of [out_features] or None
        if output is not None:
            return output
    op = _transformable_linear_relu if _transforms_active() else _LINEAR_RELU
    if _is_plain_2d(input, weight, bias):
        return op(input, weight, bias)
    if getattr(input, "is_nested", False):
        return _nested(linear_relu, input, weight, bias)
    if _bias_to_broadcast(weight, bias):  # the bias joins after the product, so the ReLU does too
        return torch.relu(linear(input, weight, bias))
    return _apply(op, input, weight, bias)


def _scripted_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     relu: bool) -> torch.Tensor:
    """linear and linear_relu as TorchScript runs them (torch.jit.script of an ext.Linear, or of code
    calling ext.linear): the op on the input's rows, leading dimensions flattened and restored. The
    ops' C++ autograd needs no Python, so a scripted model also trains, and loads (torch.jit.load)
    in any process that has imported ext."""
    rows = input.unsqueeze(0) if input.dim() == 1 else input.flatten(0, -2)
    if relu:
        output = torch.ops.ext.linear_relu(rows, weight, bias)
    else:
        output = torch.ops.ext.linear(rows, weight, bias)
    return output.squeeze(0) if input.dim() == 1 else output.unflatten(0, input.shape[:-1])


def _bias_to_broadcast(weight, bias) -> bool:
    """A bias F.linear takes but the op does not: any shape other than (out_features,) or one
    element, such as (1, out_features), or (batch, out_features) with a 2-D input."""
    if not isinstance(bias, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() not in (1, 2):
        return False  # _apply names what is wrong
    out_features = weight.shape[0] if weight.dim() == 2 else 1
    return tuple(bias.shape) != (out_features,) and not (bias.dim() <= 1 and bias.numel() == 1)


def _add_broadcast_bias(output, input, bias):
    """output + bias as F.linear adds it: broadcast to the output, whose shape must not change
    (a 1-D input counts as one row)."""
    shape = (1, *output.shape) if input.dim() == 1 else output.shape
    try:
        broadcasts = torch.broadcast_shapes(bias.shape, shape) == shape
    except RuntimeError:
        broadcasts = False
    if not broadcasts:
        raise RuntimeError(f"ext.linear: bias of shape {list(bias.shape)} does not broadcast to the output's "
                           f"shape {list(shape)}; give it shape [{output.shape[-1] if output.dim() else 1}]")
    if autocast_enabled(output.device.type) and bias.is_floating_point() and bias.device == output.device:
        bias = bias.to(output.dtype)  # autocast casts every operand of F.linear, its bias too
    if bias.dtype != output.dtype or bias.device != output.device:  # F.linear refuses them; + would promote
        raise RuntimeError(f"ext.linear: bias is {bias.dtype} on {bias.device} but input is {input.dtype} on "
                           f"{input.device}; give bias the input's dtype and device")
    return (output.reshape(shape) + bias).reshape(output.shape)


def _apply(op, input, weight, bias):
    """Adapts F.linear's other shapes to the 2-D op: flatten leading dims, call, restore."""
    for name, value in (("input", input), ("weight", weight), ("bias", bias)):
        if not isinstance(value, torch.Tensor) and not (name == "bias" and value is None):
            expected = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"ext.linear: {name} must be {expected}, got {type(value).__name__}")
    if input.dim() == 0 or weight.dim() == 0:
        raise RuntimeError(f"ext.linear: input and weight must be at least 1-D, got shapes "
                           f"{tuple(input.shape)} and {tuple(weight.shape)}")
    if weight.dim() > 2:
        raise RuntimeError(f"ext.linear: weight must be 2-D (out_features x in_features) or 1-D, got "
                           f"shape {tuple(weight.shape)}")
    if input.shape[-1] != weight.shape[-1]:  # checked here to name the caller's shapes, not the flattened ones
        raise RuntimeError(f"ext.linear: input has {input.shape[-1]} features but weight expects "
                           f"{weight.shape[-1]} (input shape {list(input.shape)}, weight shape {list(weight.shape)})")
    out_features = weight.shape[0] if weight.dim() == 2 else 1
    weight_2d = weight if weight.dim() == 2 else weight.unsqueeze(0)
    if bias is not None and bias.dim() <= 1 and bias.numel() == 1:
        bias = bias.expand(out_features)  # F.linear broadcasts a one-element bias
    input_2d = input.unsqueeze(0) if input.dim() == 1 else input.flatten(0, -2)
    output = op(input_2d, weight_2d, bias)
    leading = input.shape[:-1]
    return output.view(*leading, out_features) if weight.dim() == 2 else output.view(leading)


_CROSS_ENTROPY = torch.ops.ext.cross_entropy.default


@torch.library.register_fake("ext::cross_entropy")
def _cross_entropy_fake(input, target, ignore_index=-100):
    check_same_device("ext.cross_entropy", input=input, target=target)
    # torch's loss on the fake tensors: its shape checks and its result (the op takes torch's for unusual shapes)
    return torch.ops.aten.cross_entropy_loss(input, target, None, 1, ignore_index, 0.0)


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """F.cross_entropy, with F.cross_entropy's arguments. Its default form, the trainer's loss, runs our
    kernel: the mean over the rows of -log softmax(input)[target], rows whose target is ignore_index left out.

    input (batch, classes) float32 or float64 and target (batch,) class indices (int64) on the CPU
    run it (ext/csrc/loss.cpp): one pass forward, one backward (under CPU autocast, in float32).
    Anything else (a weight, another reduction, label smoothing, CUDA, other shapes or dtypes,
    torch.func transforms) runs F.cross_entropy, so every call F.cross_entropy takes works here too.
    The kernel keeps the logits for a double backward: changed in place before the backward, they stop
    it with autograd's in-place error.

    Example:
        >>> loss = ext.cross_entropy(torch.randn(128, 10, requires_grad=True), torch.randint(0, 10, (128,)))
        >>> loss.backward()
    """
    kernel_form = (weight is None and size_average is None and reduce is None and reduction == "mean"
                   and label_smoothing == 0.0)
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        if kernel_form:
            return torch.ops.ext.cross_entropy(input, target, ignore_index)
        return torch.nn.functional.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                                 reduction, label_smoothing)
    ignore_index = _class_index(ignore_index)
    if not kernel_form or has_torch_function((input, target)) or _transforms_active():
        return torch.nn.functional.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                                 reduction, label_smoothing)
    for name, value in (("input", input), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ext.cross_entropy: {name} must be a torch.Tensor, got {type(value).__name__}")
    return _CROSS_ENTROPY(input, target, ignore_index)


def as_int(value):
    """`value` as an int where torch takes it for one (an int, a numpy integer, a one-element integer
    tensor: anything with __index__ but a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _class_index(ignore_index):
    """ignore_index as an int, or one line saying what it must be."""
    index = as_int(ignore_index)
    if index is None or not -2**63 <= index < 2**63:
        raise TypeError(f"ext.cross_entropy: ignore_index must be an integer (a class index, -100 by default), "
                        f"got {ignore_index}")
    return index
