import os

from hypothesis import HealthCheck, settings

# Property tests: no per-example deadline (the machine is shared and noisy);
# in CI the examples are derandomised so a failure reproduces exactly.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
