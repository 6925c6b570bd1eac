"""The machine a figure was measured on, in one line, for every benchmark's header: a figure that does not
name its CPU cannot be compared with another (this project's CPU has changed under it several times). And
the command and markdown file that go with a benchmark's tables, and the argument types the benchmarks'
command lines share."""
import argparse
import math
import os
import platform
import sys
from pathlib import Path

ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))  # family 25's other models are Zen 3
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def caches() -> str:
    """'L1d 32K, L2 512K, L3 32768K' for the first core, or '' where the kernel does not say."""
    sizes = []
    for index in sorted(CACHE_DIR.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            sizes.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return ", ".join(sizes)


def amd_core(family: int, model: int) -> str | None:
    """The core design behind AMD's cpuid family and model: a cloud instance often says only "AMD EPYC"."""
    if family == 23:
        return "Zen/Zen 2"
    if family == 25:
        return "Zen 4" if any(model in models for models in ZEN4_MODELS) else "Zen 3"
    return "Zen 5" if family == 26 else None


def command_line(prog: str, argv=None) -> str:
    """The command that reproduces a benchmark's figures, as its markdown shows it: '`python -m bench.x --y`'."""
    arguments = argv if argv is not None else sys.argv[1:]
    return f"`{' '.join([prog, *arguments])}`"


def describe_device(device) -> str:
    """'cpu', or a GPU with its name: 'cuda (NVIDIA H200)', so that a GPU figure names the card it ran on."""
    import torch  # here: the rest of this module needs no torch
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a cgroup's cpuset, a SLURM job), not all the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def thread_count(text: str) -> int:
    """argparse type: a positive number of threads, at most the CPUs this process may use; more would time the
    operating system's sharing of the CPUs, not the kernels ('all': every usable CPU)."""
    count = usable_cpus() if text.strip() == "all" else positive_int(text)
    if count > usable_cpus():
        raise argparse.ArgumentTypeError(f"{count} threads, but this process may use {usable_cpus()} CPUs; "
                                         f"give at most {usable_cpus()}")
    return count


def run_tool(main) -> None:
    """Run a benchmark's main: Ctrl-C ends it quietly (exit 130, as train.py), and sizes too large for memory
    end in one line rather than the allocator's traceback."""
    import torch  # here, as in describe_device

    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        text = str(error)
        if not isinstance(error, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in text:
            raise
        first_line = " ".join(text.split("\n")[0].split())[:200]
        sys.exit(f"error: out of memory ({first_line or type(error).__name__}); give smaller sizes")


def positive_int(text: str) -> int:
    """argparse type: a positive integer (rounds, pairs, images, a batch)."""
    value = int(text) if text.strip().isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, '1280,5120' -> [1280, 5120]."""
    return [positive_int(item) for item in text.split(",")]


def positive_seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds (an infinite block would never end)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds")
    return value


def markdown_path(text: str) -> str:
    """argparse type: a file whose folder exists, checked before the benchmark runs rather than after it."""
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {folder} does not exist")
    return text


def write_markdown(path, lines, announce: bool = True) -> None:
    """Writes a benchmark's tables (markdown lines) to `path`, atomically, and says so if `announce`."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(lines))
    os.replace(partial, path)
    if announce:
        print(f"markdown written to {path}")


def describe_cpu() -> str:
    """'AMD EPYC (family 25, model 1: Zen 3; avx2, fma), 2 CPUs, L1d 32K, L2 512K, L3 32768K'."""
    info = cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    details = []
    if "cpu family" in info:
        family, model = int(info["cpu family"]), int(info.get("model", "0"))
        core = amd_core(family, model) if info.get("vendor_id") == "AuthenticAMD" else None
        details.append(f"family {family}, model {model}" + (f": {core}" if core else ""))
    flags = set(info.get("flags", "").split())
    vectors = [flag for flag in ("avx512f", "avx2", "fma") if flag in flags]
    if vectors:
        details.append(", ".join(vectors))
    text = f"{name} ({'; '.join(details)})" if details else name
    usable, total = usable_cpus(), os.cpu_count()
    cpus = f"{usable} CPUs" if usable == total else f"{usable} of its {total} CPUs usable here"
    return ", ".join(filter(None, [text, cpus, caches()]))
