"""ext.Linear as a drop-in for nn.Linear, replace_linears, and torch.compile."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ext


def outputs_and_grads(module, input):
    module.zero_grad()
    input = input.detach().clone().requires_grad_()
    output = module(input)
    output.square().sum().backward()
    return [output.detach(), input.grad] + [p.grad for p in module.parameters()]


def assert_all_close(ours, theirs, dtype):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_init_as_nn_linear_under_same_seed(bias, dtype):
    torch.manual_seed(7)
    reference = nn.Linear(33, 17, bias=bias, dtype=dtype)
    torch.manual_seed(7)
    ours = ext.Linear(33, 17, bias=bias, dtype=dtype)
    assert ours.weight.shape == (17, 33) and ours.weight.dtype == dtype
    assert torch.equal(ours.weight, reference.weight)
    assert (ours.bias is None) == (not bias)
    if bias:
        assert torch.equal(ours.bias, reference.bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_state_dict_round_trips_both_ways(bias, dtype):
    reference, ours = nn.Linear(20, 9, bias=bias, dtype=dtype), ext.Linear(20, 9, bias=bias, dtype=dtype)
    assert list(ours.state_dict()) == list(reference.state_dict())
    input = torch.randn(6, 20, dtype=dtype)

    ours.load_state_dict(reference.state_dict())
    assert_all_close(outputs_and_grads(ours, input), outputs_and_grads(reference, input), dtype)

    other = nn.Linear(20, 9, bias=bias, dtype=dtype)
    other.load_state_dict(ext.Linear(20, 9, bias=bias, dtype=dtype).state_dict())
    ours.load_state_dict(other.state_dict())
    assert_all_close(outputs_and_grads(ours, input), outputs_and_grads(other, input), dtype)


def test_repr_matches_nn_linear():
    assert repr(ext.Linear(4, 3, bias=False)) == repr(nn.Linear(4, 3, bias=False))
    assert ext.Linear(4, 3).extra_repr() == nn.Linear(4, 3).extra_repr()
    assert ext.Linear(4, 3, activation="relu").extra_repr() == "in_features=4, out_features=3, bias=True, activation=relu"


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation,op", [(None, "ext.linear"), ("relu", "ext.linear_relu")])
def test_forward_runs_our_kernel(activation, op):
    layer = ext.Linear(4, 3, activation=activation)
    with OpNames() as log:
        layer(torch.randn(2, 4))
    assert op in log.names and "aten.addmm" not in log.names and "aten.mm" not in log.names


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation must be one of \\[None, 'relu'\\], got 'gelu'"):
        ext.Linear(4, 3, activation="gelu")


def test_fused_relu_matches_linear_then_relu():
    torch.manual_seed(0)
    fused = ext.Linear(12, 8, activation="relu", dtype=torch.float64)
    reference = nn.Sequential(nn.Linear(12, 8, dtype=torch.float64), nn.ReLU())
    reference[0].load_state_dict(fused.state_dict())
    input = torch.randn(10, 12, dtype=torch.float64)
    assert_all_close(outputs_and_grads(fused, input), outputs_and_grads(reference, input), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_from_linear_shares_weights_and_keeps_dtype(dtype):
    reference = nn.Linear(5, 4, dtype=dtype).train(False)
    rng_state = torch.random.get_rng_state()
    ours = ext.Linear.from_linear(reference)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # no throwaway init consumed the RNG
    assert type(ours) is ext.Linear and not ours.training
    assert ours.weight is reference.weight and ours.bias is reference.bias
    assert ours.weight.device == reference.weight.device and ours.weight.dtype == dtype
    no_bias = ext.Linear.from_linear(nn.Linear(5, 4, bias=False))
    assert no_bias.bias is None and "bias" not in no_bias.state_dict()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16),
                                      nn.Tanh(), nn.Linear(16, 8), nn.ReLU(inplace=True))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x))


@pytest.mark.parametrize("fuse_relu", [False, True])
def test_replace_linears_keeps_weights_and_outputs(fuse_relu):
    torch.manual_seed(0)
    reference = Net().double()
    model = Net().double()
    model.load_state_dict(reference.state_dict())
    assert ext.replace_linears(model, fuse_relu=fuse_relu) is model
    assert list(model.state_dict()) == list(reference.state_dict())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(type(m) is ext.Linear for m in model.modules()) == 4
    fused = [m for m in model.modules() if type(m) is ext.Linear and m.activation == "relu"]
    assert len(fused) == (2 if fuse_relu else 0)  # Linear→ReLU twice; Linear→Tanh and the head stay plain
    input = torch.randn(5, 3, 4, dtype=torch.float64)
    assert_all_close(outputs_and_grads(model, input), outputs_and_grads(reference, input), torch.float64)


def test_replace_linears_on_a_bare_linear_returns_an_ext_linear():
    layer = nn.Linear(3, 2)
    replaced = ext.replace_linears(layer)
    assert type(replaced) is ext.Linear and replaced.weight is layer.weight


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(ext.Linear(12, 16, activation="relu"), ext.Linear(16, 16), nn.Tanh(),
                          ext.Linear(16, 3, bias=False))
    input = torch.randn(7, 12)
    compiled = torch.compile(model, fullgraph=True)
    assert_all_close(outputs_and_grads(compiled, input), outputs_and_grads(model, input), torch.float32)
