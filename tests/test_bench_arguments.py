"""Every benchmark's command line refuses a bad value in one line before it times anything: a block that would
never end (--min-run-time inf), no rounds, a markdown file whose folder is missing (found only after the run),
and bench.resolution's train.py runs failing with train.py's own reason rather than a traceback."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import linear, machine, resolution

REPO = Path(__file__).resolve().parents[1]

BAD_ARGUMENTS = [
    ("linear", ["--min-run-time", "inf"], "argument --min-run-time: 'inf' is not a positive, finite number of seconds"),
    ("linear", ["--min-run-time", "nan"], "'nan' is not a positive, finite number of seconds"),
    ("linear", ["--rounds", "0"], "argument --rounds: '0' is not a positive integer"),
    ("linear", ["--markdown", "/no/such/folder/x.md"], "its folder /no/such/folder does not exist"),
    ("loss", ["--min-run-time", "-1"], "'-1' is not a positive, finite number of seconds"),
    ("loss", ["--rounds", "-1"], "'-1' is not a positive integer"),
    ("ceiling", ["--rounds", "two"], "'two' is not a positive integer"),
    ("ceiling", ["--markdown", "/no/such/folder/x.md"], "its folder /no/such/folder does not exist"),
    ("conv", ["--batch", "-1"], "argument --batch: '-1' is not a positive integer"),
    ("resolution", ["--sizes", "1280,abc"], "argument --sizes: 'abc' is not a positive integer"),
    ("resolution", ["--pairs", "0"], "argument --pairs: '0' is not a positive integer"),
    ("resolution", ["--threads", "0"], "argument --threads: '0' is not a positive integer"),
    ("train", ["--markdown", "/no/such/folder/x.md"], "its folder /no/such/folder does not exist"),
    # more threads than usable CPUs would time the OS's sharing of them (and 100,000 hung the FMA peak's reading)
    ("linear", ["--threads", "100000"], "bad thread count '100000' (100000 threads, but this process may use"),
    ("train", ["--threads", "100000"], "argument --threads: 100000 threads, but this process may use"),
    ("resolution", ["--threads", "100000"], "100000 threads, but this process may use"),
    ("loss", ["--shapes", "0x10"], "'0x10' is not batch x classes"),
]


@pytest.mark.parametrize("module, argv, message", BAD_ARGUMENTS)
def test_a_bad_value_is_refused_in_one_line_before_any_timing(module, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"bench.{module}").main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"python -m bench.{module}: error: ") and message in error, error


def test_a_failed_run_of_train_py_ends_the_table_with_train_pys_reason(monkeypatch, tmp_path):
    def failing(*args, **kwargs):
        return subprocess.CompletedProcess(args, 2, "", "some notice\nerror: trainer.threads=0 is invalid\n")

    monkeypatch.setattr(resolution.subprocess, "run", failing)
    with pytest.raises(SystemExit) as exit_info:
        resolution.run_once(tmp_path / "run", 1280, 2)
    assert exit_info.value.code == ("python -m bench.resolution: a run of train.py failed: "
                                    "error: trainer.threads=0 is invalid")


def test_run_tool_ends_ctrl_c_quietly_and_out_of_memory_in_one_line(capsys):
    def raising(error):
        def main():
            raise error
        return main

    with pytest.raises(SystemExit) as exit_info:
        machine.run_tool(raising(KeyboardInterrupt()))
    assert exit_info.value.code == 130
    allocator = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                             "you tried to allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)")
    with pytest.raises(SystemExit) as exit_info:
        machine.run_tool(raising(allocator))
    assert exit_info.value.code.startswith("error: out of memory ([enforce fail") and "give smaller sizes" in \
        exit_info.value.code
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        machine.run_tool(raising(RuntimeError("a bug")))


def test_a_shape_too_large_for_memory_ends_in_one_line():
    result = subprocess.run([sys.executable, "-m", "bench.linear", "--threads", "1", "--shapes", "1000000x1000000->1",
                             "--rounds", "1", "--min-run-time", "0.01"], capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: out of memory (")


def test_one_round_gives_no_range():
    assert linear.ratio_range([1.79]) == "-" and linear.ratio_range([1.0, 1.2]) == "1.00-1.20"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_the_cpus_named_are_those_this_process_may_use():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from bench import machine; " \
           "print(machine.describe_cpu()); print(machine.thread_count('all'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                            check=True)
    described, all_threads = result.stdout.strip().splitlines()
    assert f"1 of its {os.cpu_count()} CPUs usable here" in described and all_threads == "1"
