"""The SLURM launcher of conf/hydra/launcher/slurm.yaml and slurm_gpu.yaml. Hydra accepts launchers only from
the hydra_plugins package, and imports every module here at each start: so this is just the class, and
its work is in trainer/slurm.py, imported when a SLURM sweep launches."""
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher


class SlurmLauncher(SubmititSlurmLauncher):
    """The submitit plugin's SLURM launcher, checked before it submits and tolerant of killed jobs."""

    def launch(self, job_overrides, initial_job_idx):  # on the machine the sweep was started from
        from trainer import slurm

        return slurm.launch(self, job_overrides, initial_job_idx)

    def __call__(self, *args, **kwargs):  # in the job, on a node of the cluster
        from trainer import slurm

        slurm.leave_the_time_limit_to_slurm(self.params)
        return super().__call__(*args, **kwargs)
