"""A few calls of one CUDA product of ext.linear, on random data, for a profiler to read one of them:

    ncu --clock-control none -k regex:gemm_kernel --launch-skip 2 --launch-count 1 \\
        python -m bench.profile_cuda --precision bfloat16 --shape 4096x4096->4096

The first calls load the module and warm the caches; with --launch-skip 2 ncu reads the third kernel.
`scripts/gpu_day.sh` runs this under ncu for the 4096^3 forward in float32 and bfloat16 (bench/README.md,
"On a GPU", reads one such report).
"""
from __future__ import annotations

import argparse
import sys

import torch

import ext
from bench.linear import CUDA_PRECISIONS, parse_shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=list(CUDA_PRECISIONS), default="bfloat16")
    parser.add_argument("--shape", type=parse_shapes, default=[(4096, 4096, 4096)], help="batch x in->out")
    parser.add_argument("--pass", dest="pass_name", choices=["forward", "backward"], default="forward")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)
    if len(args.shape) != 1 or args.calls < 1:
        parser.error("give one --shape and --calls of at least 1")
    if not torch.cuda.is_available():
        parser.exit(1, "bench.profile_cuda: needs a CUDA GPU (torch.cuda.is_available() is False)\n")

    dtype, allow_tf32 = CUDA_PRECISIONS[args.precision]
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    (batch, in_features, out_features), = args.shape
    backward = args.pass_name == "backward"
    x = torch.randn(batch, in_features, device="cuda").to(dtype).requires_grad_(backward)
    w = torch.randn(out_features, in_features, device="cuda").to(dtype).requires_grad_(backward)
    for _ in range(args.calls):
        y = ext.linear(x, w, None)
        if backward:
            y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    print(f"{args.calls} x ext.linear {args.pass_name}, {batch}x{in_features}->{out_features}, {args.precision}, "
          f"on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    sys.exit(main())
