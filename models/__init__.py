"""The networks: an MLP and the ResNets of He et al. (2015), built by name."""
from models.mlp import ACTIVATIONS, MLP
from models.resnet import RESNET_DEPTHS, ResNet

MODEL_NAMES = ("mlp", *(f"resnet{depth}" for depth in RESNET_DEPTHS))


def build_model(name, num_classes, in_channels=3, small_input=False, image_size=(224, 224), **options):
    """Build a network by name; `options` go to the MLP (hidden_sizes, activation, dropout).

    `image_size` (height, width) sizes the MLP's first layer; ResNets accept any size.
    `small_input=True` gives the ResNets a 3x3 stride-1 stem without max-pool (for images of 64 px or less).

    Example:
        >>> model = build_model("resnet18", num_classes=10, in_channels=1, small_input=True)
    """
    if name == "mlp":
        height, width = image_size
        return MLP(in_channels * height * width, num_classes, **options)
    if name in MODEL_NAMES:
        if options:
            raise ValueError(f"{name} takes no options, got {sorted(options)}")
        return ResNet(int(name.removeprefix("resnet")), num_classes, in_channels, small_input)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
