"""memory.keep_freed_memory: glibc keeps freed memory for reuse, so a repeated step stops faulting pages in."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer import memory

REPO = Path(__file__).resolve().parents[1]

# Three tensors of argv[2] MiB made, filled and freed together, 40 times. glibc's own thresholds adapt as a
# process runs, so whether such a step faults its pages in every time varies from process to process (4 in 10
# here with 4 MiB, 2,016 pages each time); the child starts with thresholds that make it hand every freed
# block back, so that it always does unless keep_freed_memory takes effect.
STEPS = textwrap.dedent("""
    import ctypes, os, sys, torch
    from trainer import memory
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the host's huge-page setting
    kept = None
    if sys.argv[1] == "keep":
        for name in memory.GLIBC_ENV_SETTINGS:  # glibc has read them at start; now they are the defaults
            os.environ.pop(name, None)
        kept = memory.keep_freed_memory()
    for step in range(60):
        if step == 20:
            before = memory.minor_page_faults()
        tensors = [torch.ones(int(sys.argv[2]) << 18) for _ in range(3)]
        del tensors
    print(kept, (memory.minor_page_faults() - before) / 40)
""")
GIVE_EVERYTHING_BACK = {"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"}


def faults_per_step(mode, mib=4, **glibc_env):
    env = {name: value for name, value in os.environ.items() if name not in memory.CHOICE_ENV}
    result = subprocess.run([sys.executable, "-c", STEPS, mode, str(mib)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**env, "PYTHONPATH": str(REPO), **glibc_env})
    assert result.returncode == 0, result.stderr[-2000:]
    kept, faults = result.stdout.split()
    return kept, float(faults)


glibc_only = pytest.mark.skipif(memory.glibc() is None, reason="glibc's malloc only")


@glibc_only
def test_freed_memory_is_kept_and_steps_stop_faulting():
    _, faults = faults_per_step("default", **GIVE_EVERYTHING_BACK)
    assert faults > 2000  # of the 3 x 1,024 pages of 4 KiB, every step
    kept, faults = faults_per_step("keep", **GIVE_EVERYTHING_BACK)
    assert kept == "True" and faults < 2


@glibc_only
def test_blocks_larger_than_any_mmap_threshold_are_kept_too():
    # 33 MiB: a CIFAR ResNet's 64 channels of 32x32 at batch 128 are 32 MiB and a little more, above the
    # largest mmap threshold glibc takes; with the defaults such blocks are mapped afresh on every allocation
    _, faults = faults_per_step("default", mib=33)
    assert faults > 3 * 33 * 256 * 0.9  # (33 MiB = 8,448 pages of 4 KiB)
    kept, faults = faults_per_step("keep", mib=33)
    assert kept == "True" and faults < 2


class NoMallopt:
    """A C library whose mallopt must not be called."""

    @property
    def mallopt(self):
        raise AssertionError("mallopt called although the environment chose the allocator")


@pytest.mark.parametrize("name, value", [("MALLOC_TRIM_THRESHOLD_", "131072"), ("MALLOC_MMAP_THRESHOLD_", "131072"),
                                         ("MALLOC_MMAP_MAX_", "0"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
                                         ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")])
def test_the_environments_choice_of_allocator_rules(monkeypatch, name, value):
    for other in memory.CHOICE_ENV:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setattr(memory, "glibc", NoMallopt)
    monkeypatch.setenv(name, value)
    assert memory.keep_freed_memory() is False
