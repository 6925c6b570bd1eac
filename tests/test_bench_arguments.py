"""Every benchmark's command line refuses a bad value in one line before it times anything: a block that would
never end (--min-run-time inf), no rounds, a markdown file whose folder is missing (found only after the run),
and bench.resolution's train.py runs failing with train.py's own reason rather than a traceback."""
import importlib
import subprocess

import pytest

from bench import resolution

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
