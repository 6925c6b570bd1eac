"""Keep freed memory in the process for reuse instead of handing it back to the system (glibc malloc).

glibc gives the free memory at the top of its heap back to the system once more than M_TRIM_THRESHOLD of it
is free, and serves blocks above M_MMAP_THRESHOLD from fresh mappings that free unmaps; it adapts both as a
process runs, and takes no mmap threshold above 32 MiB. A training step allocates and frees the same tensors
step after step, so every step can fault them all in again, a page of 4 KiB at a time. Here every block comes
from the heap (M_MMAP_MAX = 0) and the heap is trimmed only beyond 1 GiB free. Measured here: three 4 MiB
tensors (3,072 pages) made and freed together fault 2,016 pages every time in about 4 processes of 10 with
the defaults, and none with freed memory kept; a CIFAR ResNet-18 step at batch 128, whose 64-channel
activations are 32 MiB and a little more, faulted 267,000-281,000 pages (torch's convolutions) and
134,000-169,000 (ours) with the threshold at 32 MiB, and none from the heap: the step took 23% (torch) and
12% (ours) less time (Zen 5, 2 threads). torch and our operator allocate through the same malloc, and the
setting applies to both alike.

The cost: memory freed at the peak of a step stays with the process (as with jemalloc or tcmalloc, which
PyTorch's CPU tuning guide recommends for the same reason). A thread's own arena still maps a block larger
than its 64 MiB heaps (glibc falls back to mmap then).
"""
import ctypes
import os

try:
    import resource  # Unix only; without it no page faults are counted
except ImportError:
    resource = None

TRIM_THRESHOLD_BYTES = 1 << 30  # give back free memory only beyond 1 GiB
MMAP_MAX = 0  # no block from a fresh mapping: the largest mmap threshold glibc takes, 32 MiB, is too small
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # from glibc's malloc.h
# glibc's own settings; when the environment sets one, the user has chosen, and it rules
GLIBC_ENV_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")
# Allocators loaded in glibc's place: mallopt would then tune a malloc nobody uses
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# Every environment variable user_chose_malloc reads
CHOICE_ENV = (*GLIBC_ENV_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD")


def user_chose_malloc() -> bool:
    """The environment sets glibc's malloc (GLIBC_ENV_SETTINGS, GLIBC_TUNABLES=glibc.malloc.*) or preloads another
    allocator: then it rules."""
    preload = os.environ.get("LD_PRELOAD", "")
    return (any(os.environ.get(name) for name in GLIBC_ENV_SETTINGS)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
            or any(name in preload for name in OTHER_ALLOCATORS))


def glibc():
    """The C library this process runs on, if it is glibc (mallopt's numbers mean something else elsewhere)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        return libc
    except (OSError, AttributeError, TypeError):  # TypeError: Windows cannot load "no library"
        return None


def keep_freed_memory() -> bool:
    """Fix glibc's trim threshold and mmap limit (above) for the rest of the process. True if they were set; False
    off glibc (macOS, musl, Windows) or when the user chose (user_chose_malloc)."""
    if user_chose_malloc():
        return False
    libc = glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and mallopt(_M_MMAP_MAX, MMAP_MAX) == 1


def set_up(keep: bool = True) -> str:
    """Keeps freed memory for reuse (unless keep is False) and says which malloc setting the process has, for
    the trainer's log and the benchmarks' headers."""
    if not keep:
        return "the C library's defaults (--malloc-defaults)"
    if keep_freed_memory():
        return "freed memory kept for reuse (trainer/memory.py)"
    return "the C library's own (not glibc, or the environment chose: trainer.memory.user_chose_malloc)"


def minor_page_faults() -> int:
    """Page faults of this process so far that the kernel served from memory, without disk (0 where unknown):
    what memory handed back to the system and touched again costs."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0
