"""Building the extension: what gets compiled, the cache, concurrent first use,
recovery from a killed build, compile errors, and `python -m ext`.

Fresh builds run in subprocesses (one process can load only one copy of the ops)
into temporary cache roots: two CPU builds (~10-20 s each) and one CUDA build for one architecture (~60 s)."""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ext
from ext import _build

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "ext" / "csrc"
BUILDING = "building the extension (CPU-only) into "


def cpu_build_env(root):
    return {**os.environ, "LINEAR_LAB_BUILD_DIR": str(root), "LINEAR_LAB_CUDA": "0", "PYTHONPATH": str(REPO)}


def run_python(code, env, timeout_s=600):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


# ---- what gets compiled (no compiler needed) ----

OPS_SOURCES = [CSRC / name for name in ("autograd.cpp", "conv_ops.cpp", "loss.cpp", "ops.cpp", "python_calls.cpp")]


def test_cpu_only_when_torch_sees_no_gpu():
    config = _build.build_config({}, cuda_available=False)
    assert not config.with_cuda and config.cuda_archs == "" and config.describe() == "CPU-only"
    assert [Path(s) for s in config.sources] == [*OPS_SOURCES, *sorted((CSRC / "cpu").glob("*.cpp"))]
    assert CSRC / "cpu" / "conv.cpp" in map(Path, config.sources)
    assert _build.CUDA_DEFINE not in config.cxx_flags
    assert _build._build_env(config) == {}


def test_forcing_cuda_without_gpu_targets_default_archs():
    config = _build.build_config({"LINEAR_LAB_CUDA": "1"}, cuda_available=False)
    assert config.with_cuda and config.cuda_archs == "8.0;9.0"
    assert config.describe() == "with CUDA for sm_80, sm_90"
    cuda_sources = sorted((CSRC / "cuda").glob("*.cu"))
    assert [Path(s) for s in config.sources] == [*OPS_SOURCES, *sorted((CSRC / "cpu").glob("*.cpp")), *cuda_sources]
    assert _build.CUDA_DEFINE in config.cxx_flags and config.cuda_flags
    build_env = _build._build_env(config)
    assert build_env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    if not os.environ.get("CUDA_HOME") and shutil.which("nvcc"):  # found, with the runtime library
        assert (Path(build_env["CUDA_HOME"]) / "lib64").is_dir()


def test_users_arch_list_is_honoured():
    config = _build.build_config({"LINEAR_LAB_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "8.6+PTX"},
                                 cuda_available=False)
    assert config.cuda_archs == "8.6+PTX" and config.describe() == "with CUDA for sm_86"


def test_gpu_present_builds_for_its_archs_unless_switched_off():
    with_gpu = _build.build_config({}, cuda_available=True, gpu_archs=("8.9", "8.0", "8.9"))
    assert with_gpu.with_cuda and with_gpu.cuda_archs == "8.0;8.9"
    assert not _build.build_config({"LINEAR_LAB_CUDA": "0"}, cuda_available=True).with_cuda


def test_bad_cuda_switch_is_rejected():
    with pytest.raises(ValueError, match="LINEAR_LAB_CUDA must be 0 or 1, got 'yes'"):
        _build.build_config({"LINEAR_LAB_CUDA": "yes"}, cuda_available=False)


def test_build_key_separates_cpu_cuda_and_archs():
    cpu = _build.build_config({}, cuda_available=False)
    cuda_a = _build.build_config({"LINEAR_LAB_CUDA": "1"}, cuda_available=False)
    cuda_b = _build.build_config({"LINEAR_LAB_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0"}, cuda_available=False)
    keys = [_build.build_key(c) for c in (cpu, cuda_a, cuda_b)]
    assert len(set(keys)) == 3 and keys[0] == _build.build_key(cpu)
    assert _build.build_dir(cpu, {"LINEAR_LAB_BUILD_DIR": "/x"}) == Path("/x") / f"ext-{keys[0]}"


def test_this_process_loaded_the_current_sources():
    manifest = ext.build_manifest
    assert Path(manifest["build_dir"]).name == f"ext-{_build.build_key(_build.build_config())}"
    assert (Path(manifest["build_dir"]) / manifest["library"]).is_file()


# ---- a compile error is short and points at the full log ----

def test_compile_error_is_short_and_names_the_log(tmp_path, capsys):
    broken = tmp_path / "broken.cpp"
    broken.write_text("int f() { return undefined_name_in_broken_cpp; }\n")
    config = _build.BuildConfig(False, "", (str(broken),), _build.CXX_FLAGS)
    directory = tmp_path / "ext-broken"
    with pytest.raises(_build.BuildError) as info:
        _build._build(config, directory)
    message = str(info.value)
    log = tmp_path / "ext-broken.build.log"
    assert "undefined_name_in_broken_cpp" in message and f"full compiler output: {log}" in message
    assert len(message.splitlines()) == 3
    assert "undefined_name_in_broken_cpp" in log.read_text() and "FAILED" in log.read_text()
    assert not directory.exists()  # nothing half-built left to be mistaken for an interrupted build
    assert info.value.__suppress_context__  # no chained 60-line torch traceback


# ---- real builds, in subprocesses ----

@pytest.fixture(scope="module")
def built_root(tmp_path_factory):
    """A cache root built by three processes importing ext at once."""
    root = tmp_path_factory.mktemp("concurrent")
    code = "import ext; print(ext.build_manifest['build_dir'])"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=cpu_build_env(root), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(proc.wait(timeout=600), *proc.communicate()) for proc in procs]
    return root, results


def test_concurrent_first_use_builds_once(built_root):
    root, results = built_root
    assert [rc for rc, _, _ in results] == [0, 0, 0], [stderr for _, _, stderr in results]
    build_dirs = {stdout.strip() for _, stdout, _ in results}
    assert len(build_dirs) == 1
    stderrs = [stderr for _, _, stderr in results]
    assert sum(BUILDING in stderr for stderr in stderrs) == 1
    builder = next(stderr for stderr in stderrs if BUILDING in stderr)
    assert builder.strip().endswith("s, once") and len(builder.strip().splitlines()) == 1
    assert not any("No CUDA runtime" in stderr for stderr in stderrs)
    for stderr in stderrs:  # the others said nothing or that they were waiting
        assert stderr == builder or stderr == "" or "waiting for process" in stderr
    directory = Path(build_dirs.pop())
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["build_dir"] == str(directory) and manifest["cuda"]["enabled"] is False
    assert not (directory / "lock").exists()


def test_later_import_loads_without_building(built_root):
    root, _ = built_root
    result = run_python("import sys, ext; print('torch.utils.cpp_extension' in sys.modules)",
                        cpu_build_env(root))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.strip() == "False"  # the fast path never touches the build machinery


def test_python_m_ext_reports_the_build(built_root):
    root, results = built_root
    result = subprocess.run([sys.executable, "-m", "ext"], env=cpu_build_env(root), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stderr == ""
    report = dict((part.strip() for part in line.split(":", 1)) for line in result.stdout.splitlines()[1:])
    assert report["torch"] == torch.__version__
    assert report["compiler"].strip()
    assert report["CPU code path"] == torch.ops.ext.cpu_path()  # same machine, same choice
    sizes = torch.ops.ext.cpu_block_sizes(torch.ops.ext.cpu_path(), "float32")
    assert report["CPU blocking"].startswith(f"float32 tile {sizes['wide_mr']}x{sizes['wide_nr']} ")
    assert f"KC {sizes['kc']} " in report["CPU blocking"] and f"MC {sizes['mc']}," in report["CPU blocking"]
    assert f"Yᵀ = W·Xᵀ from {sizes['transposed_min_rows']} rows where" in report["CPU blocking"]
    tall = f", {sizes['tall_mr']}x{sizes['tall_nr']} for {sizes['tall_mr']} rows,"  # only where it is a tile of its own
    assert (tall in report["CPU blocking"]) == (sizes["tall_mr"] != sizes["wide_mr"])
    assert f", {sizes['one_vector_mr']}x{sizes['lanes']} for a last panel of one vector), " in report["CPU blocking"]
    assert (f"up to K = {sizes['max_shallow_depth']}, operands read in place, rows in panels of "
            f"{sizes['shallow_mr']}x{sizes['shallow_nr']} tiles") in report["CPU blocking"]
    assert re.fullmatch(r"\d+ GFLOP/s float32 on \d+ threads \(measured now\)|n/a .*", report["FMA peak"])
    assert report["kernels"].startswith("CPU-only (no CUDA kernels; LINEAR_LAB_CUDA=1 python -m ext")
    assert report["build dir"] == results[0][1].strip()


def test_killed_build_is_detected_and_cleared(tmp_path):
    env = cpu_build_env(tmp_path)
    victim = subprocess.Popen([sys.executable, "-c", "import ext"], env=env, cwd=REPO, text=True,
                              stderr=subprocess.PIPE, start_new_session=True)
    line = victim.stderr.readline()
    assert BUILDING in line
    directory = Path(line.split(BUILDING)[1].split(";")[0])
    deadline_s = time.monotonic() + 300
    while not (directory / "build.ninja").exists() and time.monotonic() < deadline_s:
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole job: python, ninja and the compilers
    victim.wait()
    assert (directory / "lock").exists()  # torch's lock file, left behind by the killed builder
    assert not (directory / "manifest.json").exists()

    result = run_python("import ext", env)
    assert result.returncode == 0, result.stderr
    assert (f"a previous build in {directory} was interrupted; clearing torch's stale lock file "
            "and partial outputs and rebuilding") in result.stderr
    assert (directory / "manifest.json").exists() and not (directory / "lock").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                    reason="no CUDA toolkit (nvcc) here to compile the CUDA kernels")
def test_forced_cuda_build_compiles_loads_and_keeps_the_cpu_kernels(tmp_path):
    # One architecture halves nvcc's time; the default list is checked without compiling above.
    env = {**cpu_build_env(tmp_path), "LINEAR_LAB_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "8.0"}
    expected = "with CUDA for sm_80"
    code = ("import torch, ext; print(torch._C._dispatch_dump('ext::linear')); "
            "print(ext.linear(torch.ones(2, 3), torch.ones(4, 3)).sum().item())")
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert f"building the extension ({expected}) into " in result.stderr
    assert "No CUDA runtime" not in result.stderr
    assert re.search(r"^CUDA: registered at .*cuda/linear_cuda\.cu", result.stdout, re.MULTILINE)
    assert result.stdout.splitlines()[-1] == "24.0"  # the CPU kernels still answer CPU tensors
    report = subprocess.run([sys.executable, "-m", "ext"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert f"kernels:        {expected}\n" in report.stdout


def test_python_m_ext_refuses_an_argument_it_does_not_take():
    result = subprocess.run([sys.executable, "-m", "ext", "--bogus"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2 and "python -m ext: error: unrecognized arguments: --bogus" in result.stderr
    assert "linear-lab extension" not in result.stdout


def test_old_builds_are_pruned_keeping_the_recent_and_the_busy(tmp_path):
    def fake_build(name, used_s):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "manifest.json").write_text("{}")
        os.utime(directory / "manifest.json", (used_s, used_s))
        directory.with_name(name + ".lock").touch()
        return directory

    builds = [fake_build(f"ext-{i:016x}", used_s=1_000_000 + i) for i in range(8)]  # ext-...7 is the newest
    busy = fake_build("ext-busy", used_s=1)  # the oldest, but another process is building there
    current = fake_build("ext-current", used_s=0)
    other_files = tmp_path / "emu"
    other_files.mkdir()
    with open(busy.with_name("ext-busy.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build._prune_old_builds(tmp_path, keep=current)
    kept = {current, busy, *builds[-(_build.KEEP_BUILDS - 1):]}
    assert {d for d in tmp_path.glob("ext-*") if d.is_dir()} == kept
    assert {p.name for p in tmp_path.glob("*.lock")} == {d.name + ".lock" for d in kept}
    assert other_files.is_dir()


def test_loading_a_build_marks_it_recently_used(built_root):
    root, results = built_root
    manifest = Path(results[0][1].strip()) / "manifest.json"
    os.utime(manifest, (1, 1))
    assert run_python("import ext", cpu_build_env(root)).returncode == 0
    assert manifest.stat().st_mtime > time.time() - 600
