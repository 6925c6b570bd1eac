"""The Python side of the ext ops: fake kernels (for torch.compile), autograd, and
`linear`, which gives torch.ops.ext.linear the full F.linear contract.

The ops themselves (schemas and kernels) live in ext/csrc; they take 2-D operands only.
"""
from __future__ import annotations

import torch


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


def _needed_operands(ctx, inputs):
    """Only the operands the requested gradients need: dX needs W, dW needs X."""
    input, weight, _ = inputs
    return (input if ctx.needs_input_grad[1] else None,
            weight if ctx.needs_input_grad[0] else None)


def _operand_grads(ctx, grad_output, input, weight):
    needs_input, needs_weight, needs_bias = ctx.needs_input_grad
    return (torch.ops.ext.linear_backward_input(grad_output, weight) if needs_input else None,
            torch.ops.ext.linear_backward_weight(grad_output, input) if needs_weight else None,
            torch.ops.ext.linear_backward_bias(grad_output) if needs_bias else None)


def _linear_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*_needed_operands(ctx, inputs))


def _linear_backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    return _operand_grads(ctx, grad_output, input, weight)


def _linear_relu_setup_context(ctx, inputs, output):
    # The output is ReLU's mask; save_for_backward keeps it without a reference cycle.
    ctx.save_for_backward(*_needed_operands(ctx, inputs), output)


def _linear_relu_backward(ctx, grad_output):
    input, weight, output = ctx.saved_tensors
    # ReLU's gradient in one fused pass, torch's own: 0 where output <= 0 (NaN passes through).
    grad_output = torch.ops.aten.threshold_backward(grad_output, output, 0)
    return _operand_grads(ctx, grad_output, input, weight)


torch.library.register_autograd("ext::linear", _linear_backward, setup_context=_linear_setup_context)
torch.library.register_autograd("ext::linear_relu", _linear_relu_backward,
                                setup_context=_linear_relu_setup_context)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Y = input · weightᵀ + bias with our kernels; the same contract as F.linear.

    input (*, in_features) with any number of leading dimensions (or 1-D), weight
    (out_features, in_features) or (in_features,), bias (out_features,), one element, or None.

    Example:
        >>> y = ext.linear(torch.randn(8, 3, 784), torch.randn(256, 784), torch.randn(256))
        >>> y.shape
        torch.Size([8, 3, 256])
    """
    return _apply(torch.ops.ext.linear, input, weight, bias)


def linear_relu(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(linear(input, weight, bias)) in one pass: the ReLU is fused into the GEMM's store.

    Example:
        >>> y = ext.linear_relu(torch.randn(128, 784), torch.randn(256, 784), torch.randn(256))
    """
    return _apply(torch.ops.ext.linear_relu, input, weight, bias)


def _apply(op, input, weight, bias):
    """Adapts F.linear's shapes to the 2-D op: flatten leading dims, call, restore."""
    if input.dim() == 2 and weight.dim() == 2 and (bias is None or bias.shape == weight.shape[:1]):
        return op(input, weight, bias)  # the common case, kept cheap: it runs every layer, every step
    if input.dim() == 0 or weight.dim() == 0:
        raise ValueError(f"ext.linear: input and weight must be at least 1-D, got shapes "
                         f"{tuple(input.shape)} and {tuple(weight.shape)}")
    if weight.dim() > 2:
        raise ValueError(f"ext.linear: weight must be 2-D (out_features x in_features) or 1-D, got "
                         f"shape {tuple(weight.shape)}")
    out_features = weight.shape[0] if weight.dim() == 2 else 1
    weight_2d = weight if weight.dim() == 2 else weight.unsqueeze(0)
    if bias is not None and bias.dim() <= 1 and bias.numel() == 1:
        bias = bias.expand(out_features)  # F.linear broadcasts a one-element bias
    input_2d = input.unsqueeze(0) if input.dim() == 1 else input.flatten(0, -2)
    output = op(input_2d, weight_2d, bias)
    leading = input.shape[:-1]
    return output.view(*leading, out_features) if weight.dim() == 2 else output.view(leading)
