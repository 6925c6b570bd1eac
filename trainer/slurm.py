"""Sweeps on a SLURM cluster: `hydra/launcher=slurm` (CPU jobs) and `hydra/launcher=slurm_gpu`.

The launcher (hydra_plugins/linear_lab/slurm_launcher.py; its work is here) is the submitit plugin's, with
what a sweep needs on a real cluster:
- a request no node can meet (more CPUs, memory or GPUs per node than the partition's largest node has)
  ends in one line before anything is submitted, and so does a controller that does not answer; sbatch's
  own refusal (e.g. a partition's limits, EnforcePartLimits) is one line too, not submitit's traceback;
- a job SLURM ended before it finished (scancel, its time limit, out of memory, a node failure) does not end
  the sweep in a traceback: its folder gets failed.txt with SLURM's state, its log and the command that
  reruns it; the other jobs are collected, and the sweep summary lists it (the sweep then exits with 1).

submitit reads job states with `sacct`, so the cluster needs accounting (slurmdbd); without it a cancelled
job is never seen to end.
"""
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict

from trainer import summary
from trainer.config import fail

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
SINFO_TIMEOUT_S = 60  # sinfo retries an unreachable controller for about 10 s, then says so
# How often to ask sacct for the states of unfinished jobs: one call for the whole array, soon at first,
# then every 15 s: light for the controller, and a killed job is reported within seconds.
POLL_FIRST_S, POLL_MAX_S = 2, 15
# Why SLURM ended a job, by sacct's state, and the setting that would have let it finish.
STATE_HINTS = {
    "TIMEOUT": ("it ran past its time limit", "timeout_min"),
    "OUT_OF_MEMORY": ("it ran out of memory", "mem_gb"),
    "CANCELLED": ("it was cancelled (scancel or an administrator)", None),
    "NODE_FAIL": ("its node failed", None),
    "PREEMPTED": ("it was preempted", None),
    "BOOT_FAIL": ("its node failed to boot", None),
    "DEADLINE": ("it missed its deadline", None),
    "FAILED": ("its process exited with an error", None),
}


def launch(launcher, job_overrides, initial_job_idx):
    """Submit the jobs as one sbatch array, wait for them all, and return their JobReturns (the plugin's
    launch, but checked first, and with a killed job recorded instead of raised)."""
    import submitit  # as the plugin does: loading it is slow, and only a SLURM sweep needs it

    check_request(launcher.params)
    params = dict(launcher.params)
    if not params["max_num_timeout"]:
        # submitit always asks SLURM for USR2 signal_delay_s before the time limit, to requeue the job. Without
        # requeues it has nothing to do, and it hurts: SLURM may send it up to a minute early, and sent before
        # the job's Python has its handler it kills the job (seen with 1-minute limits); sent later, submitit
        # raises an error into the training loop. So ask for SIGURG, which a process ignores unless it asks
        # for it: SLURM then ends the job at its limit, and the sweep reports it as TIMEOUT.
        params["additional_parameters"] = {"signal": "URG@1", **(params["additional_parameters"] or {})}
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    shared = set(OmegaConf.structured(BaseQueueConf).keys())  # the plugin's naming of the parameters
    executor.update_parameters(**{key if key in shared else f"slurm_{key}": value for key, value in params.items()})
    # The jobs unpickle this project's code wherever sbatch was called from: they inherit this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
    for number, overrides in zip(numbers, job_overrides):
        log.info(f"\t#{number} : {' '.join(overrides)}")
    try:
        jobs = executor.map_array(launcher, *zip(*[
            (list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
            for number, overrides in zip(numbers, job_overrides)]))
    except Exception as error:  # sbatch refused the array: its own words, in one line
        fail(f"SLURM refused the sweep: {sbatch_error(error)}", 1)
    log.info(f"SLURM array {jobs[0].job_id.split('_')[0]}: {len(jobs)} job(s) in {sweep_dir}, their logs in "
             f"{sweep_dir / '.submitit'}")
    wait_for(jobs)
    return [job_return(launcher, job, number, overrides)
            for job, number, overrides in zip(jobs, numbers, job_overrides)]


def job_return(launcher, job, number, overrides):
    """The job's own JobReturn if it finished; otherwise failed.txt in its folder and an empty return (a
    failed job returns None, as train.py's do, so that Hydra goes on to the sweep summary)."""
    state = job.state.split()[0] if job.state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    if job.paths.result_pickle.exists() or state == "COMPLETED":
        try:
            return job.results()[0]
        except Exception as error:  # raised in the job outside train.py's own handling
            message = f"the job raised {last_line(error)} (log: {job.paths.stderr})"
    else:
        reason, setting = STATE_HINTS.get(state, ("it ended before it finished", None))
        more = f" with hydra.launcher.{setting} doubled" if setting else ""
        message = (f"SLURM ended job {job.job_id} before it finished, {state}: {reason} (log: {job.paths.stderr}); "
                   f"rerun it{more}: {rerun_command(launcher, overrides, setting)}")
    job_dir = job_folder(launcher, number, overrides)
    print(f"error: job {job_dir.name}: {message}", file=sys.stderr, flush=True)
    summary.write_job_failure(job_dir, message)
    return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)


def rerun_command(launcher, overrides, setting=None):
    """The command line that runs a job again on the cluster: the sweep's launcher settings (`setting`, the
    one that ended it, doubled) and the job's own overrides."""
    own = ("hydra.sweep.", "hydra.run.", "hydra.mode=")  # the sweep's folder and mode, not the job's settings
    settings = [o for o in launcher.config.hydra.overrides.hydra if not o.startswith(own)]
    if setting:
        key = f"hydra.launcher.{setting}"
        settings = [o for o in settings if not o.startswith(key + "=")] + [f"{key}={2 * launcher.params[setting]}"]
    return " ".join(["python train.py -m", *map(shlex.quote, settings), *map(shlex.quote, overrides)])


def job_folder(launcher, number, overrides):
    """The job's folder as the job itself names it. A job ended before it started has none yet: it gets one,
    with the .hydra files the sweep summary reads."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(config):
        config.hydra.job.num = number
    job_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    hydra_dir = job_dir / ".hydra"
    if not (hydra_dir / "hydra.yaml").is_file():
        hydra_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]),
                       hydra_dir / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": config.hydra}), hydra_dir / "hydra.yaml")
        OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
    return job_dir


def wait_for(jobs):
    """Until every job has ended. A finished job's result file shows at once; a job SLURM ended shows only in
    sacct, asked soon after the submission and then less often (as submitit does, but at most POLL_MAX_S
    apart, so that a killed job is noticed within seconds, not minutes)."""
    started = last_asked = time.monotonic()
    while not all(job.done() for job in jobs):
        time.sleep(1)
        now = time.monotonic()
        if now - last_asked >= min(POLL_MAX_S, max(POLL_FIRST_S, (now - started) / 2)):
            jobs[0].watcher.update()  # one sacct call for the whole array
            last_asked = now


def check_request(params):
    """Stop in one line, before submitting, if no node of the partition could run one job, or if the
    cluster does not answer."""
    try:
        result = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%P|%c|%m|%G"],
                                capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
        problem = result.stderr if result.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as error:
        problem = error
    if problem is not None:
        fail(f"the SLURM cluster does not answer (sinfo: {last_line(problem)}); check that its controller runs "
             "and SLURM_CONF, or drop hydra/launcher to run the sweep here", 1)
    nodes = [line.split("|") for line in result.stdout.split()]
    partition = params.get("partition")
    if partition is None:
        nodes = [node for node in nodes if node[0].endswith("*")]  # sinfo marks the default partition
        where = "the default partition"
    else:
        nodes = [node for node in nodes if node[0].rstrip("*") == partition]
        where = f"partition {partition}"
        if not nodes:
            names = sorted({line.split("|")[0].rstrip("*") for line in result.stdout.split()})
            fail(f"hydra.launcher.partition={partition} is not a partition of this cluster; "
                 f"choose one of: {', '.join(names)}")
    if not nodes:
        fail("this cluster has no default partition: set hydra.launcher.partition")
    largest = {  # per node of the partition
        "gpus_per_node": max(gpu_count(node[3]) for node in nodes),
        "cpus_per_task": max(int(node[1].rstrip("+")) for node in nodes),
        "mem_gb": max(int(node[2].rstrip("+")) for node in nodes) // 1024,
    }
    asked = {
        "gpus_per_node": (params.get("gpus_per_node") or 0, "GPU"),
        "cpus_per_task": ((params.get("cpus_per_task") or 1) * (params.get("tasks_per_node") or 1), "CPU"),
        "mem_gb": (params.get("mem_gb") or 0, "GB of memory"),
    }
    for setting, (amount, unit) in asked.items():
        if amount > largest[setting]:
            have = f"at most {largest[setting]}" if largest[setting] else "none"
            units = unit + "s" if amount > 1 and unit in ("GPU", "CPU") else unit
            fail(f"hydra.launcher.{setting}={params.get(setting)} asks each job for {amount} {units}, and the "
                 f"nodes of {where} have {have}: lower it"
                 + (", or use hydra/launcher=slurm for CPU jobs" if setting == "gpus_per_node" else ""))


def gpu_count(gres):
    """GPUs in sinfo's GRES column: 'gpu:4', 'gpu:a100:4(S:0-1)', '(null)'."""
    return sum(int(count) for count in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def sbatch_error(error):
    """The 'sbatch: error: ...' line of a failed submission, else the error's last line."""
    text = str(error)
    errors = [line.strip() for line in text.splitlines() if "error:" in line]
    return errors[-1] if errors else last_line(text)


def last_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
