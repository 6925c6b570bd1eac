"""A multilayer perceptron over flattened images."""
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Sequential):
    """Flatten, then (Linear, activation[, Dropout]) per hidden size, then a Linear classifier.

    Each Linear is directly followed by its activation, so `ext.replace_linears(model, fuse_relu=True)`
    can fuse the pair into one op.

    Example:
        >>> model = MLP(784, 10, hidden_sizes=[256, 256])
    """

    def __init__(self, in_features, num_classes, hidden_sizes=(256, 256), activation="relu", dropout=0.0):
        layers = [nn.Flatten()]
        for width in hidden_sizes:
            layers += [nn.Linear(in_features, width), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        super().__init__(*layers)
