"""The SLURM launcher of conf/hydra/launcher/slurm.yaml and slurm_gpu.yaml. Hydra accepts launchers only from
the hydra_plugins package, and imports every module here at each start: so this is just the class, and
its work is in trainer/slurm.py, imported when a SLURM sweep launches."""
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher


class SlurmLauncher(SubmititSlurmLauncher):
    """The submitit plugin's SLURM launcher, checked before it submits and tolerant of killed jobs."""

    def launch(self, job_overrides, initial_job_idx):
        from trainer import slurm

        return slurm.launch(self, job_overrides, initial_job_idx)
