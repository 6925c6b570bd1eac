"""Builds the CUDA-emulation test driver (driver.cpp + the real kernel headers) with g++,
once per variant, cached by a hash of the sources and flags.

Variants: "plain", ThreadSanitizer "tsan", AddressSanitizer (with the alignment check)
"asan", and the deliberately broken kernels ("break_*"), made by the EMU_BREAK_* switches
in ext/csrc/cuda/gemm.cuh, gemm_tc.cuh and conv.cuh, each under the tool that must catch it.

Also the CUDA ops' host code (host_ops.cpp with ext/csrc/cuda/linear_host.h and conv_host.h) as a torch
extension: host_ops_library().

Example:
    $ python tests/cuda_emu/build.py tsan      # prints the path of the built driver
"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

EMU_DIR = Path(__file__).resolve().parent
KERNEL_DIR = EMU_DIR.parents[1] / "ext" / "csrc" / "cuda"

_COMMON_FLAGS = ["-std=c++20", "-pthread", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"]
_TSAN = ["-O1", "-fsanitize=thread"]
# AddressSanitizer, and UndefinedBehaviorSanitizer's alignment check: a wide load through a
# misaligned pointer is an error too.
_ASAN = ["-O1", "-fsanitize=address,alignment", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
VARIANT_FLAGS = {
    "plain": ["-O2"],
    "tsan": _TSAN,
    "asan": _ASAN,
    "break_sync": [*_TSAN, "-DEMU_BREAK_SYNC"],
    "break_bounds": [*_ASAN, "-DEMU_BREAK_BOUNDS"],
    "break_barrier": ["-O2", "-DEMU_BREAK_BARRIER"],
    "break_alignment": [*_ASAN, "-DEMU_BREAK_ALIGNMENT"],
    "break_no_wait": ["-O2", "-DEMU_BREAK_NO_WAIT"],
    "break_wait_group": ["-O2", "-DEMU_BREAK_WAIT_GROUP"],
    "break_fragment": ["-O2", "-DEMU_BREAK_FRAGMENT"],
    "break_stage_barrier": [*_TSAN, "-DEMU_BREAK_STAGE_BARRIER"],
    "break_padding": [*_ASAN, "-DEMU_BREAK_PADDING"],
    "break_table_barrier": [*_TSAN, "-DEMU_BREAK_TABLE_BARRIER"],
}


def build_root() -> Path:
    root = os.environ.get("LINEAR_LAB_BUILD_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "linear_lab") / "emu"


def _sources() -> list[Path]:
    return sorted([*EMU_DIR.glob("*.h"), *EMU_DIR.glob("*.cpp"), *KERNEL_DIR.glob("*.cuh"), *KERNEL_DIR.glob("*.h"),
                   *KERNEL_DIR.parent.glob("*.h"), KERNEL_DIR.parent / "cpu" / "conv.h"])


def _digest(flags) -> str:
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in _sources():
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def driver_path(variant: str) -> Path:
    """The driver binary for `variant`, compiled now unless a build of the same sources exists."""
    flags = [*_COMMON_FLAGS, *VARIANT_FLAGS[variant]]
    binary = build_root() / f"driver-{variant}-{_digest(flags)}"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    command = ["g++", *flags, f"-I{EMU_DIR}", f"-I{KERNEL_DIR}", str(EMU_DIR / "driver.cpp"), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the emulation driver ({variant}) failed:\n{' '.join(command)}\n{result.stderr}")
    os.replace(partial, binary)  # atomic: a concurrent build never sees half a binary
    return binary


def host_ops_library() -> Path:
    """Builds (once per version of the sources) and loads the ext_cuda_emu ops: the CUDA ops' real host
    code on the CPU, its kernels emulated. Returns the library's path."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    flags = ["-std=c++20", "-O2", "-Wall", "-Wno-unknown-pragmas"]
    name = f"ext_cuda_emu_{_digest([*flags, torch.__version__])}"
    directory = build_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    if not library.exists():  # cpp_extension's own lock keeps concurrent builds apart
        cpp_extension.load(name, [str(EMU_DIR / "host_ops.cpp")], extra_cflags=flags,
                           extra_include_paths=[str(EMU_DIR), str(KERNEL_DIR)], build_directory=str(directory),
                           is_python_module=False, verbose=False)
    torch.ops.load_library(str(library))
    return library


if __name__ == "__main__":
    for name in sys.argv[1:] or ["plain"]:
        print(driver_path(name))
