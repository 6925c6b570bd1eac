"""Scaling out: torchrun + DDP, parallel (joblib) Optuna search, and the
AMP / compile / channels_last / deterministic switches."""
import contextlib
import csv
import os
import random
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import ext
import models
import train
from trainer import build, config, distributed, logs, summary

REPO = Path(__file__).resolve().parents[1]
# SGD with momentum, no dropout (the default MLP): a run whose weights two processes must reproduce exactly.
# Batches of 479 of the digits' 1,438 training images leave a last batch of 1: one process's share is empty.
DDP_OVERRIDES = ["optim=sgd", "trainer.epochs=2", "data.batch_size=479"]


def run(command, cwd, env=None):
    result = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def final_weights(run_dir):
    return torch.load(Path(run_dir) / "last.pt", weights_only=True)["model"]


def test_torchrun_two_processes_reach_the_single_process_weights_and_write_one_run(tmp_path):
    result = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "train.py"), *DDP_OVERRIDES],
        cwd=tmp_path,
    )
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outputs"]  # rank 1 wrote no folder of its own
    assert {"train.log", "last.pt", "summary.json", ".hydra"} <= {path.name for path in run_dir.iterdir()}
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    log = (run_dir / "train.log").read_text()
    assert len(re.findall(r"^.*epoch \d/2: train loss", log, re.MULTILINE)) == 2
    assert len(re.findall(r"^epoch 1/2: train loss", result.stdout, re.MULTILINE)) == 1  # printed by rank 0 only
    threads_each = max(1, len(os.sched_getaffinity(0)) // 2)  # the two ranks share the cores
    assert f"cpu, {logs.counted(threads_each, 'thread')} each, 2 processes (gloo)" in log

    single_dir = tmp_path / "single"
    train.fit(config.load_config(DDP_OVERRIDES), single_dir)
    distributed, single = final_weights(run_dir), final_weights(single_dir)
    assert distributed.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(distributed[key], single[key], rtol=1e-5, atol=1e-6, msg=key)
    # the logged metrics are of the whole dataset, not of one rank's half
    ddp_summary, single_summary = summary.read_run_summary(run_dir), summary.read_run_summary(single_dir)
    for tag in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert ddp_summary[tag] == pytest.approx(single_summary[tag], abs=1e-5), tag


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_on_two_nodes_meeting_at_a_master_address_reaches_the_single_process_weights(tmp_path):
    # The README's two-node command, both "nodes" on this machine: node 0 hosts the rendezvous at
    # 127.0.0.1, node 1 joins it; one process each, one thread each (two processes share 2 cores).
    port = free_port()
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
         "--master_addr=127.0.0.1", f"--master_port={port}", str(REPO / "train.py"), *DDP_OVERRIDES,
         "trainer.threads=1"],
        cwd=tmp_path / f"node{rank}",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    (run_dir,) = (tmp_path / "node0" / "outputs" / "runs").glob("*/*")
    assert not (tmp_path / "node1" / "outputs").exists()  # the other node's rank wrote nothing
    assert "cpu, 1 thread each, 2 processes (gloo)" in (run_dir / "train.log").read_text()
    single_dir = tmp_path / "single"
    train.fit(config.load_config(DDP_OVERRIDES), single_dir)
    distributed, single = final_weights(run_dir), final_weights(single_dir)
    for key in single:
        torch.testing.assert_close(distributed[key], single[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_task_function_pickles_by_value_as_joblib_and_submitit_send_it():
    # Run as a script, train.py is __main__, so joblib's workers and submitit's jobs get main pickled by
    # value with cloudpickle, closures and all: main under a context manager's decorator held a generator,
    # and every joblib and SLURM sweep failed before its first job
    import cloudpickle

    cloudpickle.register_pickle_by_value(train)
    try:
        task = cloudpickle.loads(cloudpickle.dumps(train.main.__wrapped__))
    finally:
        cloudpickle.unregister_pickle_by_value(train)
    assert task.__name__ == "main" and task is not train.main.__wrapped__


def test_joblib_sweep_runs_jobs_in_parallel_on_shared_cores_and_summarizes(tmp_path):
    # a fresh extension cache: the parent builds once, before the jobs start; the jobs only load it
    result = run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "linear=torch,custom", "trainer.epochs=40"],  # 1-2 s each: both run while the other does
        cwd=tmp_path, env={"LINEAR_LAB_BUILD_DIR": str(tmp_path / "cache")},
    )
    assert result.stderr.count("building the extension") == 1 and "waiting for process" not in result.stderr
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    # in parallel: each job's TensorBoard events span its run, and the two spans overlap
    spans = [event_span(job_dir) for job_dir in sorted(sweep_dir.glob("*_mlp-*"))]
    assert len(spans) == 2 and max(start for start, _ in spans) < min(end for _, end in spans), spans
    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["linear"] for row in rows] == ["torch", "custom"]
    assert float(rows[1]["speedup_vs_torch"]) > 0 and rows[0]["speedup_vs_torch"] == ""
    assert float(rows[1]["speedup_low"]) <= float(rows[1]["speedup_vs_torch"]) <= float(rows[1]["speedup_high"])
    markdown = (sweep_dir / "summary.md").read_text()
    assert re.search(r"\| `trainer.epochs=40` \| [\d.]+x \| [\d.]+-[\d.]+ \| [^|]+ \| "
                     r"100% of the FLOPs \| [+-][\d.]+ points \|", markdown)
    assert markdown.strip() in result.stdout  # printed at the end of the sweep
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for job_dir in sweep_dir.glob("*_mlp-*"):
        assert f"cpu, {logs.counted(threads, 'thread')} |" in (job_dir / "train.log").read_text()


def event_span(run_dir):
    """(first, last) wall time of the run's TensorBoard events: from its writer's creation to its last scalar."""
    (events,) = run_dir.glob("events.out.tfevents.*")
    times = [event.wall_time for event in EventFileLoader(str(events)).Load()]
    return min(times), max(times)


@pytest.mark.parametrize("n_jobs, jobs_at_once", [(4, 4), (-1, 8), (-2, 7), (-5, 4), (-8, 1), (-20, 1)])
def test_threads_share_the_cores_among_joblibs_jobs_counted_as_joblib_counts(monkeypatch, n_jobs, jobs_at_once):
    # joblib's convention for a negative n_jobs: -1 is all cores, -2 all but one, ..., never fewer than one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with initialize_config_dir(str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=joblib", f"hydra.launcher.n_jobs={n_jobs}"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        assert build.threads_per_process("auto") == max(1, 8 // jobs_at_once)
        assert build.threads_per_process(3) == 3  # a number is taken as it is
    finally:
        HydraConfig.instance().cfg = None


def test_optuna_search_finishes_and_reports_its_best_value(tmp_path):
    result = run(
        [sys.executable, str(REPO / "train.py"), "-m", "search=mlp_lr", "hydra.sweeper.n_trials=3", "trainer.epochs=1"],
        cwd=tmp_path,
    )
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    with open(sweep_dir / "summary.csv") as file:
        accuracies = [float(row["val_acc"]) for row in csv.DictReader(file)]
    assert len(accuracies) == 3 and best.best_value == pytest.approx(max(accuracies))
    assert set(best.best_params) == {"optim.lr", "optim.weight_decay", "model.dropout", "model.hidden_sizes"}
    assert re.search(r"Best value: 0\.\d+", result.stdout + result.stderr)
    assert "setup plugin alembic" not in result.stdout + result.stderr  # conf/hydra/default.yaml quiets it


def test_optuna_records_a_failed_trial_as_failed_and_searches_on(tmp_path):
    # Optuna takes a sweep on the command line as that key's search space. At lr=1e6 the loss becomes NaN
    # in the first epoch: those trials fail, the others run.
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "search=mlp_lr", "hydra.sweeper.n_trials=4",
         "trainer.epochs=1", "optim.lr=choice(0.001,1e6)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 1, result.stderr[-3000:]  # a sweep with a failed job exits with 1
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    failed = [row for row in rows if row["error"]]
    assert len(rows) == 4 and 0 < len(failed) < 4
    assert all("optim.lr=1000000.0" in row["overrides"] and re.match("loss became (nan|inf)", row["error"]) for row in failed)
    assert "Failed experiment: Return value must be float-castable" in result.stdout + result.stderr  # Optuna's FAIL
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert best.best_params["optim.lr"] == 0.001
    assert best.best_value == pytest.approx(max(float(row["val_acc"]) for row in rows if not row["error"]))


def test_an_optuna_search_whose_every_trial_failed_ends_with_its_summary_in_one_line(tmp_path):
    # the plugin's own sweeper stopped at Optuna's "No trials are completed yet", in a traceback and with no summary
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "search=mlp_lr", "hydra.sweeper.n_trials=2",
         "trainer.epochs=1", "data=mnist", f"data.root={tmp_path / 'no_data'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    assert "2 jobs, 2 failed" in (sweep_dir / "summary.md").read_text()
    assert result.stderr.strip().splitlines()[-1].startswith("error: 2 job(s) failed: ")


@pytest.fixture(scope="module")
def plain_val_acc(tmp_path_factory):
    return train.fit(config.load_config(["model=mlp", "linear=custom", "trainer.epochs=1"]), tmp_path_factory.mktemp("plain"))


def test_amp_trains_the_custom_mlp_under_autocast_as_well_as_the_plain_run(tmp_path, plain_val_acc):
    with recording_layers() as seen:
        val_acc = train.fit(config.load_config(["model=mlp", "linear=custom", "trainer.epochs=1", "trainer.amp=true"]),
                            tmp_path)
    assert abs(val_acc - plain_val_acc) <= 0.02
    assert seen and all(call.autocast and call.output == torch.float32 for call in seen)  # our op: float32 on CPU
    run_summary = summary.read_run_summary(tmp_path)  # the sweep summary's note on precisions reads these
    assert run_summary["device"] == "cpu" and run_summary["autocast"] == "bfloat16"


def test_compile_trains_the_custom_mlp_compiled_as_well_as_the_plain_run(tmp_path, plain_val_acc):
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    val_acc = train.fit(config.load_config(["model=mlp", "linear=custom", "trainer.epochs=1", "trainer.compile=true"]),
                        tmp_path)
    assert abs(val_acc - plain_val_acc) <= 0.02
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before  # dynamo compiled the model's forward


def test_compiled_custom_mlp_has_no_graph_breaks():
    model = ext.replace_linears(models.build_model("mlp", 10, 1, image_size=(8, 8)))
    explanation = torch._dynamo.explain(model)(torch.randn(4, 1, 8, 8))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_cpu_autocast_runs_our_op_in_float32_after_bfloat16_convolutions():
    model = ext.replace_linears(models.build_model("resnet18", 10, 3, small_input=True))
    model.to(memory_format=torch.channels_last)
    images = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(images)
    assert logits.dtype == torch.float32  # the final Linear got a bfloat16 input and ran in float32
    logits.sum().backward()
    assert model.fc.weight.grad.dtype == torch.float32
    assert all(parameter.grad is not None for parameter in model.stem.parameters())


@dataclass
class LayerCall:
    kind: str  # "Conv2d" or "Linear" (ext.Linear)
    channels_last: bool  # the input is laid out channels_last (a 1 x 1 image is both layouts)
    contiguous: bool  # the input is laid out as a plain contiguous tensor
    weight_channels_last: bool
    input: torch.dtype
    output: torch.dtype
    autocast: bool


@contextlib.contextmanager
def recording_layers():
    """Records how every Conv2d and ext.Linear forward in the block ran (on real tensors: the FLOP count
    on the meta device is left out)."""
    seen = []

    def record(module, args, output):
        if isinstance(module, (torch.nn.Conv2d, ext.Linear)) and args[0].device.type != "meta":
            seen.append(LayerCall("Conv2d" if isinstance(module, torch.nn.Conv2d) else "Linear",
                                  args[0].is_contiguous(memory_format=torch.channels_last), args[0].is_contiguous(),
                                  module.weight.is_contiguous(memory_format=torch.channels_last),
                                  args[0].dtype, output.dtype, torch.is_autocast_enabled("cpu")))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


RESNET_RUN = ["model=resnet18", "data=fake", "data.train_size=32", "data.val_size=16", "data.image_size=[3,8,8]",
              "data.batch_size=16", "trainer.epochs=1"]


def test_resnet_trains_with_channels_last_and_amp_and_both_take_effect(tmp_path):
    with recording_layers() as seen:
        train.fit(config.load_config([*RESNET_RUN, "trainer.channels_last=true", "trainer.amp=true"]), tmp_path)
    convs = [call for call in seen if call.kind == "Conv2d"]
    assert len(convs) == 20 * 3  # ResNet-18's 20 convolutions, in 2 training and 1 evaluation steps
    # every convolution reads channels_last input with channels_last weights (the model was converted, not
    # only the images) and runs in bfloat16 under autocast
    assert all(call.channels_last and call.weight_channels_last and call.output == torch.bfloat16 and call.autocast
               for call in convs)
    assert not all(call.contiguous for call in convs)  # not merely images too small to tell the layouts apart
    # the head gets the bfloat16 features and runs our op in float32 (ext.Linear under CPU autocast)
    heads = [call for call in seen if call.kind == "Linear"]
    assert len(heads) == 3 and all(call.input == torch.bfloat16 and call.output == torch.float32 for call in heads)
    assert (tmp_path / "last.pt").is_file()


def test_without_the_switches_nothing_is_channels_last_or_autocast(tmp_path):
    with recording_layers() as seen:
        train.fit(config.load_config(RESNET_RUN), tmp_path)
    assert len(seen) == 21 * 3
    assert all(call.contiguous and not call.autocast and call.output == torch.float32 for call in seen)


def seeded_draws(seed):
    random.seed(seed)
    np.random.seed(seed)
    return random.random(), np.random.random()


def test_deterministic_runs_seed_every_generator_and_give_identical_weights(tmp_path):
    overrides = ["trainer.epochs=1", "trainer.deterministic=true", "model.dropout=0.2", "seed=3"]
    try:
        for name in ("first", "second"):
            seeded_draws(99)  # whatever state the generators were left in
            train.fit(config.load_config(overrides), tmp_path / name)
            assert (random.random(), np.random.random()) == seeded_draws(3)  # training draws from neither
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    first, second = final_weights(tmp_path / "first"), final_weights(tmp_path / "second")
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.fixture
def processes(monkeypatch):
    """Makes the trainer see itself as one of `count` torchrun processes."""
    def set_count(count):
        for module in (build, distributed):
            monkeypatch.setattr(module, "world", lambda: (0, count))
    return set_count


@pytest.mark.parametrize("loader", ["memory", "dataloader"])
def test_a_resnet_trains_a_last_batch_of_one_sample_within_the_batch_before(tmp_path, loader):
    # 17 images at batch 16: a last batch of 1, which BatchNorm at the 8x8 images' 1x1 map cannot train on
    overrides = [*RESNET_RUN, "data.train_size=17", "data.val_size=17", f"data.loader={loader}"]
    train.fit(config.load_config(overrides), tmp_path)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["global_step"] == 1  # one step of 17
    assert "val loss" in (tmp_path / "train.log").read_text()  # validation's batch of 1 ran in eval mode


@pytest.mark.parametrize("model, count, device, smallest", [
    ("mlp", 1, "cpu", 1), ("mlp", 2, "cpu", 1),  # no BatchNorm: batches as cut
    ("resnet18", 1, "cpu", 2), ("resnet18", 2, "cuda", 2),  # one BatchNorm over the whole batch (SyncBatchNorm)
    ("resnet18", 2, "cpu", 4), ("resnet18", 3, "cpu", 6),  # each CPU process normalizes its own share
])
def test_batchnorm_gets_two_samples_a_step_wherever_it_normalizes(processes, model, count, device, smallest):
    processes(count)
    cfg = config.load_config([*RESNET_RUN, f"model={model}"])
    network = build.make_model(cfg, build.read_dataset(cfg.data), torch.device("cpu"))
    assert build.min_training_batch(network, torch.device(device)) == smallest


@pytest.mark.parametrize("count, overrides, message", [
    (1, ["data.batch_size=1"], "data.batch_size=1 is too small: model=resnet18's BatchNorm needs 2 samples a step; "
                               "set data.batch_size to 2 or more"),
    (2, ["data.batch_size=3"], "data.batch_size=3 is too small: model=resnet18's BatchNorm needs 2 samples a step "
                               "on each of the 2 processes (on CPUs each normalizes its own share); set "
                               "data.batch_size to 4 or more"),
    (2, ["data.train_size=3"], "3 training samples are too few: model=resnet18's BatchNorm needs 2 samples a step "
                               "on each of the 2 processes (on CPUs each normalizes its own share); use a dataset "
                               "of 4 or more"),
])
def test_a_batch_size_giving_batchnorm_one_sample_every_step_is_refused(processes, count, overrides, message):
    processes(count)
    cfg = config.load_config([*RESNET_RUN, *overrides])
    with pytest.raises(config.ConfigError, match=f"^{re.escape(message)}$"):
        build.build_training(cfg, build.read_dataset(cfg.data), torch.device("cpu"))


def test_a_batch_size_of_one_is_refused_in_one_line_before_training_and_left_to_models_without_batchnorm(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *RESNET_RUN, "data.batch_size=1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: data.batch_size=1 is too small: model=resnet18's BatchNorm needs 2 samples a step; "
        "set data.batch_size to 2 or more"]
    assert not list(tmp_path.glob("outputs/runs/*/*/events.out.tfevents.*"))  # no empty TensorBoard run
    train.fit(config.load_config(["data.batch_size=1", "data.val_fraction=0.99"]), tmp_path / "mlp")  # 17 steps


def test_torchrun_on_gpus_syncs_batchnorm_keeping_the_parameters_the_keys_and_our_layers(processes, monkeypatch):
    processes(2)
    monkeypatch.setattr(build, "DistributedDataParallel", lambda module, device_ids: module)  # no process group
    cfg = config.load_config([*RESNET_RUN, "conv=custom", "linear=custom"])
    dataset = build.read_dataset(cfg.data)
    model = build.make_model(cfg, dataset, torch.device("cpu"))
    parameters, keys = list(model.parameters()), list(model.state_dict())
    assert build.training_module(model, cfg, torch.device("cuda")) is model
    norms = [module for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 20 and all(type(module) is torch.nn.SyncBatchNorm for module in norms)
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # the optimizer's still
    assert list(model.state_dict()) == keys  # checkpoints load either way, into one process or many
    single = build.make_model(cfg, dataset, torch.device("cpu"))
    single.load_state_dict(model.state_dict())
    model.load_state_dict(single.state_dict())
    assert any(isinstance(module, ext.Conv2d) for module in model.modules())  # conv=custom and linear=custom
    assert any(isinstance(module, ext.Linear) for module in model.modules())
    processes(2)
    assert not distributed.syncs_batchnorm(torch.device("cpu"))  # torch's SyncBatchNorm takes GPU tensors only
    processes(1)
    assert not distributed.syncs_batchnorm(torch.device("cuda"))


def test_torchrun_on_cpus_trains_a_resnet_whose_last_batch_would_give_each_process_one_sample(tmp_path):
    # 18 images at batch 8 on 2 processes: a last batch of 2, one sample each, which each CPU process's own
    # BatchNorm (at the 8x8 images' 1x1 map) cannot train on; it joins the batch before: 2 steps, of 8 and 10
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
         *RESNET_RUN, "data.train_size=18", "data.batch_size=8", "trainer.threads=1"], cwd=tmp_path)
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert torch.load(run_dir / "last.pt", weights_only=True)["global_step"] == 2
    assert "2 processes (gloo)" in (run_dir / "train.log").read_text()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_on_gpus_trains_a_resnet_as_one_process_does(tmp_path):
    # SyncBatchNorm: each step's BatchNorm normalizes the whole batch, not each process's share
    overrides = [*RESNET_RUN, "optim=sgd", "trainer.device=cuda", "data.batch_size=8", "trainer.deterministic=true"]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "train.py"),
         *overrides], cwd=tmp_path)
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert "2 processes (nccl)" in (run_dir / "train.log").read_text()
    single_dir = tmp_path / "single"
    run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={single_dir}"], cwd=tmp_path)
    distributed_weights, single = final_weights(run_dir), final_weights(single_dir)
    assert distributed_weights.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(distributed_weights[key], single[key], rtol=1e-4, atol=1e-5, msg=key)
    ddp_summary, single_summary = summary.read_run_summary(run_dir), summary.read_run_summary(single_dir)
    for tag in ("train/loss", "val/loss"):
        assert ddp_summary[tag] == pytest.approx(single_summary[tag], rel=1e-4), tag
