"""The SLURM launcher of conf/hydra/launcher/slurm.yaml and slurm_gpu.yaml. Hydra accepts launchers only from
the hydra_plugins package, and imports every module here at each start: so this is just the class, and
its work is in trainer/slurm.py, imported when a SLURM sweep launches.

The submitit plugin is a requirement that only SLURM sweeps use. Without it this module still imports (else
Hydra would warn at every start), and a SLURM sweep stops in one line saying what to install."""
from hydra.plugins.launcher import Launcher

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
except ImportError:
    SubmititSlurmLauncher = None

if SubmititSlurmLauncher is not None:

    class SlurmLauncher(SubmititSlurmLauncher):
        """The submitit plugin's SLURM launcher, checked before it submits and tolerant of killed jobs."""

        def launch(self, job_overrides, initial_job_idx):
            from trainer import slurm

            return slurm.launch(self, job_overrides, initial_job_idx)

else:

    def _stop_for_missing_plugin():
        from trainer.config import fail

        fail("hydra/launcher=slurm and slurm_gpu need the submitit plugin: "
             "pip install 'hydra-submitit-launcher>=1.2,<1.3' (requirements.txt)")

    class SlurmLauncher(Launcher):
        """Stands in for the launcher when the submitit plugin is missing: stops before any job starts."""

        def __init__(self, **params):
            pass

        def setup(self, *, hydra_context, task_function, config):
            _stop_for_missing_plugin()

        def launch(self, job_overrides, initial_job_idx):
            _stop_for_missing_plugin()
