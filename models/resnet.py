"""ResNet-18/34/50/101/152 as in "Deep Residual Learning for Image Recognition" (He et al., 2015).

The layout matches torchvision's models parameter for parameter (stride in the bottleneck's 3x3
convolution, "ResNet v1.5"), so parameter counts agree exactly.
"""
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions around an identity (or 1x1 projection) shortcut; ResNet-18/34."""

    expansion = 1

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = projection(in_channels, channels * self.expansion, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) around the shortcut; ResNet-50/101/152."""

    expansion = 4

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = projection(in_channels, out_channels, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def projection(in_channels, out_channels, stride):
    """The shortcut: identity when shapes agree, else a strided 1x1 convolution and batch norm."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))


# depth -> (block, blocks per stage), Table 1 of the paper
RESNET_DEPTHS = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}
STAGE_CHANNELS = (64, 128, 256, 512)


class ResNet(nn.Module):
    """A ResNet of the given depth (18, 34, 50, 101 or 152).

    Example:
        >>> model = ResNet(50, num_classes=1000)  # 25,557,032 parameters, like torchvision's resnet50
    """

    def __init__(self, depth, num_classes=1000, in_channels=3, small_input=False):
        super().__init__()
        block, blocks_per_stage = RESNET_DEPTHS[depth]
        width = STAGE_CHANNELS[0]
        if small_input:  # small images keep their resolution: a 3x3 stride-1 stem and no max-pool
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 1, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, padding=1),
            )
        stages = []
        for stage, (channels, num_blocks) in enumerate(zip(STAGE_CHANNELS, blocks_per_stage)):
            stride = 1 if stage == 0 else 2
            for index in range(num_blocks):
                stages.append(block(width, channels, stride if index == 0 else 1))
                width = channels * block.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(self.pool(x).flatten(1))
