"""A throwaway single-node SLURM cluster with job accounting, for the launcher tests.

Everything lives under one temporary folder and runs as this process's children: munged (authentication),
mariadbd (the accounting database), slurmdbd (accounting), slurmctld (the controller) and slurmd (the
node). Ports are free ones picked at start; nothing touches /etc, /run or a system service, and `stop`
kills the daemons by PID only. Clients find the cluster through SLURM_CONF (`cluster.env`).

Why accounting: submitit learns a job's state from `sacct`. Without slurmdbd the controller answers
"accounting storage is disabled", and submitit never learns that a job was cancelled or timed out: the
sweep would wait forever. slurmdbd over MariaDB is what a real cluster runs, so the tests do too.

Needs root (SlurmUser=root, munged --force) and Debian's packages: slurmctld slurmd slurm-client slurmdbd
munge mariadb-server (`.ci/run` installs them).
"""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")
START_TIMEOUT_S = 60


class ClusterError(Exception):
    """The cluster did not come up; the message quotes the daemon's log."""


def missing_programs():
    return [name for name in DAEMONS if not shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def program(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")


def node_line():
    """This machine as slurmd sees it (CPUs, sockets, cores, threads, memory): `slurmd -C`'s first line."""
    first = subprocess.run([program("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return first.splitlines()[0]


class SlurmCluster:
    """Start with `SlurmCluster(folder).start()`; `env` is the environment a client (sbatch, sacct, a sweep)
    needs; `stop()` ends every daemon."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.processes = {}
        self.conf = self.folder / "slurm.conf"
        self.munge_socket = self.folder / "munge" / "munge.socket"
        self.node = node_line()
        self.node_name = self.node.split()[0].split("=", 1)[1]
        self.cpus = int(self.node.split("CPUs=")[1].split()[0])
        self.memory_mb = int(self.node.split("RealMemory=")[1].split()[0])

    @property
    def env(self):
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": os.environ["PATH"] + ":/usr/sbin"}

    def start(self):
        try:
            self.start_munge()
            self.start_database()
            self.write_configs()
            self.launch("slurmdbd", [program("slurmdbd"), "-D"], ready=self.database_ready)
            self.launch("slurmctld", [program("slurmctld"), "-D", "-i"], ready=self.controller_ready)
            self.launch("slurmd", [program("slurmd"), "-D", "-N", self.node_name], ready=self.node_idle)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    # -- the daemons, in the order they start

    def start_munge(self):
        self.munge_socket.parent.mkdir(parents=True)
        self.munge_socket.parent.chmod(0o755)  # munged refuses a socket folder others cannot enter
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.launch("munged", [
            program("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={self.folder / 'munge' / 'munged.pid'}", f"--log-file={self.folder / 'munged.log'}",
            f"--seed-file={self.folder / 'munge' / 'munged.seed'}",
        ], ready=self.munge_socket.exists)

    def start_database(self):
        data = self.folder / "mysql"
        self.mysql_port = free_port()
        subprocess.run([program("mariadb-install-db"), f"--datadir={data}", "--user=root", "--skip-test-db",
                        "--auth-root-authentication-method=normal"],
                       capture_output=True, text=True, check=True)
        self.launch("mariadbd", [
            program("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=root", "--bind-address=127.0.0.1",
            f"--port={self.mysql_port}", f"--socket={self.folder / 'mysql.sock'}",
            f"--pid-file={self.folder / 'mariadbd.pid'}", f"--log-error={self.folder / 'mariadbd.log'}",
            "--skip-grant-tables",  # any local client may do anything: a database that lives for one test session
        ], ready=lambda: port_open(self.mysql_port))

    def write_configs(self):
        self.dbd_port, self.controller_port, self.node_port = free_port(), free_port(), free_port()
        for folder in ("state", "spool"):
            (self.folder / folder).mkdir()
        auth = f"socket={self.munge_socket}"
        self.conf.write_text(f"""\
ClusterName=linearlab
SlurmctldHost={self.node_name}(127.0.0.1)
SlurmctldPort={self.controller_port}
SlurmdPort={self.node_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo={auth}
CredType=cred/munge
StateSaveLocation={self.folder / 'state'}
SlurmdSpoolDir={self.folder / 'spool'}
SlurmctldPidFile={self.folder / 'slurmctld.pid'}
SlurmdPidFile={self.folder / 'slurmd.pid'}
SlurmctldLogFile={self.folder / 'slurmctld.log'}
SlurmdLogFile={self.folder / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
ReturnToService=2
# each job gets its own cores (with task/none two 1-CPU jobs both ran 2 threads on 2 cores)
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
# submitit ignores SIGTERM: a cancelled job ends at the SIGKILL, KillWait seconds later
KillWait=3
# refuse at submission what no node could run (else the job would pend forever)
EnforcePartLimits=ALL
MinJobAge=3600
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_socket}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{self.node.split(' UpTime')[0]} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes={self.node_name} MaxTime=1 State=UP
""")
        dbd_conf = self.folder / "slurmdbd.conf"  # found beside slurm.conf
        dbd_conf.write_text(f"""\
AuthType=auth/munge
AuthInfo={auth}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.dbd_port}
SlurmUser=root
PidFile={self.folder / 'slurmdbd.pid'}
LogFile={self.folder / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.mysql_port}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd_conf.chmod(0o600)  # slurmdbd refuses a config others can read

    # -- starting and waiting

    def launch(self, name, command, ready):
        log = open(self.folder / f"{name}.out", "w")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.folder)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if self.processes[name].poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"{name} did not start: {self.log_tail(name)}")
            time.sleep(0.2)

    def log_tail(self, name):
        lines = []
        for path in (self.folder / f"{name}.out", self.folder / f"{name}.log"):
            if path.is_file():
                lines += path.read_text(errors="replace").splitlines()[-15:]
        return "\n".join(lines)

    def client(self, *command, check=False):
        """Run a SLURM command (sinfo, squeue, scancel, ...) against this cluster."""
        return subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=30, check=check)

    def database_ready(self):
        return port_open(self.dbd_port)

    def controller_ready(self):
        return self.client("scontrol", "ping").stdout.count("UP") > 0

    def node_idle(self):
        states = self.client("sinfo", "--noheader", "--Node", "--format=%T").stdout.split()  # a line a partition
        return set(states) == {"idle"}


def port_open(port):
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0
