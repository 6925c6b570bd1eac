"""models/: ResNets match torchvision parameter for parameter; the MLP; both run with ext.Linear."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torchvision
from torch import nn

import ext
import models
from trainer import build, config


@pytest.mark.parametrize("depth", [18, 34, 50, 101, 152])
def test_resnet_parameter_count_equals_torchvision(depth):
    ours = models.build_model(f"resnet{depth}", num_classes=1000)
    theirs = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("depth, block", [(18, models.resnet.BasicBlock), (50, models.resnet.Bottleneck)])
def test_resnet_uses_the_papers_block(depth, block):
    model = models.build_model(f"resnet{depth}", num_classes=10)
    blocks = [m for m in model.modules() if isinstance(m, (models.resnet.BasicBlock, models.resnet.Bottleneck))]
    assert blocks and all(type(m) is block for m in blocks)


def test_small_input_stem_keeps_resolution():
    small = models.build_model("resnet18", num_classes=10, small_input=True)
    large = models.build_model("resnet18", num_classes=10)
    assert not any(isinstance(m, nn.MaxPool2d) for m in small.modules())
    assert small.stem[0].kernel_size == (3, 3) and small.stem[0].stride == (1, 1)
    x = torch.randn(2, 3, 32, 32)
    assert small.stem(x).shape[-2:] == (32, 32)
    assert large.stem(x).shape[-2:] == (8, 8)  # 7x7 stride 2, then max-pool stride 2


@pytest.mark.parametrize("in_channels", [1, 3])
def test_resnet_forward_backward_with_ext_linear_matches_nn_linear(in_channels):
    torch.manual_seed(0)
    reference = models.build_model("resnet18", num_classes=10, in_channels=in_channels, small_input=True)
    custom = ext.replace_linears(copy.deepcopy(reference), fuse_relu=True)
    assert type(custom.fc) is ext.Linear
    x = torch.randn(4, in_channels, 8, 8)
    outputs = []
    for model in (reference, custom):
        out = model(x)
        out.square().mean().backward()
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    for (name, p_ref), (_, p_custom) in zip(reference.named_parameters(), custom.named_parameters(), strict=True):
        torch.testing.assert_close(p_custom.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_mlp_flattens_any_input_and_is_configurable():
    model = models.build_model(
        "mlp", num_classes=7, in_channels=2, image_size=(5, 3), hidden_sizes=[16, 8], activation="gelu", dropout=0.5
    )
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(30, 16), (16, 8), (8, 7)]
    assert sum(isinstance(m, nn.GELU) for m in model) == 2 and sum(isinstance(m, nn.Dropout) for m in model) == 2
    assert model(torch.randn(4, 2, 5, 3)).shape == (4, 7)


def test_mlp_relus_fuse_into_ext_linear():
    model = ext.replace_linears(models.build_model("mlp", num_classes=10, in_channels=1, image_size=(8, 8)),
                                fuse_relu=True)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is ext.Linear for m in linears)
    assert [m.activation for m in linears] == ["relu", "relu", None]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="resnet19.*mlp, resnet18"):
        models.build_model("resnet19", num_classes=10)
    with pytest.raises(ValueError, match="no options"):
        models.build_model("resnet18", num_classes=10, hidden_sizes=[3])


@pytest.mark.parametrize("image_size, small", [((64, 64), True), ((32, 8), True), ((65, 65), False), ((32, 65), False)])
def test_the_trainer_gives_images_of_64_px_or_less_the_small_input_stem(image_size, small):
    # the larger side decides: a 32x65 image is not small
    dataset = SimpleNamespace(image_shape=(3, *image_size), num_classes=10)
    net = build.network(config.load_config(["model=resnet18"]), dataset)
    stem = net.stem[0]
    assert (stem.kernel_size, stem.stride) == (((3, 3), (1, 1)) if small else ((7, 7), (2, 2)))
    assert any(isinstance(module, nn.MaxPool2d) for module in net.modules()) is not small
