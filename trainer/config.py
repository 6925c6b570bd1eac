"""The run's configuration: loading it, the resolvers its YAML uses, and checking it.

Every mistake on the command line (model=resnet19, trainer.epochs=-1, a misspelt key, a setting the chosen
optimizer does not take) ends in one `error:` line, with exit code 2, before Hydra makes any run folder:
`check_command_line` composes and validates every job a command line asks for, and `validate` runs again
in each job (for range sweeps, and for a resumed run's config).
"""
import difflib
import functools
import hashlib
import inspect
import itertools
import math
import os
import re
import shlex
import shutil
import sys
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

import data
import models
from trainer import checkpoint, summary

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(Exception):
    """A setting that cannot work; the message names it and what it should be."""


def run_time():
    """Start time with milliseconds, so that runs started in the same second get their own folders."""
    return datetime.now().strftime("%H-%M-%S.%f")[:-3]


# Longest run name: a file name may have 255 bytes, and the time (13) or job number goes before it.
MAX_RUN_NAME_BYTES = 200


def run_name(*parts):
    """Folder name from model, linear, data and the other overrides: mlp-custom-digits_optim.lr=0.01.

    A name too long for a folder (many overrides, an Optuna trial's long floats) keeps its first
    MAX_RUN_NAME_BYTES bytes, ending in a hash of the whole, so that names stay distinct.
    """
    names, overrides = parts[:-1], parts[-1]
    name = "_".join(filter(None, ["-".join(names), overrides.replace("/", "-")]))
    if len(name.encode()) <= MAX_RUN_NAME_BYTES:
        return name
    digest = "~" + hashlib.sha1(name.encode()).hexdigest()[:10]
    kept = name.encode()[:MAX_RUN_NAME_BYTES - len(digest)].decode(errors="ignore")
    return kept + digest


# cached like Hydra's own `now`, so a sweep's jobs all resolve the same time
OmegaConf.register_new_resolver("run_time", run_time, use_cache=True, replace=True)
OmegaConf.register_new_resolver("run_name", run_name, replace=True)
OmegaConf.register_new_resolver("plus_one", lambda value: int(value) + 1, replace=True)  # conf/sched/onecycle.yaml


def load_config(overrides=()):
    """The config `python train.py <overrides>` runs with (without Hydra's own `hydra` node).

    Example:
        >>> cfg = load_config(["model=resnet18", "data=fake", "trainer.epochs=1"])
    """
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


TARGET_GROUPS = ("optim", "sched")  # groups whose settings are their class's parameters, all of them settable
SLURM_LAUNCHERS = ("slurm", "slurm_gpu", "submitit_slurm")  # conf/hydra/launcher/ and the plugin's own


def check_command_line(argv):
    """Compose and validate the config of every job the command line asks for, before Hydra starts.

    A mistake (model=resnet19, trainer.epochs=-1, a misspelt key) then ends in one line and before any
    run folder exists; Hydra's own report of it spans a dozen lines. Choice sweeps (linear=torch,custom)
    are checked job by job; range and glob sweeps are left to validate() in each job.
    """
    flags = [arg for arg in argv if arg.startswith("-")]
    if set(flags) - {"-m", "--multirun"}:  # --cfg, --config-name, ...: Hydra's business
        return
    arguments = [arg for arg in argv if arg not in flags]
    try:
        overrides = OverridesParser.create().parse_overrides(arguments)
    except HydraException as error:  # malformed: say which argument, in one line (Hydra's report spans four)
        for argument in arguments:
            try:
                OverridesParser.create().parse_override(argument)
            except HydraException:
                fail(f"cannot read {argument!r}: write key=value, with lists as key=[a,b] and quotes around "
                     f"values with spaces or commas ({str(error).splitlines()[0].strip()})")
        fail(" ".join(str(error).split()))
    for override in overrides:
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override() and not flags:  # Hydra: "Ambiguous value for argument", in six lines
            fail(f"{override.input_line} is a sweep: add -m (python train.py -m {shlex.join(arguments)})")
        if key == "search" and not flags:  # without -m, the search's config would train one default run
            fail(f"search={override.value()} is a hyperparameter search: add -m "
                 f"(python train.py -m {shlex.join(arguments)})")
        section = [setting for setting in known_settings() if setting.startswith(f"{key}.")]
        if section and not (CONF_DIR / key).is_dir() and not isinstance(override.value(), dict):
            # trainer=foo would replace the whole section by a string
            fail(f"{key} is a section of settings, not a setting: set its keys, e.g. {section[0]}=... "
                 "(python train.py --cfg job lists them)")
        if key == "hydra/launcher" and str(override.value()) in SLURM_LAUNCHERS and not shutil.which("sbatch"):
            # the submitit plugin would fail only once it submits, in a long traceback
            fail(f"hydra/launcher={override.value()} submits to a SLURM cluster, and sbatch is not on this "
                 "machine's PATH: run the sweep from a cluster's login node, or drop hydra/launcher to run it here")
        if (override.is_add() and not key.startswith("hydra") and key not in known_settings()
                and key.split(".")[0] not in TARGET_GROUPS):
            # +trainer.epoch=3 (Hydra's own advice for a misspelt key) adds a setting nothing reads; one of optim
            # or sched goes to its class, which check_targets_take_their_settings holds to the class's parameters
            fail(unknown_key_message(f"Could not override '{key}'"))
        if key in LAUNCH_RULES and not override.is_sweep_override() and not LAUNCH_RULES[key].test(override.value()):
            fail(f"{key}={override.value()} is invalid: it must be {LAUNCH_RULES[key].expected}")
    jobs = []
    for override in overrides:
        if override.is_choice_sweep():
            key = override.get_key_element()
            jobs.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        elif not override.is_sweep_override():
            jobs.append([override.input_line])
    check_search_model(overrides)
    for job_overrides in itertools.product(*jobs):
        try:
            validate(load_config(job_overrides))
        except MissingConfigException as error:
            group, choice = error.missing_cfg_file.rsplit("/", 1)
            fail(f"{group}={choice} is not an option; choose one of: {', '.join(natural_order(error.options or []))}")
        except HydraException as error:
            fail(unknown_key_message(str(error)) or " ".join(str(error).split("\n")))
        except ConfigError as error:
            fail(str(error))
    if flags and jobs:
        check_search_direction(next(itertools.product(*jobs)))
    for override in overrides:  # the run or sweep folder, given as a path: Hydra's failure to make it is a traceback
        key, value = override.get_key_element(), override.value()
        if key in ("hydra.run.dir", "hydra.sweep.dir") and isinstance(value, str) and "${" not in value:
            try:
                Path(value).expanduser().mkdir(parents=True, exist_ok=True)
            except OSError as error:
                fail(f"{key}={value} cannot be made ({error.strerror}); give a folder that can be written")


def check_search_model(overrides):
    """A search's space belongs to one model (conf/search/<name>.yaml sets model.name): another model= would
    be trained as a mix of both configs, under the search's model's name."""
    chosen = {override.get_key_element().lstrip("+~"): override for override in overrides}
    if "search" not in chosen or "model" not in chosen or chosen["search"].is_sweep_override():
        return
    search = chosen["search"].value()
    if not (CONF_DIR / "search" / f"{search}.yaml").is_file():  # no such search: the jobs' check names the options
        return
    searched = OmegaConf.select(OmegaConf.load(CONF_DIR / "search" / f"{search}.yaml"), "model.name")
    models_asked = (list(chosen["model"].sweep_string_iterator()) if chosen["model"].is_choice_sweep()
                    else [str(chosen["model"].value())])
    if searched is not None and any(model != searched for model in models_asked):
        fail(f"search={search} searches settings of model={searched}; drop {chosen['model'].input_line}")


def check_search_direction(job_overrides):
    """A search (hydra/sweeper=optuna) must go the way its trainer.objective improves: the sweeper takes either
    direction without a word, and one going the wrong way reports the worst trial as the best."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(job_overrides), return_hydra_config=True)
    direction = OmegaConf.select(cfg, "hydra.sweeper.direction")
    objective = cfg.trainer.objective
    if not isinstance(direction, str) or objective not in summary.OBJECTIVES:  # no search, or several objectives
        return
    wanted = summary.OBJECTIVES[objective]
    if direction.lower() not in ("maximize", "minimize"):
        fail(f"hydra.sweeper.direction={direction} is invalid: it must be maximize or minimize "
             f"({wanted} for trainer.objective={objective})")
    if direction.lower() != wanted:
        fail(f"hydra.sweeper.direction={direction} would search for the worst trainer.objective={objective}, "
             f"which improves as it {'falls' if wanted == 'minimize' else 'rises'}; "
             f"add hydra.sweeper.direction={wanted}")


def natural_order(names):
    """resnet18, resnet34, resnet50, resnet101, resnet152: numbers within names compare as numbers."""
    return sorted(names, key=lambda name: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)])


def unknown_key_message(hydra_message):
    """For Hydra's "Could not override 'trainer.epoch'": the setting that was probably meant. (Hydra's own
    advice, +trainer.epoch=3, adds a key nothing reads: the run would go on as if it were not given.)"""
    match = re.match(r"Could not override '([^']+)'", hydra_message)
    if not match:
        return None
    key = match.group(1)
    group, _, name = key.partition(".")
    if key in known_settings() and (CONF_DIR / group).is_dir():  # another option of the group has it
        options = natural_order(option.stem for option in (CONF_DIR / group).glob("*.yaml")
                                if name.split(".")[0] in OmegaConf.load(option))
        return (f"{key} is not a setting of the chosen {group}; {' and '.join(f'{group}={o}' for o in options)} "
                f"{'has' if len(options) == 1 else 'have'} it (python train.py --cfg job lists the chosen settings)")
    guess = difflib.get_close_matches(key, known_settings(), n=1, cutoff=0.6)
    meant = f"; did you mean {guess[0]}?" if guess else ""
    return f"{key} is not a setting{meant} (python train.py --cfg job lists them all)"


@functools.cache
def known_settings():
    """Every setting's dotted name (see config_keys); read once, as it loads every option's file."""
    return tuple(dotted_keys(config_keys()))


def config_keys():
    """The default config as nested dicts, each group's keys merged over all its options (model.dropout is
    mlp's, model.name every model's): every setting some choice of groups reads."""
    config = OmegaConf.to_container(load_config())
    for group in ("model", "linear", "conv", "data", "optim", "sched"):
        for option in sorted((CONF_DIR / group).glob("*.yaml")):
            config[group] = {**OmegaConf.to_container(OmegaConf.load(option)), **config[group]}
    return config


def dotted_keys(node, prefix=""):
    """Every key of a nested dict, dotted: ["data", "data.batch_size", ...]."""
    keys = []
    for key, value in node.items():
        keys.append(prefix + key)
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


class Rule:
    """What a setting must be: `test(value)` true, said to the user as `expected` ("a positive integer")."""

    def __init__(self, test, expected):
        self.test, self.expected = test, expected


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is no integer


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_device(value):
    if value in ("auto", "cpu"):
        return True
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return device.type == "cuda" and torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()


def one_of(options):
    return Rule(lambda v: v in options, f"one of {', '.join(options)}")


def int_list(length=None):
    """A list of positive integers (of `length` items)."""
    return lambda v: (isinstance(v, ListConfig) and all(is_int(x) and x > 0 for x in v)
                      and (length is None or len(v) == length))


# An override reads only true/false as booleans; another word is a string, which would count as true.
BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
INT = Rule(is_int, "an integer")
POSITIVE_INT = Rule(lambda v: is_int(v) and v > 0, "a positive integer")
FRACTION = Rule(lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)")

# Every run has these settings.
RULES = {
    "seed": INT,
    "trainer.epochs": POSITIVE_INT,
    "trainer.device": Rule(is_device, "auto, cpu, or a CUDA device present on this machine (cuda, cuda:0, ...)"),
    "linear.name": Rule(lambda v: v in ("torch", "custom"), "torch or custom"),
    "conv.name": Rule(lambda v: v in ("torch", "custom"), "torch or custom"),
    "data.batch_size": POSITIVE_INT,
    "data.num_workers": Rule(lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "data.loader": one_of(data.LOADER_KINDS),
    "optim.lr": Rule(lambda v: is_number(v) and 0 < v < math.inf, "a positive number"),
    "trainer.resume": Rule(lambda v: v is None or isinstance(v, str), "a run folder or checkpoint file"),
    "trainer.eval_only": BOOL,
    "trainer.loss": one_of(("ext", "torch")),
    "trainer.amp": BOOL,
    "trainer.compile": BOOL,
    "trainer.channels_last": BOOL,
    "trainer.deterministic": BOOL,
    "trainer.threads": Rule(lambda v: v == "auto" or (is_int(v) and v > 0), "auto or a positive integer"),
    "trainer.objective": one_of(summary.OBJECTIVES),
}
# Settings that only some options have (model.hidden_sizes: mlp only).
OPTION_RULES = {
    "data.val_fraction": Rule(lambda v: is_number(v) and 0 < v < 1, "a number between 0 and 1"),
    "data.train_size": POSITIVE_INT,
    "data.val_size": POSITIVE_INT,
    "data.num_classes": Rule(lambda v: is_int(v) and v >= 2, "an integer >= 2"),
    "data.image_size": Rule(int_list(length=3), "[channels, height, width], each a positive integer"),
    "data.download": BOOL,
    "model.hidden_sizes": Rule(int_list(), "a list of positive integers"),
    "model.activation": one_of(models.ACTIVATIONS),
    "model.dropout": FRACTION,
    "optim.weight_decay": Rule(lambda v: is_number(v) and 0 <= v < math.inf, "a number >= 0"),
    "optim.momentum": FRACTION,
    "optim.nesterov": BOOL,
    "optim.betas": Rule(lambda v: isinstance(v, ListConfig) and len(v) == 2 and all(FRACTION.test(b) for b in v),
                        "[beta1, beta2], each a number in [0, 1)"),
    "optim.eps": Rule(lambda v: is_number(v) and 0 < v < math.inf, "a positive number"),
    "optim.amsgrad": BOOL,
    "optim.fused": Rule(lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "sched.eta_min": Rule(lambda v: is_number(v) and 0 <= v < math.inf, "a number >= 0"),
    "sched.T_max": POSITIVE_INT,
    "sched.factor": Rule(lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "sched.total_iters": Rule(lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "sched.pct_start": Rule(lambda v: is_number(v) and 0 < v < 1, "a number between 0 and 1"),
    "data.root": Rule(lambda v: isinstance(v, str) and v != "", "a folder path"),
    "data.split_seed": INT,
    "data.seed": INT,
    "linear.fuse_relu": BOOL,
}

# The launchers' and the sweeper's counts, which their plugins take unchecked and fail on in a long traceback.
LAUNCH_RULES = {
    "hydra.launcher.n_jobs": Rule(lambda v: is_int(v) and v != 0, "a nonzero integer (-1: as many jobs as cores)"),
    "hydra.sweeper.n_trials": Rule(lambda v: is_int(v) and v > 0, "a positive integer"),
    "hydra.sweeper.n_jobs": Rule(lambda v: is_int(v) and v > 0, "a positive integer"),
}


def validate(cfg):
    """Raise ConfigError naming the first bad setting, before any work is done."""
    absent = object()
    for rules, required in ((RULES, True), (OPTION_RULES, False)):
        for key, rule in rules.items():
            value = OmegaConf.select(cfg, key, default=absent)
            if value is absent:
                if required:
                    raise ConfigError(f"{key} is missing: it must be {rule.expected}")
                continue
            if not rule.test(value):
                shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
                raise ConfigError(f"{key}={shown} is invalid: it must be {rule.expected}")
    if cfg.trainer.eval_only and not cfg.trainer.resume:
        raise ConfigError("trainer.eval_only=true needs trainer.resume=<run folder or checkpoint file>")
    check_targets_take_their_settings(cfg)


def check_targets_take_their_settings(cfg):
    """Refuse a setting that a group's class does not take (+optim.momentum=0.9 with optim=adamw: another
    option has the key), naming what it takes, rather than fail in its constructor after the data loads."""
    for group, node in cfg.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        parameters = inspect.signature(get_object(node._target_)).parameters
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
            continue  # takes any setting (models.build_model passes them on)
        for key in node:
            if not key.startswith("_") and key not in parameters:  # _target_ and Hydra's other keys
                settings = [name for name, parameter in parameters.items()
                            if parameter.default is not inspect.Parameter.empty]
                raise ConfigError(f"{group}.{key} is not a setting of {node._target_}: it takes "
                                  f"{', '.join(settings)}")


def overridden_keys():
    """The dotted keys this job's command line set (trainer.epochs, model, ...); none outside Hydra."""
    if not HydraConfig.initialized():
        return []
    return [override.split("=", 1)[0].lstrip("+~") for override in HydraConfig.get().overrides.task]


def hydra_quoted(path):
    """`path` as a quoted value of a Hydra override: run folders' names hold '=' and ',' (their
    overrides), which the override grammar would read as syntax."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def resume_arguments(argv):
    """The command line with trainer.resume=<path> made safe for Hydra, continuing in the run's own folder
    (a sweep evaluating the checkpoint: in its job folders).

    Hydra then writes into that folder rather than a new one, and leaves its .hydra/ (the config the run
    started with) as it is. A path that does not exist fails here, before Hydra creates any folder.
    """
    arguments = []
    for argument in argv:
        key, _, value = argument.partition("=")
        if key.lstrip("+") == "trainer.resume" and value not in ("", "null"):
            evaluating = any(arg.lower() == "trainer.eval_only=true" for arg in argv)
            if {"-m", "--multirun"} & set(argv) and not evaluating:
                fail("trainer.resume continues one run in its own folder, which a sweep's jobs would share; drop -m "
                     "(or evaluate it: trainer.eval_only=true)")
            path = Path(value.strip("'\"")).expanduser().absolute()
            try:  # no such path, or a folder that is no run's: fails here, before Hydra writes into it
                checkpoint.find(path)
            except checkpoint.CheckpointError as error:
                fail(str(error))
            run_dir = path if path.is_dir() else path.parent
            argument = f"{key}={hydra_quoted(path)}"
            if not {"-m", "--multirun"} & set(argv):  # a sweep's evaluations go to job folders of their own
                arguments += [f"hydra.run.dir={hydra_quoted(run_dir)}", "hydra.output_subdir=null"]
        arguments.append(argument)
    return arguments


def fail(message, exit_code=2):
    # A bad setting is every torchrun process's: rank 0 alone says so. Other failures may be one rank's own.
    if exit_code != 2 or os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)
