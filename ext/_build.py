"""Builds the extension once (JIT, ninja) into a cache directory and loads it.

The cache directory is keyed by a hash of everything that changes the binary
(sources, flags, torch version, CUDA on/off and architectures), so an edit
rebuilds and an unchanged tree loads the finished library directly, without
importing torch.utils.cpp_extension (that keeps `import ext` fast).

A build is complete only when its manifest (`manifest.json`, written last and
atomically) exists. One process builds while the others wait on an flock;
whoever takes the lock and finds no manifest clears what a killed build left
behind (half-written objects, torch's own `lock` file) and builds afresh.

Environment:
  LINEAR_LAB_BUILD_DIR  cache root (default ~/.cache/linear_lab)
  LINEAR_LAB_CUDA       1 forces the CUDA kernels in, 0 leaves them out
                        (default: in iff torch sees a GPU)
  TORCH_CUDA_ARCH_LIST  CUDA architectures (default: the visible GPUs', or
                        8.0;9.0 when CUDA is forced without a GPU)
  CUDA_HOME             CUDA toolkit root (default: found from nvcc)
"""
from __future__ import annotations

import datetime
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = "linear_lab_ext"
PYTHON_MODULE = "ext._calls"  # the library's pybind11 module (csrc/python_calls.cpp): ext.linear's direct calls
MANIFEST_NAME = "manifest.json"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's own lock file inside the build dir
CXX_FLAGS = ("-O3", "-std=c++20", "-fopenmp")  # OpenMP: at::parallel_for runs serially without it
CUDA_FLAGS = ("-O3", "-std=c++20")
CUDA_DEFINE = "-DLINEAR_LAB_WITH_CUDA"  # ops.cpp registers "rebuild with CUDA" errors without it
DEFAULT_CUDA_ARCHS = "8.0;9.0"  # A100 and H100: what a forced build without a GPU targets
# Each source edit builds into a new directory; after a build only this many of the most recently
# used ones stay (a build is 1.5 MB CPU-only, tens of MB with CUDA).
KEEP_BUILDS = 5
# Rough one-time build times on a 2-core machine, for the message shown while building.
BUILD_ESTIMATE_S = {False: 15, True: 120}


class BuildError(RuntimeError):
    """The extension failed to compile; the message names the log with the full output."""


@dataclass(frozen=True)
class BuildConfig:
    """Everything that decides what gets compiled and how."""

    with_cuda: bool
    cuda_archs: str  # TORCH_CUDA_ARCH_LIST for the build, "" when CPU-only
    sources: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    cuda_flags: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        if not self.with_cuda:
            return "CPU-only"
        return "with CUDA for " + ", ".join(_sm_name(arch) for arch in self.cuda_archs.split(";"))


def _sm_name(arch: str) -> str:
    return "sm_" + arch.replace(".", "").replace("+PTX", "")


def build_config(env=os.environ, cuda_available: bool | None = None,
                 gpu_archs: tuple[str, ...] | None = None) -> BuildConfig:
    """Decides sources and flags from the environment and the visible GPUs.

    Example:
        >>> build_config({"LINEAR_LAB_CUDA": "0"}).with_cuda
        False
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    forced = env.get("LINEAR_LAB_CUDA", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"LINEAR_LAB_CUDA must be 0 or 1, got {forced!r}")
    with_cuda = cuda_available if forced == "" else forced == "1"
    # ops, autograd, conv_ops, loss, python_calls; then the kernels
    sources = [*sorted(CSRC.glob("*.cpp")), *sorted((CSRC / "cpu").glob("*.cpp"))]
    if not with_cuda:
        return BuildConfig(False, "", tuple(map(str, sources)), CXX_FLAGS)
    sources += sorted((CSRC / "cuda").glob("*.cu"))
    archs = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs:
        if gpu_archs is None:
            gpu_archs = _visible_gpu_archs() if cuda_available else ()
        archs = ";".join(sorted(set(gpu_archs))) or DEFAULT_CUDA_ARCHS
    return BuildConfig(True, archs, tuple(map(str, sources)), (*CXX_FLAGS, CUDA_DEFINE), CUDA_FLAGS)


def _visible_gpu_archs() -> tuple[str, ...]:
    capabilities = (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    return tuple(f"{major}.{minor}" for major, minor in capabilities)


def build_key(config: BuildConfig) -> str:
    """A short hash of the sources (and headers) compiled plus flags, torch version and CUDA setup."""
    digest = hashlib.sha256()
    digest.update(json.dumps([torch.__version__, config.with_cuda, config.cuda_archs,
                              config.cxx_flags, config.cuda_flags]).encode())
    for path in sorted(CSRC.rglob("*")):
        in_cuda_dir = path.relative_to(CSRC).parts[0] == "cuda"
        if path.is_file() and (config.with_cuda or not in_cuda_dir):
            digest.update(str(path.relative_to(CSRC)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_root(env=os.environ) -> Path:
    return Path(env.get("LINEAR_LAB_BUILD_DIR") or Path.home() / ".cache" / "linear_lab")


def build_dir(config: BuildConfig, env=os.environ) -> Path:
    return build_root(env) / f"ext-{build_key(config)}"


def load_library(env=os.environ) -> dict:
    """Builds the extension if needed, loads it into torch.ops.ext, returns its manifest.

    Example:
        >>> load_library()["cuda"]["enabled"]
        False
    """
    config = build_config(env)
    directory = build_dir(config, env)
    manifest = _read_manifest(directory)
    if manifest is not None:
        try:
            os.utime(directory / MANIFEST_NAME)  # "recently used", for _prune_old_builds
        except FileNotFoundError:
            manifest = None  # another process's build pruned it a moment ago: build it again
        except OSError:
            pass  # a read-only cache: it loads all the same
    if manifest is None:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BuildError(f"cannot create the build cache {directory.parent} ({error.strerror}); "
                             "set LINEAR_LAB_BUILD_DIR to a writable directory") from None
        with _exclusive_lock(directory.with_name(directory.name + ".lock"), directory):
            manifest = _read_manifest(directory)  # another process may have built it meanwhile
            if manifest is None:
                manifest = _build(config, directory)
        _prune_old_builds(directory.parent, keep=directory)
    library = directory / manifest["library"]
    torch.ops.load_library(str(library))  # the ops, into torch.ops.ext
    _import_python_module(library)
    return manifest


def _import_python_module(library: Path) -> None:
    """Imports the loaded library's pybind11 module as PYTHON_MODULE (the same file: no second copy loads)."""
    if PYTHON_MODULE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(PYTHON_MODULE, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[PYTHON_MODULE] = module
    package, _, name = PYTHON_MODULE.rpartition(".")
    setattr(sys.modules[package], name, module)  # as an import of a submodule does


def _prune_old_builds(root: Path, keep: Path) -> None:
    """Deletes all but the KEEP_BUILDS most recently used build directories under root (keep stays).

    A directory whose lock another process holds (it is building there) is left alone; a process
    that loaded an old library keeps running, since the loaded file stays mapped after deletion.
    """
    def last_used_s(directory: Path) -> float:
        manifest = directory / MANIFEST_NAME
        return (manifest if manifest.exists() else directory).stat().st_mtime

    builds = [d for d in root.glob("ext-*") if d.is_dir() and d != keep and ".stale-" not in d.name]
    builds.sort(key=last_used_s, reverse=True)
    for directory in builds[KEEP_BUILDS - 1:]:
        lock_path = directory.with_name(directory.name + ".lock")
        with open(lock_path, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            shutil.rmtree(directory, ignore_errors=True)
            lock_path.unlink(missing_ok=True)


def _read_manifest(directory: Path) -> dict | None:
    """The manifest of a complete build in directory, else None."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return None
    return manifest if (directory / manifest["library"]).is_file() else None


@contextmanager
def _exclusive_lock(lock_path: Path, directory: Path):
    """flock on lock_path; the kernel drops it if the holder dies, so it cannot go stale."""
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            _say(f"waiting for process {holder}, which is building the extension into {directory}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(config: BuildConfig, directory: Path) -> dict:
    """Compiles into directory (we hold the lock and there is no manifest)."""
    _clear_interrupted_build(directory)
    directory.mkdir(parents=True)
    _say(f"building the extension ({config.describe()}) into {directory}; "
         f"about {BUILD_ESTIMATE_S[config.with_cuda]} s, once")
    started_s = time.perf_counter()
    try:
        with _temporary_env(_build_env(config)):
            cpp_extension = _import_cpp_extension(config)
            library = cpp_extension.load(
                name=LIBRARY_NAME,
                sources=list(config.sources),
                extra_cflags=list(config.cxx_flags),
                extra_cuda_cflags=list(config.cuda_flags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                with_cuda=config.with_cuda,
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, subprocess.CalledProcessError) as error:
        shutil.rmtree(directory)  # a failed build is not an interrupted one: leave nothing behind
        raise _build_error(str(error), directory.with_name(directory.name + ".build.log")) from None
    (directory / TORCH_LOCK_NAME).unlink(missing_ok=True)  # leave no lock file behind
    manifest = {
        "torch": torch.__version__,
        "compiler": _compiler_version(),
        "cxx_flags": list(config.cxx_flags),
        "kernels": config.describe(),
        "cuda": {"enabled": config.with_cuda, "archs": config.cuda_archs,
                 "flags": list(config.cuda_flags)},
        "sources": [str(Path(s).relative_to(CSRC)) for s in config.sources],
        "build_dir": str(directory),
        "library": Path(library).name,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_s": round(time.perf_counter() - started_s, 1),
    }
    partial = directory / (MANIFEST_NAME + ".partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(directory / MANIFEST_NAME)
    return manifest


def _clear_interrupted_build(directory: Path) -> None:
    """Removes what a killed build left: torch's `lock` file (which makes torch
    versions with a lock-file baton wait forever) and half-written outputs."""
    if not directory.exists():
        return
    leftovers = "torch's stale lock file and partial outputs" if (
        directory / TORCH_LOCK_NAME).exists() else "partial outputs"
    _say(f"a previous build in {directory} was interrupted; clearing {leftovers} and rebuilding")
    # Rename first: compilers orphaned by the killed build may still be writing
    # (relative to their working directory, which moves with the rename).
    stale = directory.with_name(f"{directory.name}.stale-{os.getpid()}")
    directory.rename(stale)
    shutil.rmtree(stale, ignore_errors=True)


def _import_cpp_extension(config: BuildConfig):
    """Imports torch.utils.cpp_extension (inside _build_env's environment, so that it
    finds the CUDA toolkit) without its "No CUDA runtime is found" warning: a CPU-only
    build needs no CUDA, and a forced CUDA build without a GPU is what was asked for."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    if config.with_cuda:
        # cpp_extension reads CUDA_HOME once at import; if something imported it
        # earlier it may hold a root without lib64 (e.g. /usr/local from nvcc's path).
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    return cpp_extension


def _find_cuda_home() -> str:
    """The toolkit root: nvcc's grandparent if it has lib64, else /usr/local/cuda."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if (root / "lib64").is_dir():
            return str(root)
    return "/usr/local/cuda"


def _build_env(config: BuildConfig) -> dict:
    """Environment for a build: CUDA's toolkit and architectures, only when CUDA is on."""
    if not config.with_cuda:
        return {}
    return {"TORCH_CUDA_ARCH_LIST": config.cuda_archs,
            "CUDA_HOME": os.environ.get("CUDA_HOME") or _find_cuda_home()}


@contextmanager
def _temporary_env(values: dict):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _build_error(output: str, log_path: Path) -> BuildError:
    """A short error: the first compiler error line and where the full output is."""
    log_path.write_text(output)
    lines = output.splitlines()
    first_error = next((line.strip() for line in lines if "error:" in line),
                       lines[-1].strip() if lines else "no output")
    return BuildError(f"building linear-lab's extension failed:\n  {first_error}\n"
                      f"full compiler output: {log_path}")


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
        return result.stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return f"{compiler} (version unknown)"


def _say(message: str) -> None:
    print(f"linear-lab: {message}", file=sys.stderr, flush=True)


__all__ = ["BuildConfig", "BuildError", "build_config", "build_dir", "build_key", "load_library"]
