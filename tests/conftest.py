import contextlib
import os

import torch
from hypothesis import HealthCheck, settings

# Property tests: no per-example deadline (the machine is shared and noisy);
# in CI the examples are derandomised so a failure reproduces exactly.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@contextlib.contextmanager
def num_threads(count):
    """torch's intra-op thread count set to count inside the block, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
