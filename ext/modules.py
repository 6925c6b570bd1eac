"""ext.Linear and ext.Conv2d, drop-ins for nn.Linear and nn.Conv2d running our kernels, and
replace_linears and replace_convs, which convert a model's layers in place."""
from collections import Counter
from typing import Optional

from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from ext.conv import conv2d
from ext.ops import linear, linear_relu

ACTIVATIONS = {None: linear, "relu": linear_relu}


class Linear(nn.Linear):
    """nn.Linear whose forward runs linear-lab's kernels.

    Same parameters, initialisation (it is nn.Linear's own reset_parameters), state_dict
    keys and repr as nn.Linear, so state_dicts move between the two both ways.
    activation="relu" fuses a following ReLU into the GEMM (relu(x·Wᵀ + b) in one pass).

    Example:
        >>> layer = ext.Linear(784, 256, activation="relu")
        >>> layer(torch.randn(128, 784)).shape
        torch.Size([128, 256])
    """

    # Typed for TorchScript, which cannot infer a type from None (nor read a postponed annotation,
    # so this module does not import annotations from __future__).
    activation: Optional[str]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: str | None = None):
        if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
            raise ValueError(f"ext.Linear: activation must be one of {list(ACTIVATIONS)}, "
                             f"got {activation!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input):
        # Named calls, not a table lookup, so that torch.fx records one node per layer. (A local
        # tested for None first: TorchScript compares an Optional[str] only once it knows it is a str.)
        activation = self.activation
        if activation is not None and activation == "relu":
            return linear_relu(input, self.weight, self.bias)
        return linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        activation = f", activation={self.activation}" if self.activation else ""
        return super().extra_repr() + activation

    @classmethod
    def from_linear(cls, module: nn.Linear, activation: str | None = None) -> "Linear":
        """A new ext.Linear sharing module's weight and bias (same tensors, device and dtype).

        It takes none of module's hooks; ext.replace_linears converts modules in place and
        keeps them, and also converts pruned and weight- or spectral-normed modules.

        Example:
            >>> fast = ext.Linear.from_linear(nn.Linear(784, 256))
        """
        _check_module("ext.Linear.from_linear", module, nn.Linear)
        if not isinstance(module.weight, nn.Parameter) or parametrize.is_parametrized(module):
            raise TypeError(f"ext.Linear.from_linear: this {type(module).__name__}'s weight is computed "
                            "(pruning, weight norm, spectral norm or a parametrization), so there is no "
                            "weight to share; use ext.replace_linears(module), which converts it in place")
        # Built on the meta device so that no throwaway init runs (and the RNG is untouched).
        new = cls(module.in_features, module.out_features, bias=module.bias is not None,
                  device="meta", activation=activation)
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new


def _check_module(caller, value, kind):
    """A TypeError naming what `caller` was given instead of an nn.`kind` (the module to convert)."""
    if not isinstance(value, kind):
        raise TypeError(f"{caller}: expected an nn.{kind.__name__}, got {type(value).__name__}")


def replace_linears(model: nn.Module, fuse_relu: bool = False) -> nn.Module:
    """Makes every nn.Linear in model an ext.Linear, in place, and returns model.

    Only each module's class changes: it stays the same object, with its parameters,
    hooks, pruning and weight or spectral norm (old style or parametrized), so a module
    shared between two places stays shared. Subclasses of nn.Linear are left alone:
    they may compute something else (MultiheadAttention's out_proj is never called).

    With fuse_relu, an ext.Linear directly followed by an nn.ReLU inside an nn.Sequential
    that runs its children in order takes the ReLU (activation="relu") and the ReLU's slot
    becomes nn.Identity, so state_dict keys stay the same. A pair is left unfused where
    fusing could change what someone observes: the Linear used elsewhere too, a forward or
    backward hook on the Linear, or any hook on the ReLU.

    Example:
        >>> model = ext.replace_linears(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        ...                             fuse_relu=True)
    """
    _check_module("ext.replace_linears", model, nn.Module)
    for module in model.modules():
        _convert(module)
    if fuse_relu:
        _fuse_relus(model)
    return model


def _convert(module: nn.Module) -> None:
    if type(module) is nn.Linear:
        module.__class__ = Linear
    elif parametrize.is_parametrized(module) and type(module).__bases__ == (nn.Linear,):
        # torch.nn.utils.parametrize gave the module a class of its own, derived from
        # nn.Linear and holding the parametrized properties: derive the same from ours.
        # (remove_parametrizations then restores the base class, ext.Linear.)
        parametrized = type(module)
        body = {key: value for key, value in vars(parametrized).items() if key not in ("__dict__", "__weakref__")}
        module.__class__ = type(parametrized.__name__, (Linear,), body)
    else:
        return
    module.activation = None


def _fuse_relus(model: nn.Module) -> None:
    uses = Counter(id(module) for module in model.modules(remove_duplicate=False))
    for sequential in model.modules():
        # A subclass with a forward of its own may not run its children one into the next.
        if not isinstance(sequential, nn.Sequential) or type(sequential).forward is not nn.Sequential.forward:
            continue
        names = list(sequential._modules)
        for name, next_name in zip(names, names[1:]):
            layer, following = sequential._modules[name], sequential._modules[next_name]
            if (isinstance(layer, Linear) and type(layer).forward is Linear.forward  # it honours activation
                    and layer.activation is None and uses[id(layer)] == 1
                    and not _has_hooks(layer, ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks"))
                    and type(following) is nn.ReLU and not _has_hooks(following, _HOOKS)):
                layer.activation = "relu"
                sequential._modules[next_name] = nn.Identity()


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _has_hooks(module: nn.Module, kinds) -> bool:
    return any(getattr(module, kind) for kind in kinds)


class Conv2d(nn.Conv2d):
    """nn.Conv2d whose forward runs linear-lab's convolution (ext.conv2d), for groups=1.

    Same parameters, initialisation, state_dict keys and repr as nn.Conv2d, so state_dicts
    move between the two both ways. padding_mode other than "zeros" pads with torch first,
    as nn.Conv2d does, then convolves with no padding.

    Example:
        >>> layer = ext.Conv2d(3, 64, 3, padding=1, bias=False)
        >>> layer(torch.randn(8, 3, 32, 32)).shape
        torch.Size([8, 64, 32, 32])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        if groups != 1:
            raise ValueError(f"ext.Conv2d: groups={groups} is not supported (only groups=1); keep this layer an "
                             "nn.Conv2d (ext.replace_convs leaves grouped convolutions as they are)")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Optional[Tensor]):  # typed for TorchScript
        if self.padding_mode != "zeros":  # nn.Conv2d's own handling of the other modes
            return conv2d(F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode), weight,
                          bias, self.stride, 0, self.dilation)
        return conv2d(input, weight, bias, self.stride, self.padding, self.dilation)

    @classmethod
    def from_conv2d(cls, module: nn.Conv2d) -> "Conv2d":
        """A new ext.Conv2d sharing module's weight and bias (same tensors, device and dtype).

        Example:
            >>> fast = ext.Conv2d.from_conv2d(nn.Conv2d(3, 64, 3))
        """
        _check_module("ext.Conv2d.from_conv2d", module, nn.Conv2d)
        if module.groups != 1:
            raise ValueError(f"ext.Conv2d.from_conv2d: groups={module.groups} is not supported (only groups=1); "
                             "keep this layer an nn.Conv2d")
        if not isinstance(module.weight, nn.Parameter) or parametrize.is_parametrized(module):
            raise TypeError(f"ext.Conv2d.from_conv2d: this {type(module).__name__}'s weight is computed "
                            "(pruning, weight norm, spectral norm or a parametrization), so there is no "
                            "weight to share; use ext.replace_convs(module), which converts it in place")
        new = cls(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                  module.dilation, 1, module.bias is not None, module.padding_mode, device="meta")
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new


def replace_convs(model: nn.Module) -> list[str]:
    """Makes every plain nn.Conv2d in model that ext.conv2d can run an ext.Conv2d, in place.

    As replace_linears, only each module's class changes (parameters, hooks and sharing stay), and
    subclasses of nn.Conv2d are left alone (they may compute something else). Plain ones it cannot
    run stay torch's and are returned by name with the reason, so a caller can say so: grouped (and
    depthwise) convolutions.

    Example:
        >>> left = ext.replace_convs(torchvision.models.mobilenet_v2())   # depthwise ones stay
    """
    left = []
    _check_module("ext.replace_convs", model, nn.Module)
    for name, module in model.named_modules():
        if type(module) is not nn.Conv2d and not (parametrize.is_parametrized(module)
                                                  and type(module).__bases__ == (nn.Conv2d,)):
            continue
        reason = "groups != 1" if module.groups != 1 else None
        if reason:
            left.append(f"{name or type(model).__name__} ({reason})")
        elif type(module) is nn.Conv2d:
            module.__class__ = Conv2d
        else:  # parametrized: its own class derives from nn.Conv2d; derive the same from ours
            parametrized = type(module)
            body = {key: value for key, value in vars(parametrized).items() if key not in ("__dict__", "__weakref__")}
            module.__class__ = type(parametrized.__name__, (Conv2d,), body)
    return left
