"""linear-lab's hand-written operators: our own C++/CUDA GEMM kernels behind nn.Linear's
interface, a CPU convolution on the same GEMM behind nn.Conv2d's, and the trainer's loss
(cross_entropy, F.cross_entropy's mean in one kernel each way).

Example:
    >>> import torch, ext
    >>> layer = ext.Linear(784, 256)          # drop-in for nn.Linear
    >>> y = ext.linear(torch.randn(32, 784), layer.weight, layer.bias)

The first import compiles the extension once (see ext/_build.py); later imports load it.
"""
from ext._build import BuildError, load_library

build_manifest = load_library()

from ext.conv import conv2d  # noqa: E402  (needs the loaded ops)
from ext.modules import Conv2d, Linear, replace_convs, replace_linears  # noqa: E402
from ext.ops import cross_entropy, linear, linear_relu  # noqa: E402

__all__ = ["BuildError", "Conv2d", "Linear", "build_manifest", "conv2d", "cross_entropy", "linear", "linear_relu",
           "replace_convs", "replace_linears"]
