"""ext.Linear, a drop-in for nn.Linear running our kernels, and replace_linears."""
from __future__ import annotations

from torch import nn

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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: str | None = None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"ext.Linear: activation must be one of {list(ACTIVATIONS)}, "
                             f"got {activation!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input):
        return ACTIVATIONS[self.activation](input, self.weight, self.bias)

    def extra_repr(self) -> str:
        activation = f", activation={self.activation}" if self.activation else ""
        return super().extra_repr() + activation

    @classmethod
    def from_linear(cls, module: nn.Linear, activation: str | None = None) -> Linear:
        """An ext.Linear sharing module's weight and bias (same tensors, device and dtype).

        Example:
            >>> fast = ext.Linear.from_linear(nn.Linear(784, 256))
        """
        # Built on the meta device so that no throwaway init runs (and the RNG is untouched).
        new = cls(module.in_features, module.out_features, bias=module.bias is not None,
                  device="meta", activation=activation)
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new


def replace_linears(model: nn.Module, fuse_relu: bool = False) -> nn.Module:
    """Swaps every nn.Linear in model for an ext.Linear sharing its weights, in place.

    With fuse_relu, an nn.Linear directly followed by nn.ReLU inside an nn.Sequential
    becomes ext.Linear(activation="relu") followed by nn.Identity, so state_dict keys
    stay the same. Returns model (or the new module if model itself is an nn.Linear).

    Example:
        >>> model = ext.replace_linears(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        ...                             fuse_relu=True)
    """
    if type(model) is nn.Linear:
        return Linear.from_linear(model)
    for name, child in model._modules.items():  # every slot, even one sharing a module with another
        if child is not None:
            model._modules[name] = replace_linears(child, fuse_relu)
    if fuse_relu and isinstance(model, nn.Sequential):
        names = list(model._modules)
        for name, next_name in zip(names, names[1:]):
            layer, following = model._modules[name], model._modules[next_name]
            if type(layer) is Linear and layer.activation is None and type(following) is nn.ReLU:
                model._modules[name] = Linear.from_linear(layer, activation="relu")
                model._modules[next_name] = nn.Identity()
    return model
