"""The Python side of the ext ops: fake kernels (for torch.compile) and `linear`,
which gives torch.ops.ext.linear the full F.linear contract.

The ops themselves (schemas, kernels and autograd) live in ext/csrc; they take 2-D
operands only. Autograd is C++ (ext/csrc/autograd.cpp) so that no step enters Python.
"""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function


def _linear_fake(input, weight, bias):
    """Shape and dtype of linear and linear_relu, with the shape checks of checks.h."""
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
    torch._check(grad_output.shape[1] == weight.shape[0])
    return grad_output.new_empty((grad_output.shape[0], weight.shape[1]))


@torch.library.register_fake("ext::linear_backward_weight")
def _linear_backward_weight_fake(grad_output, input):
    torch._check(grad_output.shape[0] == input.shape[0])
    return grad_output.new_empty((grad_output.shape[1], input.shape[1]))


@torch.library.register_fake("ext::linear_backward_bias")
def _linear_backward_bias_fake(grad_output):
    return grad_output.new_empty((grad_output.shape[1],))


# The ops' overloads, called directly: one Python call less than through the
# packet (torch.ops.ext.linear). With _is_plain_2d's attribute reads instead of
# dim() and Size slicing, the common case costs ~1 us less per call. Measured
# (2 threads, torch.utils.benchmark, fwd+bwd, interleaved with the old wrapper):
# 128x256->10 48.8 -> 47.9 us, 128x512->10 65.0 -> 63.9 us (torch 58.8, 71.5).
_LINEAR = torch.ops.ext.linear.default
_LINEAR_RELU = torch.ops.ext.linear_relu.default


def _is_plain_2d(input, weight, bias) -> bool:
    """The shapes the 2-D op takes as they are: no flattening or broadcasting needed."""
    try:
        return input.ndim == 2 and weight.ndim == 2 and (bias is None or (bias.ndim == 1 and
                                                                           bias.shape[0] == weight.shape[0]))
    except AttributeError:  # not tensors: _apply says which
        return False


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Y = input · weightᵀ + bias with our kernels; the same contract as F.linear.

    input (*, in_features) with any number of leading dimensions (or 1-D), weight
    (out_features, in_features) or (in_features,), bias (out_features,), one element, or None.

    Example:
        >>> y = ext.linear(torch.randn(8, 3, 784), torch.randn(256, 784), torch.randn(256))
        >>> y.shape
        torch.Size([8, 3, 256])
    """
    if has_torch_function((input, weight, bias)):  # fx Proxies, tensor subclasses, torch function modes
        return handle_torch_function(linear, (input, weight, bias), input, weight, bias)
    if _is_plain_2d(input, weight, bias):  # every layer, every step: kept to one check and one call
        return _LINEAR(input, weight, bias)
    return _apply(_LINEAR, input, weight, bias)


def linear_relu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(linear(input, weight, bias)) in one pass: the ReLU is fused into the GEMM's store.

    Example:
        >>> y = ext.linear_relu(torch.randn(128, 784), torch.randn(256, 784), torch.randn(256))
    """
    if has_torch_function((input, weight, bias)):
        return handle_torch_function(linear_relu, (input, weight, bias), input, weight, bias)
    if _is_plain_2d(input, weight, bias):
        return _LINEAR_RELU(input, weight, bias)
    return _apply(_LINEAR_RELU, input, weight, bias)


def _apply(op, input, weight, bias):
    """Adapts F.linear's other shapes to the 2-D op: flatten leading dims, call, restore."""
    for name, value in (("input", input), ("weight", weight), ("bias", bias)):
        if not isinstance(value, torch.Tensor) and not (name == "bias" and value is None):
            expected = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"ext.linear: {name} must be {expected}, got {type(value).__name__}")
    if input.dim() == 0 or weight.dim() == 0:
        raise ValueError(f"ext.linear: input and weight must be at least 1-D, got shapes "
                         f"{tuple(input.shape)} and {tuple(weight.shape)}")
    if weight.dim() > 2:
        raise ValueError(f"ext.linear: weight must be 2-D (out_features x in_features) or 1-D, got "
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
