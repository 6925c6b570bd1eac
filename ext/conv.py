"""The Python side of ext::conv2d: fake kernels (torch.compile, export) and `conv2d`, which
gives the op F.conv2d's contract for groups=1.

The op (ext/csrc/conv_ops.cpp) takes a 4-D input, pairs for stride and dilation and four
paddings (top, bottom, left, right); this module turns F.conv2d's forms into those.
"""
from __future__ import annotations

import torch

from torch.nn import functional as F
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from ext.ops import _transforms_active, as_int, autocast_enabled, check_same_device, linear

_CONV2D = torch.ops.ext.conv2d.default


def _output_size(size, kernel, stride, padding, dilation):
    return (size + padding - dilation * (kernel - 1) - 1) // stride + 1


def _fake_format(input, weight):
    channels_last = torch.channels_last in (torch._prims_common.suggest_memory_format(input),
                                            torch._prims_common.suggest_memory_format(weight))
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.library.register_fake("ext::conv2d")
def _conv2d_fake(input, weight, bias, stride, padding, dilation):
    check_same_device("ext.conv2d", input=input, weight=weight, bias=bias)
    torch._check(min(stride) > 0 and min(dilation) > 0,
                 lambda: f"ext.conv2d: stride and dilation must be positive, got {list(stride)} and {list(dilation)}")
    torch._check(input.dim() == 4 and weight.dim() == 4,
                 lambda: f"ext.conv2d: input and weight must be 4-D, got {tuple(input.shape)} and {tuple(weight.shape)}")
    torch._check(input.shape[1] == weight.shape[1],
                 lambda: f"ext.conv2d: input has {input.shape[1]} channels but weight expects {weight.shape[1]}")
    height = _output_size(input.shape[2], weight.shape[2], stride[0], padding[0] + padding[1], dilation[0])
    width = _output_size(input.shape[3], weight.shape[3], stride[1], padding[2] + padding[3], dilation[1])
    torch._check(height > 0 and width > 0, lambda: "ext.conv2d: the input is smaller than the kernel's reach")
    shape = (input.shape[0], weight.shape[0], height, width)
    return input.new_empty(shape).contiguous(memory_format=_fake_format(input, weight))


@torch.library.register_fake("ext::conv2d_backward_input")
def _conv2d_backward_input_fake(grad_output, weight, input_size, stride, padding, dilation):
    check_same_device("ext.conv2d_backward_input", grad_output=grad_output, weight=weight)
    return grad_output.new_empty(input_size)


@torch.library.register_fake("ext::conv2d_backward_weight")
def _conv2d_backward_weight_fake(grad_output, input, weight_size, stride, padding, dilation):
    check_same_device("ext.conv2d_backward_weight", grad_output=grad_output, input=input)
    return grad_output.new_empty(weight_size)


@torch.library.register_fake("ext::conv2d_backward_bias")
def _conv2d_backward_bias_fake(grad_output):
    return grad_output.new_empty((grad_output.shape[1],))


# FLOP counts for torch.utils.flop_counter, as torch counts its convolution: each gradient costs what the
# forward does.
@register_flop_formula(torch.ops.ext.conv2d)
def _conv2d_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs):
    return conv_flop_count(input_shape, weight_shape, out_shape)


@register_flop_formula(torch.ops.ext.conv2d_backward_input)
def _conv2d_backward_input_flops(grad_output_shape, weight_shape, input_size, *args, **kwargs):
    return conv_flop_count(input_size, weight_shape, grad_output_shape)


@register_flop_formula(torch.ops.ext.conv2d_backward_weight)
def _conv2d_backward_weight_flops(grad_output_shape, input_shape, weight_size, *args, **kwargs):
    return conv_flop_count(input_shape, weight_size, grad_output_shape)


def _pair(name, value):
    ints = [as_int(v) for v in value] if isinstance(value, (tuple, list)) else [as_int(value)]
    if len(ints) in (1, 2) and None not in ints:
        return ints[0], ints[-1]
    raise TypeError(f"ext.conv2d: {name} must be an int or a pair of ints, got {value!r}")


def _paddings(padding, kernel_size, stride, dilation):
    """(top, bottom, left, right) from F.conv2d's padding: an int, a pair, "valid" or "same"."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding != "same":
            raise ValueError(f"ext.conv2d: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
        if stride != (1, 1):
            raise ValueError("ext.conv2d: padding='same' is not supported for strided convolutions "
                             f"(stride={stride}), as in F.conv2d; give the padding as numbers")
        # As F.conv2d: the total padding is dilation·(kernel - 1), the odd one goes after.
        total = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        return total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2
    top, left = _pair("padding", padding)
    return top, top, left, left


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: int | tuple[int, int] | list[int] = 1, padding: int | tuple[int, int] | list[int] | str = 0,
           dilation: int | tuple[int, int] | list[int] = 1, groups: int = 1) -> torch.Tensor:
    """A 2-D convolution with our kernels; the same contract as F.conv2d for groups=1.

    input (N, C, H, W) or unbatched (C, H, W), in any memory format; weight (K, C, R, S);
    bias (K,) or None; stride, padding and dilation as ints or pairs, padding also "valid" or
    "same". The output is channels_last when the input or the weight is, as F.conv2d's.
    Grouped (and depthwise) convolutions are refused: run those layers with torch.

    Example:
        >>> y = ext.conv2d(torch.randn(8, 3, 32, 32), torch.randn(64, 3, 3, 3), padding=1)
        >>> y.shape
        torch.Size([8, 64, 32, 32])
    """
    if torch.jit.is_scripting():  # TorchScript compiles this branch only (but parses all: no f"{x!r}" here)
        return _scripted_conv2d(input, weight, bias, stride, padding, dilation, groups)
    if has_torch_function((input, weight, bias)):  # fx Proxies, tensor subclasses, torch function modes
        return handle_torch_function(conv2d, (input, weight, bias), input, weight, bias, stride, padding, dilation,
                                     groups)
    if as_int(groups) != 1:
        raise ValueError(f"ext.conv2d: groups={repr(groups)} is not supported (only the int 1); run this layer with "
                         "torch's convolution (conv=torch, or leave it an nn.Conv2d)")
    for name, value in (("input", input), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ext.conv2d: {name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"ext.conv2d: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if input.is_nested:
        raise TypeError("ext.conv2d: nested tensors are not supported; convolve each image (or a padded batch)")
    if weight.dim() != 4:
        raise RuntimeError(f"ext.conv2d: weight must be 4-D (out_channels, in_channels, kernel_h, kernel_w), "
                           f"got shape {tuple(weight.shape)}")
    if input.dim() not in (3, 4):
        raise RuntimeError(f"ext.conv2d: input must be 4-D (batch, channels, height, width) or 3-D unbatched, "
                           f"got shape {tuple(input.shape)}")
    stride, dilation = _pair("stride", stride), _pair("dilation", dilation)
    padding = _paddings(padding, tuple(weight.shape[2:]), stride, dilation)
    unbatched = input.dim() == 3
    batched = input.unsqueeze(0) if unbatched else input
    if _transforms_active():
        output = _patches_conv2d(batched, weight, bias, stride, padding, dilation)
    elif _is_pointwise_channels_last(batched, weight, bias, stride, padding):
        output = _pointwise_channels_last(batched, weight, bias)
    else:
        output = _CONV2D(batched, weight, bias, stride, padding, dilation)
    return output.squeeze(0) if unbatched else output


def _is_pointwise_channels_last(input, weight, bias, stride, padding):
    """A 1x1 stride-1 unpadded kernel on a channels_last input: the convolution is ext.linear on its rows.
    Only with arguments the op takes (one dtype and device, bias (K,) or None): for any other the op names what
    is wrong, where ext.linear would broadcast a bias or speak of a linear layer."""
    arguments_fit = all(t.dtype == input.dtype and t.device == input.device for t in (weight, bias) if t is not None) \
        and (bias is None or tuple(bias.shape) == (weight.shape[0],)) \
        and _kernel_dtype(input)
    return (tuple(weight.shape[2:]) == (1, 1) and stride == (1, 1) and padding == (0, 0, 0, 0)
            and input.dim() == 4 and input.shape[1] == weight.shape[1] and input.numel() > 0 and arguments_fit
            and input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous())


def _kernel_dtype(input):
    """A dtype the kernels take (checks.h: 16-bit on CUDA only), or one autocast will cast to one."""
    return (input.dtype in (torch.float32, torch.float64) or autocast_enabled(input.device.type)
            or (input.is_cuda and input.dtype in (torch.float16, torch.bfloat16)))


def _pointwise_channels_last(input, weight, bias):
    """In channels_last, the pixels' channels are the rows of an (N·H·W) x C matrix: Y = X·Wᵀ + b is
    ext.linear on it, with no copy in or out, and the output is channels_last as F.conv2d's is. (The
    op itself would copy the input to NCHW and the output back.)"""
    n, c, h, w = input.shape
    rows = input.permute(0, 2, 3, 1).reshape(n * h * w, c)  # a view: NHWC is row-major in these rows
    output = linear(rows, weight.reshape(weight.shape[0], c), bias)
    return output.view(n, h, w, weight.shape[0]).permute(0, 3, 1, 2)


def _patches_conv2d(input, weight, bias, stride, padding, dilation):
    """The convolution under torch.func transforms and forward-mode AD, which the op's C++ autograd cannot
    serve: ext.linear, which can (to any order), on the input's patches (im2col, F.unfold). The same sums
    in another order; the patches take C·R·S values a pixel, a price paid only while a transform is active."""
    _check_arguments(input, weight, bias, stride, padding, dilation)
    top, bottom, left, right = padding
    padded = F.pad(input, (left, right, top, bottom))
    height = _output_size(input.shape[2], weight.shape[2], stride[0], top + bottom, dilation[0])
    width = _output_size(input.shape[3], weight.shape[3], stride[1], left + right, dilation[1])
    patches = F.unfold(padded, tuple(weight.shape[2:]), dilation=dilation, stride=stride)  # (N, C·R·S, H'·W')
    output = linear(patches.transpose(1, 2), weight.reshape(weight.shape[0], -1), bias)  # (N, H'·W', K)
    if _fake_format(input, weight) == torch.channels_last:  # F.conv2d's layout (vmap cannot ask for one by name)
        return output.view(input.shape[0], height, width, weight.shape[0]).permute(0, 3, 1, 2)
    return output.transpose(1, 2).reshape(input.shape[0], weight.shape[0], height, width).contiguous()


def _check_arguments(input, weight, bias, stride, padding, dilation):
    """The op's own one-line refusals where a transform would refuse the op first: the op on (at most) one
    image of the same shape, dtype and device, outside the transforms."""
    def like(tensor, shape):
        return None if tensor is None else torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    with torch._C._DisableFuncTorch(), torch._C._AutoDispatchBelowAutograd():  # the kernel, no autograd
        _CONV2D(like(input, (min(input.shape[0], 1), *input.shape[1:])), like(weight, weight.shape),
                like(bias, bias.shape if bias is not None else None), stride, padding, dilation)


def _scripted_pair(value: int | tuple[int, int] | list[int]) -> list[int]:
    if isinstance(value, int):
        return [value, value]
    if isinstance(value, list):
        if len(value) not in (1, 2):
            raise ValueError("ext.conv2d: stride, padding and dilation must be ints or pairs of ints")
        return value if len(value) == 2 else [value[0], value[0]]
    return [value[0], value[1]]


def _scripted_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     stride: int | tuple[int, int] | list[int], padding: int | tuple[int, int] | list[int] | str,
                     dilation: int | tuple[int, int] | list[int], groups: int) -> torch.Tensor:
    """conv2d as TorchScript runs it (torch.jit.script of an ext.Conv2d, or of code calling ext.conv2d):
    F.conv2d's forms of the arguments turned into the op's, and the op, whose C++ autograd needs no Python."""
    if groups != 1:
        raise ValueError("ext.conv2d: only groups=1 is supported; run this layer with torch's convolution")
    strides, dilations = _scripted_pair(stride), _scripted_pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            paddings = [0, 0, 0, 0]
        else:
            if padding != "same" or strides != [1, 1]:
                raise ValueError("ext.conv2d: padding must be 'valid', 'same' (stride 1) or numbers")
            total = [dilations[0] * (weight.shape[2] - 1), dilations[1] * (weight.shape[3] - 1)]
            paddings = [total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2]
    else:
        pair = _scripted_pair(padding)
        paddings = [pair[0], pair[0], pair[1], pair[1]]
    unbatched = input.dim() == 3
    output = torch.ops.ext.conv2d(input.unsqueeze(0) if unbatched else input, weight, bias, strides, paddings,
                                  dilations)
    return output.squeeze(0) if unbatched else output
