"""ext.Linear as a drop-in for nn.Linear, replace_linears, torch.compile and torch.fx."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune
from conftest import FunctionCalls, OpLog

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


@pytest.mark.parametrize("activation,op", [(None, "ext.linear"), ("relu", "ext.linear_relu")])
def test_forward_runs_our_kernel(activation, op):
    layer = ext.Linear(4, 3, activation=activation)
    with OpLog() as log:
        layer(torch.randn(2, 4))
    assert op in log.ops and "aten.addmm" not in log.ops and "aten.mm" not in log.ops


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation must be one of \\[None, 'relu'\\], got 'gelu'"):
        ext.Linear(4, 3, activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of \\[None, 'relu'\\], got \\['relu'\\]"):
        ext.Linear(4, 3, activation=["relu"])  # a list: said as such, not "unhashable type"


@pytest.mark.parametrize("call, message", [
    (lambda: ext.replace_linears(None), "ext.replace_linears: expected an nn.Module, got NoneType"),
    (lambda: ext.replace_convs("model"), "ext.replace_convs: expected an nn.Module, got str"),
    (lambda: ext.Linear.from_linear(nn.Conv2d(3, 4, 1)), "ext.Linear.from_linear: expected an nn.Linear, got Conv2d"),
    (lambda: ext.Conv2d.from_conv2d(nn.Linear(3, 4)), "ext.Conv2d.from_conv2d: expected an nn.Conv2d, got Linear"),
])
def test_converting_something_that_is_no_such_module_says_what_it_got(call, message):
    with pytest.raises(TypeError, match=f"^{message}$"):
        call()


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


def test_replace_linears_on_a_bare_linear_converts_it_in_place():
    layer = nn.Linear(3, 2)
    weight = layer.weight
    assert ext.replace_linears(layer) is layer
    assert type(layer) is ext.Linear and layer.weight is weight and layer.activation is None


def test_a_linear_shared_by_two_slots_stays_one_module():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    ext.replace_linears(model)
    assert model[0] is model[2] is shared and type(shared) is ext.Linear


NORMALISATIONS = {
    "prune": lambda layer: prune.l1_unstructured(layer, "weight", amount=0.5),
    "weight_norm": lambda layer: torch.nn.utils.weight_norm(layer),
    "spectral_norm": lambda layer: torch.nn.utils.spectral_norm(layer),
    "parametrized weight_norm": lambda layer: parametrizations.weight_norm(layer),
    "parametrized spectral_norm": lambda layer: parametrizations.spectral_norm(layer),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.weight_norm is deprecated, still used
@pytest.mark.parametrize("normalise", NORMALISATIONS.values(), ids=NORMALISATIONS)
def test_replace_linears_converts_pruned_and_normed_linears(normalise):
    # Their weight is computed from other parameters before each forward: the module must
    # keep that machinery (it used to raise a TypeError, leaving the model half converted).
    def build():  # twice from one seed: deepcopy refuses the old-style normed modules
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()
        normalise(model[2])
        return model.eval()  # spectral norm's power iteration would otherwise change the weight each call

    reference, model = build(), build()
    head = model[2]
    assert ext.replace_linears(model, fuse_relu=True) is model and model[2] is head
    assert isinstance(head, ext.Linear) and isinstance(model[0], ext.Linear)
    assert list(model.state_dict()) == list(reference.state_dict())
    input = torch.randn(4, 6, dtype=torch.float64)
    with OpLog() as log:
        ours = outputs_and_grads(model, input)
    assert "ext.linear" in log.ops and "aten.addmm" not in log.ops and "aten.mm" not in log.ops
    assert_all_close(ours, outputs_and_grads(reference, input), torch.float64)


def test_removing_a_parametrization_leaves_an_ext_linear():
    layer = parametrizations.weight_norm(nn.Linear(4, 3))
    ext.replace_linears(layer)
    parametrize.remove_parametrizations(layer, "weight")
    assert type(layer) is ext.Linear


def test_subclasses_of_nn_linear_are_left_alone():
    attention = nn.MultiheadAttention(8, 2)  # its out_proj is an nn.Linear subclass that is never called
    ext.replace_linears(attention)
    assert not isinstance(attention.out_proj, ext.Linear)


def test_from_linear_refuses_a_computed_weight_and_says_what_to_use():
    layer = nn.Linear(4, 3)
    prune.random_unstructured(layer, "weight", amount=0.5)
    with pytest.raises(TypeError, match="weight is computed .* use ext.replace_linears"):
        ext.Linear.from_linear(layer)


def test_hooks_survive_the_conversion():
    layer = nn.Linear(4, 3)
    calls = []
    layer.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    layer.register_forward_hook(lambda module, args, output: calls.append("post"))
    layer.register_full_backward_hook(lambda module, grad_input, grad_output: calls.append("backward"))
    model = ext.replace_linears(nn.Sequential(layer))
    assert type(model[0]) is ext.Linear
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert calls == ["pre", "post", "backward"]


# Every kind of module hook, each recording what it sees: a fused pair would change what the
# Linear's hooks see (values before ReLU, gradients not yet masked by it) and would drop the
# ReLU's hooks altogether.
HOOKS = {
    "forward_pre": lambda module, seen: module.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].sum().item())),
    "forward": lambda module, seen: module.register_forward_hook(
        lambda m, args, output: seen.append(output.sum().item())),
    "backward_pre": lambda module, seen: module.register_full_backward_pre_hook(
        lambda m, grad_output: seen.append(grad_output[0].abs().sum().item())),
    "backward": lambda module, seen: module.register_full_backward_hook(
        lambda m, grad_input, grad_output: seen.append(grad_output[0].abs().sum().item())),
}
# The Linear's forward pre-hook sees its input, which fusion does not change: that pair fuses.
UNFUSABLE = [("linear", "forward"), ("linear", "backward_pre"), ("linear", "backward"),
             *(("relu", kind) for kind in HOOKS)]


def forward_backward(model):
    input = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    output = model(input)
    output.square().sum().backward()
    return output, input.grad


@pytest.mark.parametrize("hook_on,kind", [*UNFUSABLE, ("linear", "forward_pre")])
def test_fusion_only_where_no_hook_would_see_the_difference(hook_on, kind):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = copy.deepcopy(reference)
    seen_by_reference, seen = [], []
    layer = 0 if hook_on == "linear" else 1
    HOOKS[kind](reference[layer], seen_by_reference)  # after the copy: a copied hook would share the list
    HOOKS[kind](model[layer], seen)
    ext.replace_linears(model, fuse_relu=True)
    assert (model[0].activation == "relu") == ((hook_on, kind) not in UNFUSABLE)
    for ours, theirs in zip(forward_backward(model), forward_backward(reference), strict=True):
        torch.testing.assert_close(ours, theirs)
    assert seen and seen == pytest.approx(seen_by_reference)


class ReversedSequential(nn.Sequential):
    def forward(self, input):  # runs its children last to first
        for module in reversed(self):
            input = module(input)
        return input


def test_no_fusion_inside_a_sequential_with_its_own_forward():
    torch.manual_seed(0)
    reference = ReversedSequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model = copy.deepcopy(reference)
    ext.replace_linears(model, fuse_relu=True)
    assert type(model[1]) is nn.ReLU
    input = torch.randn(8, 4)
    torch.testing.assert_close(model(input), reference(input))


class OwnForwardLinear(ext.Linear):
    def forward(self, input):  # its own forward: it would not apply a fused activation
        return ext.linear(input, self.weight, self.bias)


def test_no_fusion_into_a_subclass_with_its_own_forward():
    torch.manual_seed(0)
    reference = nn.Sequential(OwnForwardLinear(4, 4), nn.ReLU())
    model = copy.deepcopy(reference)
    ext.replace_linears(model, fuse_relu=True)
    assert type(model[1]) is nn.ReLU
    input = torch.randn(8, 4)
    torch.testing.assert_close(model(input), reference(input))


def test_no_fusion_of_a_linear_also_used_without_relu():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    reference = nn.Sequential(shared, nn.ReLU(), shared)  # the second use must stay unrectified
    model = copy.deepcopy(reference)
    ext.replace_linears(model, fuse_relu=True)
    assert model[0].activation is None and type(model[1]) is nn.ReLU
    input = torch.randn(8, 4)
    torch.testing.assert_close(model(input), reference(input))


def test_torch_fx_records_one_call_per_layer():
    torch.manual_seed(0)
    model = ext.replace_linears(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), fuse_relu=True)
    traced = torch.fx.symbolic_trace(model)
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    assert targets == [ext.linear_relu, ext.linear]
    input = torch.randn(2, 7, 6)  # leading dimensions are resolved when the graph runs
    torch.testing.assert_close(traced(input), model(input))


def test_torch_function_modes_see_ext_linear():
    input, weight, bias = torch.randn(3, 4), torch.randn(2, 4), torch.randn(2)
    with FunctionCalls() as log:
        output = ext.linear(input, weight, bias)
    assert log.functions == [ext.linear]
    torch.testing.assert_close(output, torch.nn.functional.linear(input, weight, bias))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(ext.Linear(12, 16, activation="relu"), ext.Linear(16, 16), nn.Tanh(),
                          ext.Linear(16, 3, bias=False))
    input = torch.randn(7, 12)
    compiled = torch.compile(model, fullgraph=True)
    assert_all_close(outputs_and_grads(compiled, input), outputs_and_grads(model, input), torch.float32)


# torch.jit.script, save and load warn that TorchScript is deprecated; it still works, and so must we.
script_is_deprecated = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(script|save|load)` is deprecated:FutureWarning")


@script_is_deprecated
@pytest.mark.parametrize("shape", [(7, 12), (2, 3, 12), (12,)], ids=["2-D", "3-D", "1-D"])
def test_torch_jit_script_matches_eager(shape):
    torch.manual_seed(0)
    model = nn.Sequential(ext.Linear(12, 16, activation="relu"), ext.Linear(16, 16), nn.Tanh(),
                          ext.Linear(16, 3, bias=False)).double()
    scripted = torch.jit.script(model)
    input = torch.randn(shape, dtype=torch.float64)
    assert_all_close(outputs_and_grads(scripted, input), outputs_and_grads(model, input), torch.float64)


@script_is_deprecated
def test_a_scripted_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = ext.replace_linears(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), fuse_relu=True)
    torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")
    input = torch.randn(4, 6)
    with OpLog() as log:
        loaded(input)
    assert {"ext.linear_relu", "ext.linear"} <= set(log.ops) and not set(log.ops) & {"aten.addmm", "aten.mm"}
    assert_all_close(outputs_and_grads(loaded, input), outputs_and_grads(model, input), torch.float32)


@script_is_deprecated
@pytest.mark.parametrize("function, relu", [(ext.linear, False), (ext.linear_relu, True)])
def test_scripted_functions_match_f_linear(function, relu):
    scripted = torch.jit.script(function)
    input, weight, bias = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    for b in (bias, None):
        expected = torch.nn.functional.linear(input, weight, b)
        torch.testing.assert_close(scripted(input, weight, b), expected.relu() if relu else expected)
