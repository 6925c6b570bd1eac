"""The Optuna sweeper of conf/search/ (the hydra-optuna-sweeper plugin's, as `hydra/sweeper=optuna`), ending a
search in which every trial failed as any sweep with failed jobs ends: the sweep summary, one error line and
exit code 1. The plugin's own sweeper stops at Optuna's "No trials are completed yet" in a 20-line traceback,
before Hydra's end-of-sweep callbacks, so no summary says why each trial failed.

Hydra takes plugins only from the hydra_plugins package, and imports every module here at each start; without
the plugin installed this module still imports, and defines nothing."""
from pathlib import Path

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper as PluginOptunaSweeper
except ImportError:
    PluginOptunaSweeper = None

if PluginOptunaSweeper is not None:

    class OptunaSweeper(PluginOptunaSweeper):
        """The plugin's sweeper; a search with no completed trial ends with the summary of its failed ones."""

        def sweep(self, arguments):
            try:
                return super().sweep(arguments)
            except ValueError as error:
                if "No trials are completed yet" not in str(error):
                    raise
                from trainer import summary

                summary.end_sweep(Path(self.sweeper.config.hydra.sweep.dir))
                raise  # end_sweep exits: every trial failed
