"""Sweeps on a real SLURM cluster (tests/slurm_cluster.py: a single-node cluster with accounting, started for
this module): arrays that summarise, a job failing in Python, jobs SLURM kills, requests no node can meet,
a cluster that does not answer, a machine without SLURM, and torchrun under srun.

On a machine without SLURM's packages or root these tests skip, except in CI (CI=true), where they must run.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import train
from slurm_cluster import ClusterError, SlurmCluster, free_port, missing_programs
from trainer import build, config, summary

REPO = Path(__file__).resolve().parents[1]
SMALL_JOB = ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]  # two fit at once on 2 cores
SWEEP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = None
    if missing_programs():
        reason = (f"SLURM's programs are missing ({', '.join(missing_programs())}): apt-get install slurmctld "
                  "slurmd slurm-client slurmdbd munge mariadb-server")
    elif os.geteuid() != 0:
        reason = "the test cluster runs its daemons as root"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)  # CI installs them: a skip there would hide the SLURM tests
        pytest.skip(reason)
    try:
        running = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    except ClusterError as error:
        pytest.fail(str(error))
    yield running
    running.stop()


def sweep(cluster, tmp_path, *overrides, background=False):
    """`python train.py -m hydra/launcher=slurm ...` from `tmp_path`, its sweep folder tmp_path/sweep."""
    command = [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", *overrides,
               f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    if background:
        return subprocess.Popen(command, cwd=tmp_path, env=cluster.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=tmp_path, env=cluster.env, capture_output=True, text=True,
                          timeout=SWEEP_TIMEOUT_S)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:") or "Traceback" in line]


def accounted_jobs(cluster):
    """sacct's (job id, state) for every job and array task the cluster ran, steps left out."""
    lines = cluster.client("sacct", "--allusers", "--noheader", "--parsable2", "-o", "JobID,State",
                           check=True).stdout.splitlines()
    return [tuple(line.split("|")) for line in lines if "." not in line.split("|")[0]]


def wait_until(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_a_sweep_runs_as_one_array_on_the_cores_slurm_gave_and_summarizes(cluster, tmp_path):
    before = len(accounted_jobs(cluster))
    result = sweep(cluster, tmp_path, *SMALL_JOB, "linear=torch,custom", "trainer.epochs=1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert not error_lines(result.stderr)
    jobs = accounted_jobs(cluster)[before:]
    array = jobs[0][0].split("_")[0]
    assert sorted(jobs) == [(f"{array}_0", "COMPLETED"), (f"{array}_1", "COMPLETED")]  # one array, two tasks
    rows = list(summary.job_rows(tmp_path / "sweep"))
    assert [row["linear"] for row in rows] == ["torch", "custom"] and not any("error" in row for row in rows)
    markdown = (tmp_path / "sweep" / "summary.md").read_text()
    assert "## linear=custom vs linear=torch" in markdown and markdown in result.stdout
    for row in rows:  # trainer.threads=auto: the one CPU each job was given, though the node has two
        assert "cpu, 1 thread |" in (tmp_path / "sweep" / row["job"] / "train.log").read_text()


def test_a_job_failing_in_python_leaves_failed_txt_and_the_sweep_exits_1_with_its_summary(cluster, tmp_path):
    result = sweep(cluster, tmp_path, "hydra.launcher.cpus_per_task=2", "hydra.launcher.mem_gb=2",
                   "optim.lr=0.001,1e6", "trainer.epochs=1")
    assert result.returncode == 1, result.stderr[-3000:]
    good, bad = summary.job_rows(tmp_path / "sweep")
    assert "error" not in good and "2 threads" in (tmp_path / "sweep" / good["job"] / "train.log").read_text()
    failure = (tmp_path / "sweep" / bad["job"] / "failed.txt").read_text()
    assert "loss" in failure and bad["error"] == failure.strip()
    assert bad["job"] in (tmp_path / "sweep" / "summary.md").read_text()
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr)[-1].startswith("error: 1 job(s) failed:")


def test_jobs_slurm_kills_are_listed_with_their_state_and_the_command_that_reruns_them(cluster, tmp_path):
    # Three jobs, one CPU each: job 0 finishes, job 1 is cancelled while it trains, job 2 runs past its
    # 1-minute limit. The sweep must still summarise all three, and exit 1.
    process = sweep(cluster, tmp_path, *SMALL_JOB, "hydra.launcher.timeout_min=1", "trainer.epochs=1,100000,100000",
                    background=True)
    try:
        def task_running(index):
            queue = cluster.client("squeue", "--noheader", "-o", "%i %T").stdout.split("\n")
            return any(re.fullmatch(rf"\d+_{index} RUNNING", line.strip()) for line in queue)

        wait_until(lambda: task_running(1) and list((tmp_path / "sweep").glob("1_*/train.log")), 120, "job 1")
        array = cluster.client("squeue", "--noheader", "-o", "%F").stdout.split()[0]
        cluster.client("scancel", f"{array}_1", check=True)
        stdout, stderr = process.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    finished, cancelled, timed_out = summary.job_rows(tmp_path / "sweep")
    assert "error" not in finished
    assert f"SLURM ended job {array}_1 before it finished, CANCELLED" in cancelled["error"]
    assert cancelled["error"].endswith("rerun it: python train.py -m hydra/launcher=slurm "
                                       "hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=2 "
                                       "hydra.launcher.timeout_min=1 trainer.epochs=100000")
    assert f"SLURM ended job {array}_2 before it finished, TIMEOUT" in timed_out["error"]
    assert timed_out["error"].endswith("with hydra.launcher.timeout_min doubled: python train.py -m "
                                       "hydra/launcher=slurm hydra.launcher.cpus_per_task=1 hydra.launcher.mem_gb=2 "
                                       "hydra.launcher.timeout_min=2 trainer.epochs=100000")
    for row in (cancelled, timed_out):
        assert (tmp_path / "sweep" / row["job"] / "failed.txt").read_text().strip() == row["error"]
        assert f"error: job {row['job']}: SLURM ended job" in stderr
    markdown = (tmp_path / "sweep" / "summary.md").read_text()
    assert "3 jobs, 2 failed" in markdown and markdown in stdout
    # no USR2 "time limit near" (it is for requeues, and SLURM may send it in a job's first second, killing it)
    (script,) = (tmp_path / "sweep" / ".submitit").glob("*/*_submission.sh")
    assert "#SBATCH --signal=URG@1" in script.read_text() and "USR2" not in script.read_text()
    states = dict(accounted_jobs(cluster))
    assert (states[f"{array}_1"], states[f"{array}_2"]) == ("CANCELLED by 0", "TIMEOUT")


@pytest.mark.parametrize("overrides, message", [
    (["hydra.launcher.cpus_per_task=64"], "hydra.launcher.cpus_per_task=64 asks each job for 64 CPUs, and the "
     "nodes of the default partition have at most {cpus}: lower it"),
    (["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=100000"], "hydra.launcher.mem_gb=100000 asks each "
     "job for 100000 GB of memory, and the nodes of the default partition have at most {memory_gb}: lower it"),
    (["hydra/launcher=slurm_gpu"], "hydra.launcher.gpus_per_node=1 asks each job for 1 GPU, and the nodes of the "
     "default partition have none: lower it, or use hydra/launcher=slurm for CPU jobs"),
    (SMALL_JOB + ["hydra.launcher.partition=gpu"], "hydra.launcher.partition=gpu is not a partition of this "
     "cluster; choose one of: debug, short"),
])
def test_a_request_no_node_can_meet_is_one_line_before_anything_is_submitted(cluster, tmp_path, overrides, message):
    before = accounted_jobs(cluster)
    result = sweep(cluster, tmp_path, *overrides, "trainer.epochs=1")
    assert result.returncode == 2
    assert error_lines(result.stderr) == ["error: " + message.format(
        cpus=cluster.cpus, memory_gb=cluster.memory_mb // 1024)]
    assert accounted_jobs(cluster) == before


def test_a_request_sbatch_refuses_is_one_line(cluster, tmp_path):
    # the short partition allows 1 minute; EnforcePartLimits makes sbatch refuse 5 at once
    result = sweep(cluster, tmp_path, *SMALL_JOB, "hydra.launcher.partition=short", "hydra.launcher.timeout_min=5",
                   "trainer.epochs=1")
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: SLURM refused the sweep: sbatch: error: Batch job submission failed:")
    assert "time limit" in line


def test_sbatch_without_a_reachable_controller_is_one_line(cluster, tmp_path):
    unreachable = tmp_path / "slurm.conf"
    unreachable.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", cluster.conf.read_text()))
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", *SMALL_JOB, "trainer.epochs=1"],
        cwd=tmp_path, env={**cluster.env, "SLURM_CONF": str(unreachable)}, capture_output=True, text=True,
        timeout=SWEEP_TIMEOUT_S)
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: the SLURM cluster does not answer (sinfo: ")
    assert "Unable to contact slurm controller" in line and line.endswith("drop hydra/launcher to run the sweep here")


def test_torchrun_under_srun_trains_one_run_on_two_tasks_to_the_single_process_weights(cluster, tmp_path):
    # scripts/torchrun.sbatch as the README gives it, with two tasks on this one node standing for two nodes
    overrides = ["optim=sgd", "trainer.epochs=2", "trainer.threads=1", f"hydra.run.dir={tmp_path / 'run'}"]
    submitted = subprocess.run(
        ["sbatch", "--wait", f"--chdir={REPO}", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--mem=4G", f"--output={tmp_path / 'slurm.out'}", f"--export=ALL,RDZV_PORT={free_port()}",
         str(REPO / "scripts" / "torchrun.sbatch"), *overrides],
        env={**cluster.env, "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}"},  # torchrun
        capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    log = (tmp_path / "slurm.out").read_text() if (tmp_path / "slurm.out").exists() else ""
    assert submitted.returncode == 0, submitted.stderr + log[-3000:]
    assert "cpu, 1 thread each, 2 processes (gloo)" in (tmp_path / "run" / "train.log").read_text()
    train.fit(config.load_config(overrides[:2]), tmp_path / "single")
    distributed, single = (torch.load(tmp_path / name / "last.pt", weights_only=True)["model"]
                           for name in ("run", "single"))
    for key in single:
        torch.testing.assert_close(distributed[key], single[key], rtol=1e-5, atol=1e-6, msg=key)


def test_threads_auto_uses_the_cpus_slurm_gave_the_job_where_slurm_does_not_pin_them(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert build.threads_per_process("auto") == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cores + 8))  # never more than this process may run on
    assert build.threads_per_process("auto") == cores


@pytest.mark.parametrize("launcher, gpus, cpus, memory_gb", [("slurm", None, 4, 8), ("slurm_gpu", 1, 8, 32)])
def test_the_cpu_and_gpu_launcher_profiles_compose_with_a_clusters_settings(launcher, gpus, cpus, memory_gb):
    with initialize_config_dir(str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={launcher}", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    settings = cfg.hydra.launcher
    assert settings._target_ == "hydra_plugins.linear_lab.slurm_launcher.SlurmLauncher"
    assert (settings.partition, settings.timeout_min, settings.nodes, settings.tasks_per_node) == ("gpu", 240, 1, 1)
    assert (settings.gpus_per_node, settings.cpus_per_task, settings.mem_gb) == (gpus, cpus, memory_gb)


def test_a_slurm_sweep_on_a_machine_without_sbatch_is_one_line_before_any_run_folder(tmp_path):
    # only the virtual environment's programs on PATH: no sbatch, whether or not this machine has SLURM
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "linear=torch"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PATH": str(Path(sys.executable).parent)})
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: hydra/launcher=slurm submits to a SLURM cluster, and sbatch is not on this machine's PATH: run the "
        "sweep from a cluster's login node, or drop hydra/launcher to run it here"]
    assert not (tmp_path / "outputs").exists()
    assert shutil.which("sbatch", path=str(Path(sys.executable).parent)) is None


# train.py with the submitit plugin (and submitit) hidden, as on a machine that installed only part of
# requirements.txt
WITHOUT_SUBMITIT = """
import importlib.abc, runpy, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "submitit" or name.startswith(("submitit.", "hydra_plugins.hydra_submitit_launcher")):
            raise ImportError(f"{name} is hidden by the test")
sys.meta_path.insert(0, Hide())
sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[1] + "/train.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_submitit(tmp_path, *arguments):
    return subprocess.run([sys.executable, "-c", WITHOUT_SUBMITIT, str(REPO), *arguments], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_without_the_submitit_plugin_runs_start_without_a_warning_and_a_slurm_sweep_is_one_line(tmp_path):
    shown = run_without_submitit(tmp_path, "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "linear:" in shown.stdout and shown.stderr == ""  # no "Error importing ... slurm_launcher" warning
    swept = run_without_submitit(tmp_path, "-m", "hydra/launcher=slurm", "linear=torch")
    assert swept.returncode == 2
    assert error_lines(swept.stderr) == [
        "error: hydra/launcher=slurm and slurm_gpu need the submitit plugin: "
        "pip install 'hydra-submitit-launcher>=1.2,<1.3' (requirements.txt)"]
    assert not (tmp_path / "outputs").exists()
