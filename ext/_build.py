"""Builds the extension once (JIT, ninja) and loads it. Minimal first version."""
import fcntl
import hashlib
import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parent / "csrc"
CXX_FLAGS = ["-O3", "-std=c++20"]


def _build_key() -> str:
    digest = hashlib.sha256()
    digest.update(torch.__version__.encode())
    digest.update(" ".join(CXX_FLAGS).encode())
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(CSRC)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    root = Path(os.environ.get("LINEAR_LAB_BUILD_DIR", Path.home() / ".cache" / "linear_lab"))
    return root / f"ext-{_build_key()}"


def load_library() -> Path:
    directory = build_dir()
    library = directory / "linear_lab_ext.so"
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait
        if library.exists():
            torch.ops.load_library(str(library))
            return library
        sources = [CSRC / "ops.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
        cpp_extension.load(
            name="linear_lab_ext",
            sources=[str(s) for s in sources],
            extra_cflags=CXX_FLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    return library
