import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch.utils._python_dispatch import TorchDispatchMode

# Property tests: no per-example deadline (the machine is shared and noisy);
# in CI the examples are derandomised so a failure reproduces exactly.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


# How far an operator's result may be from a reference, from the arithmetic: a sum of n rounded terms with
# random signs errs by at most LAMBDA * sqrt(n) * u * sum(|terms|) with probability at least
# 1 - 2n exp(-LAMBDA^2 / 2) (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019), for any order of summation,
# blocked or not, fused multiply-adds or not; u is the result's unit roundoff plus the reference's. LAMBDA = 8
# keeps a false failure below 1e-10 per element at n = 3001. (The worst-case bound, n * u, is sqrt(n) looser.)
LAMBDA = 8.0


def rounding_bound(dtype, terms, reference_dtype=torch.float64):
    """The factor of sum(|terms|) that a sum of `terms` rounded terms (bias included) may err by."""
    unit_roundoff = (torch.finfo(dtype).eps + torch.finfo(reference_dtype).eps) / 2
    return LAMBDA * math.sqrt(max(terms, 1)) * unit_roundoff


def assert_within_rounding(ours, reference, magnitude, terms, reference_dtype=torch.float64):
    """Every element of ours within rounding_bound * magnitude (the sum of its terms' absolute values) of
    the reference (float64 unless said otherwise)."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    error = (ours.double() - reference.double()).abs()
    allowed = rounding_bound(ours.dtype, terms, reference_dtype) * magnitude.double()
    if not (error <= allowed).all():
        worst = (error / allowed.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        raise AssertionError(f"error up to {worst:.3g} x the rounding bound of {terms} terms in {ours.dtype}")


@contextlib.contextmanager
def num_threads(count):
    """torch's intra-op thread count set to count inside the block, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def restore_threads():
    """A benchmark's main sets torch's thread count for the rest of the process, as a command should; the tests
    after it must not inherit it."""
    with num_threads(torch.get_num_threads()):
        yield


@pytest.fixture
def allow_tf32():
    """torch.backends.cuda.matmul.allow_tf32 on for one test (a global flag, CPU builds included): our CUDA
    float32 GEMM then takes the tensor cores in TF32, as torch's own matmuls do."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def tf32_round(x):
    """float32 values rounded to TF32 as cvt.rna.tf32.f32 does: to nearest, ties away from zero."""
    bits = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF  # as unsigned
    rounded = (bits + 0x1000) & 0xFFFFE000  # finite inputs only: no carry into infinity here
    return (rounded - ((rounded >> 31) << 32)).to(torch.int32).view(torch.float32)


class OpLog(TorchDispatchMode):
    """Records the name of every op that runs inside the block, in order (`with OpLog() as log:`)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class FunctionCalls(torch.overrides.TorchFunctionMode):
    """Records every function a torch function mode sees inside the block (`with FunctionCalls() as log:`)."""

    def __init__(self):
        super().__init__()
        self.functions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.functions.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def vmap_needs_batching_rules():
    # Without this, vmap runs an op with no batching rule once per sample, silently.
    torch._C._functorch._set_vmap_fallback_enabled(False)
    yield
    torch._C._functorch._set_vmap_fallback_enabled(True)
