"""conf/: every option of every group composes and builds; bad settings fail in one line."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

import data
import ext
from trainer import build, config
from test_data import write_tiny_cifar10, write_tiny_mnist

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("model", "linear", "conv", "data", "optim", "sched")
TINY_FAKE = ["data=fake", "data.train_size=8", "data.val_size=4", "data.image_size=[3,16,16]"]


def options(group):
    return sorted(path.stem for path in (REPO / "conf" / group).glob("*.yaml"))


def test_groups_offer_the_documented_options():
    assert {group: options(group) for group in GROUPS} == {
        "model": ["mlp", "resnet101", "resnet152", "resnet18", "resnet34", "resnet50"],
        "linear": ["custom", "torch"],
        "conv": ["custom", "torch"],
        "data": ["cifar10", "digits", "fake", "fashion_mnist", "mnist"],
        "optim": ["adamw", "sgd"],
        "sched": ["cosine", "none", "onecycle"],
    }


def build_run(cfg):
    """What fit() builds before its first epoch: data, model, optimizer, scheduler, loaders."""
    dataset = data.load_data(**build.dataset_options(cfg.data))
    return dataset, *build.build_training(cfg, dataset, torch.device("cpu"))


@pytest.mark.parametrize("model", options("model"))
def test_every_model_composes_builds_and_runs(model):
    cfg = config.load_config([f"model={model}", *TINY_FAKE])
    config.validate(cfg)
    dataset, net, optimizer, scheduler, train_loader, val_loader = build_run(cfg)
    images, labels = next(iter(train_loader))
    assert net(images[:2]).shape == (2, dataset.num_classes)


@pytest.mark.parametrize("name", options("data"))
def test_every_dataset_composes_and_builds(name, tmp_path):
    write_tiny_mnist(tmp_path, "MNIST")
    write_tiny_mnist(tmp_path, "FashionMNIST")
    write_tiny_cifar10(tmp_path)
    overrides = [f"data={name}", f"data.root={tmp_path}"]
    if name == "fake":
        overrides += ["data.train_size=8", "data.val_size=4"]
    cfg = config.load_config(overrides)
    config.validate(cfg)
    dataset, net, *_, train_loader, val_loader = build_run(cfg)
    assert len(dataset.train_labels) > 0 and len(dataset.val_labels) > 0
    images, labels = next(iter(train_loader))
    assert images.shape[1:] == dataset.image_shape and net(images).shape == (len(labels), dataset.num_classes)


def test_linear_custom_swaps_every_linear_and_keeps_the_initial_weights():
    nets = {}
    for linear in options("linear"):
        cfg = config.load_config([f"linear={linear}", "model.hidden_sizes=[32,16]"])
        _, nets[linear], *_ = build_run(cfg)
    types = {linear: [type(m) for m in net.modules() if isinstance(m, nn.Linear)] for linear, net in nets.items()}
    assert types["torch"] == [nn.Linear] * 3 and types["custom"] == [ext.Linear] * 3
    torch_state, custom_state = nets["torch"].state_dict(), nets["custom"].state_dict()
    assert list(torch_state) == list(custom_state)
    assert all(torch.equal(torch_state[key], custom_state[key]) for key in torch_state)


@pytest.mark.parametrize("optim", options("optim"))
@pytest.mark.parametrize("sched", options("sched"))
def test_every_optimizer_and_schedule_builds_and_steps(optim, sched):
    epochs = 10
    cfg = config.load_config([f"optim={optim}", f"sched={sched}", f"trainer.epochs={epochs}"])
    params = [nn.Parameter(torch.zeros(3))]
    optimizer = instantiate(cfg.optim, params=params)
    scheduler = instantiate(cfg.sched, optimizer=optimizer)
    lrs = []
    for _ in range(epochs):  # the trainer steps schedulers once per epoch
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    peak = cfg.optim.lr
    if sched == "none":
        assert lrs == [peak] * epochs
    elif sched == "cosine":
        assert lrs[0] == peak and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 0.05 * peak
    else:  # onecycle: warm up to about optim.lr, then anneal, never down to the cycle's end (optim.lr / 1e5)
        top = lrs.index(max(lrs))
        assert 0 < top < epochs - 1 and 0.95 * peak < max(lrs) <= peak and lrs[0] < peak / 10
        assert lrs[-1] > peak / 100


@pytest.mark.parametrize("epochs", [1, 2])
def test_one_cycle_trains_short_runs_at_a_useful_lr(epochs):
    # the last epoch used to train at the cycle's end: optim.lr / 1e5, i.e. not at all in a 1-epoch run
    cfg = config.load_config(["sched=onecycle", f"trainer.epochs={epochs}"])
    optimizer = instantiate(cfg.optim, params=[nn.Parameter(torch.zeros(3))])
    scheduler = instantiate(cfg.sched, optimizer=optimizer)
    for _ in range(epochs):
        assert optimizer.param_groups[0]["lr"] > cfg.optim.lr / 5
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("override, message", [
    ("trainer.epochs=0", "trainer.epochs=0 is invalid: it must be a positive integer"),
    ("trainer.epochs=abc", "trainer.epochs=abc is invalid"),
    ("data.batch_size=-3", "data.batch_size=-3 is invalid"),
    ("data.num_workers=-1", "data.num_workers=-1 is invalid"),
    ("data.loader=threads", "data.loader=threads is invalid: it must be one of memory, dataloader"),
    ("trainer.loss=mse", "trainer.loss=mse is invalid: it must be one of ext, torch"),
    ("optim.lr=0", "optim.lr=0 is invalid"),
    ("optim.lr=inf", "optim.lr=inf is invalid"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1 is invalid: it must be a number >= 0"),
    ("optim=sgd optim.momentum=1.5", "optim.momentum=1.5 is invalid"),
    ("model.hidden_sizes=[64,0]", "model.hidden_sizes=[64, 0] is invalid"),
    ("model.activation=swish", "model.activation=swish is invalid"),
    ("model.dropout=1.0", "model.dropout=1.0 is invalid"),
    ("trainer.device=tpu", "trainer.device=tpu is invalid"),
    ("linear.fuse_relu=maybe", "linear.fuse_relu=maybe is invalid: it must be true or false"),
    ("data.download=maybe", "data.download=maybe is invalid: it must be true or false"),
    ("~seed", "seed is missing"),
    # settings that would train wrong (a negative lr, lr 0 all run) or fail only after the data loads
    ("sched.eta_min=-1", "sched.eta_min=-1 is invalid: it must be a number >= 0"),
    ("sched=none sched.factor=0", "sched.factor=0 is invalid: it must be a number in .0, 1]"),
    ("sched.T_max=0", "sched.T_max=0 is invalid: it must be a positive integer"),
    ("sched=onecycle sched.pct_start=1.5", "sched.pct_start=1.5 is invalid"),
    ("optim=sgd optim.nesterov=maybe", "optim.nesterov=maybe is invalid: it must be true or false"),
    ("optim.fused=maybe", "optim.fused=maybe is invalid: it must be true, false or null"),
    ("data.root=null", "data.root=None is invalid: it must be a folder path"),
    ("data.split_seed=abc", "data.split_seed=abc is invalid: it must be an integer"),
    # a key another option of the group has, which this option's class does not take
    ("+optim.momentum=0.5", "optim.momentum is not a setting of trainer.optim.AdamW: it takes lr, betas, eps,"),
    ("sched=onecycle +sched.eta_min=0", "sched.eta_min is not a setting of torch.optim.lr_scheduler.OneCycleLR"),
])
def test_validate_names_the_bad_setting(override, message):
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config.validate(config.load_config(override.split()))


@pytest.mark.parametrize("fraction", [0.0001, 0.99999])
def test_a_digits_split_with_an_empty_side_is_refused(fraction):
    cfg = config.load_config([f"data.val_fraction={fraction}"])
    with pytest.raises(data.DataError, match=f"data.val_fraction={fraction} leaves"):
        build.read_dataset(cfg.data)


def test_adamws_betas_eps_and_amsgrad_are_settings_that_reach_the_optimizer():
    cfg = config.load_config(["optim.betas=[0.8,0.99]", "optim.eps=1e-6", "optim.amsgrad=true", *TINY_FAKE])
    config.validate(cfg)
    optimizer = build_run(cfg)[2]
    group = optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.8, 0.99) and group["eps"] == 1e-6 and group["amsgrad"] is True
    saved = io.BytesIO()  # plain Python values, no OmegaConf ListConfig: the checkpoint loads with weights_only
    torch.save(optimizer.state_dict(), saved)
    assert torch.load(io.BytesIO(saved.getvalue()), weights_only=True)["param_groups"][0]["eps"] == 1e-6
    config.check_command_line(["+optim.maximize=false"])  # any parameter of the class, with +; a wrong one is named
    with pytest.raises(config.ConfigError, match="optim.foo is not a setting of trainer.optim.AdamW: it takes lr, betas"):
        config.validate(config.load_config(["+optim.foo=1"]))


def test_a_sweep_may_evaluate_a_checkpoint_but_not_resume_it(tmp_path):
    (tmp_path / ".hydra").mkdir()  # a run's folder, with its checkpoint
    (tmp_path / "last.pt").write_bytes(b"")
    arguments = config.resume_arguments(["-m", "trainer.eval_only=True", f"trainer.resume={tmp_path}", "linear=torch,custom"])
    assert f"trainer.resume='{tmp_path}'" in arguments  # evaluating under -m: accepted
    with pytest.raises(SystemExit):  # resuming under -m: each job would continue the same run (main's test: the line)
        config.resume_arguments(["-m", f"trainer.resume={tmp_path}", "linear=torch,custom"])


def test_cuda_device_is_rejected_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(config.ConfigError, match="trainer.device=cuda is invalid"):
        config.validate(config.load_config(["trainer.device=cuda"]))


@pytest.mark.parametrize("args, names", [
    (["model=resnet19"], ["model=resnet19", "mlp, resnet18, resnet34, resnet50, resnet101, resnet152"]),
    (["trainer.epochs=-1"], ["trainer.epochs=-1"]),
    (["data.batch_size=0"], ["data.batch_size=0"]),
    (["-m", "linear=torch,cuda"], ["linear=cuda", "custom, torch"]),
    (["trainer.epoch=3"], ["trainer.epoch is not a setting; did you mean trainer.epochs?"]),
    (["modle=mlp"], ["modle is not a setting; did you mean model?"]),
    (["optim.lrr=0.1"], ["optim.lrr is not a setting; did you mean optim.lr?"]),
    (["+trainer.epoch=3"], ["trainer.epoch is not a setting; did you mean trainer.epochs?"]),
    (["model.hidden_sizes=[1,2"], ["cannot read 'model.hidden_sizes=[1,2'", "key=[a,b]"]),
    (["trainer.epochs 3"], ["cannot read 'trainer.epochs 3'"]),
    (["+optim.momentum=0.9"], ["optim.momentum is not a setting of trainer.optim.AdamW"]),
    (["optim.betas=[0.9,1.5]"], ["optim.betas=[0.9, 1.5] is invalid: it must be [beta1, beta2], each a number in"]),
    # a search must go the way its objective improves (the sweeper would report the worst trial as the best)
    (["-m", "search=mlp_lr", "trainer.objective=val/loss"], ["hydra.sweeper.direction=maximize would search for "
                                                             "the worst trainer.objective=val/loss",
                                                             "add hydra.sweeper.direction=minimize"]),
    (["-m", "search=mlp_lr", "hydra.sweeper.direction=minimize"], ["add hydra.sweeper.direction=maximize"]),
    (["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=0", "linear=torch,custom"],
     ["hydra.launcher.n_jobs=0 is invalid: it must be a nonzero integer"]),
    (["-m", "search=mlp_lr", "hydra.sweeper.n_trials=0"], ["hydra.sweeper.n_trials=0 is invalid"]),
    (["-m", "trainer.resume=outputs/runs/x", "linear=torch,custom"], ["trainer.resume continues one run", "drop -m"]),
    (["hydra.run.dir=/proc/no_run_here"], ["hydra.run.dir=/proc/no_run_here cannot be made (No such file"]),
    (["-m", "hydra.sweep.dir=/proc/no_sweep_here", "linear=torch,custom"], ["hydra.sweep.dir=/proc/no_sweep_here "
                                                                            "cannot be made"]),
    # a sweep or a search without -m (Hydra: six lines; a search's config alone would train one default run)
    (["linear=torch,custom"], ["linear=torch,custom is a sweep: add -m (python train.py -m linear=torch,custom)"]),
    (["optim.lr=range(1,3)"], ["is a sweep: add -m (python train.py -m 'optim.lr=range(1,3)')"]),
    (["search=mlp_lr"], ["search=mlp_lr is a hyperparameter search: add -m"]),
    # a search's space is one model's: another would train as a mix of both configs
    (["-m", "search=mlp_lr", "model=resnet18"], ["search=mlp_lr searches settings of model=mlp; drop model=resnet18"]),
    (["-m", "search=mlp_lr", "hydra.sweeper.direction=up"], ["hydra.sweeper.direction=up is invalid: it must be "
                                                             "maximize or minimize"]),
    (["trainer=foo"], ["trainer is a section of settings, not a setting", "trainer.epochs="]),
    (["-m", "search=foo", "model=mlp"], ["search=foo is not an option; choose one of: mlp_lr"]),
    # a setting of another option of the group: which option has it, not "did you mean" itself
    (["optim.momentum=0.9"], ["optim.momentum is not a setting of the chosen optim; optim=sgd has it"]),
    (["model=resnet18", "model.hidden_sizes=[3]"], ["model.hidden_sizes is not a setting of the chosen model; "
                                                    "model=mlp has it"]),
])
def test_bad_overrides_exit_with_one_line_before_any_run_folder(tmp_path, args, names):
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    # torch's CUDA notice and the extension's build notices (only when its sources just changed) are not ours
    lines = [line for line in result.stderr.splitlines()
             if "No CUDA runtime" not in line and not line.startswith("linear-lab: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(name in lines[0] for name in names)
    assert not (tmp_path / "outputs").exists()


def test_under_torchrun_a_bad_setting_is_said_by_rank_0_alone(tmp_path):
    for rank, said in (("0", True), ("1", False)):
        result = subprocess.run([sys.executable, str(REPO / "train.py"), "model=resnet19"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env={**os.environ, "RANK": rank})
        assert result.returncode == 2
        assert ("error: model=resnet19 is not an option" in result.stderr) == said, result.stderr


def test_the_linear_layers_share_of_the_flops_says_what_a_swap_covers():
    mlp = config.load_config([])
    assert build.linear_flop_share(mlp, build.read_dataset(mlp.data)) == 1.0
    resnet = config.load_config(["model=resnet18", "data=fake", "data.train_size=8", "data.val_size=8"])
    dataset = build.read_dataset(resnet.data)  # 3x32x32: 0.56 GFLOP a forward, 10,240 of them in the 512->10 head
    before = torch.get_rng_state()
    assert build.linear_flop_share(resnet, dataset) == pytest.approx(2 * 512 * 10 / 1_110_845_440)
    assert torch.equal(torch.get_rng_state(), before)  # counting draws no random numbers: seeds stay as they were


def test_conv_custom_swaps_every_plain_convolution_and_keeps_the_initial_weights():
    nets = {}
    for conv in options("conv"):
        cfg = config.load_config([f"conv={conv}", "model=resnet18", *TINY_FAKE])
        config.validate(cfg)
        _, nets[conv], *_ = build_run(cfg)
    types = {conv: {type(m) for m in net.modules() if isinstance(m, nn.Conv2d)} for conv, net in nets.items()}
    assert types == {"torch": {nn.Conv2d}, "custom": {ext.Conv2d}}
    torch_state, custom_state = nets["torch"].state_dict(), nets["custom"].state_dict()
    assert list(torch_state) == list(custom_state)
    assert all(torch.equal(torch_state[key], custom_state[key]) for key in torch_state)


def test_with_both_custom_a_resnet_runs_almost_all_its_flops_on_our_kernels():
    resnet = config.load_config(["model=resnet18", "data=fake", "data.train_size=8", "data.val_size=8"])
    shares = build.flop_shares(resnet, build.read_dataset(resnet.data))
    assert shares["conv"] > 0.99 and shares["linear"] + shares["conv"] > 0.995
    assert build.conv_flop_share(resnet, build.read_dataset(resnet.data)) == shares["conv"]
    mlp = config.load_config([])
    assert build.flop_shares(mlp, build.read_dataset(mlp.data)) == {"linear": 1.0, "conv": 0.0}


def test_the_run_line_names_the_conv_choice_and_share_where_there_are_convolutions():
    from trainer import logs
    resnet = config.load_config(["model=resnet18", "conv=custom", "data=fake"])
    line = logs.describe(resnet, torch.device("cpu"), 11_000_000, 9.2e-6, 0.99999)
    assert line.startswith("resnet18 linear=custom conv=custom on fake") and "convolutions: 100%" in line
    mlp = config.load_config([])
    assert logs.describe(mlp, torch.device("cpu"), 1000, 1.0, 0.0).startswith("mlp linear=custom on digits")


def test_conv_custom_is_a_valid_choice_on_a_gpu_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config.validate(config.load_config(["conv=custom", "model=resnet18"]))


def test_a_network_that_cannot_run_on_the_meta_device_has_no_flop_share_and_still_trains(monkeypatch):
    cfg = config.load_config([])
    dataset = build.read_dataset(cfg.data)

    class ReadsItsData(torch.nn.Module):
        def forward(self, images):
            return images.sum().item()  # no value on the meta device

    monkeypatch.setattr(build, "network", lambda cfg, dataset: ReadsItsData())
    assert build.linear_flop_share(cfg, dataset) is None


def test_choices_are_named_in_their_natural_order():
    assert config.natural_order(["resnet152", "resnet18", "mlp", "resnet101", "resnet50", "resnet34"]) == [
        "mlp", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]


def test_one_sweep_can_compare_torch_with_the_unfused_operator():
    # by default linear=custom fuses Linear->ReLU: the unfused check below must have something to remove
    default = config.load_config([])
    fused = build.make_model(default, build.read_dataset(default.data), torch.device("cpu"))
    assert [getattr(module, "activation", None) for module in fused.modules() if isinstance(module, ext.Linear)] == [
        "relu", "relu", None]
    # -m linear=torch,custom linear.fuse_relu=false: the setting must exist for both linears
    for linear in ("torch", "custom"):
        cfg = config.load_config([f"linear={linear}", "linear.fuse_relu=false"])
        config.validate(cfg)
        assert cfg.linear.fuse_relu is False
    model = build.make_model(cfg, build.read_dataset(cfg.data), torch.device("cpu"))
    assert not any(getattr(module, "activation", None) for module in model.modules())  # no fused layer


def test_the_documented_defaults():
    # README's Configuration: what `python train.py` runs with when nothing is said
    cfg = config.load_config([])
    assert (cfg.model.name, cfg.linear.name, cfg.data.name) == ("mlp", "custom", "digits")
    assert cfg.optim._target_ == "trainer.optim.AdamW"
    assert cfg.sched._target_ == "torch.optim.lr_scheduler.CosineAnnealingLR" and "search" not in cfg
    assert (cfg.trainer.device, cfg.trainer.threads, cfg.data.loader) == ("auto", "auto", "memory")
    with config.initialize_config_dir(str(config.CONF_DIR), version_base="1.3"):
        hydra_cfg = config.compose("train", return_hydra_config=True).hydra
    assert hydra_cfg.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


@pytest.mark.parametrize("name", options("data"))
def test_nothing_is_downloaded_unless_asked(name):
    # "fetched only with data.download=true": every dataset starts offline
    assert config.load_config([f"data={name}"]).data.download is False


def test_data_root_defaults_to_the_cache_folder_or_LINEAR_LAB_DATA_DIR(tmp_path, monkeypatch):
    # a tiny MNIST in each place, of different sizes, shows which folder a run reads
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LINEAR_LAB_DATA_DIR", raising=False)
    write_tiny_mnist(tmp_path / "home" / ".cache" / "linear_lab" / "datasets", num_train=12)
    write_tiny_mnist(tmp_path / "elsewhere", num_train=8)
    cfg = config.load_config(["data=mnist"])
    assert cfg.data.root == "~/.cache/linear_lab/datasets"
    assert len(build.read_dataset(cfg.data).train_labels) == 12  # ~ is the user's home, not a folder named ~
    monkeypatch.setenv("LINEAR_LAB_DATA_DIR", str(tmp_path / "elsewhere"))
    cfg = config.load_config(["data=mnist"])
    assert cfg.data.root == str(tmp_path / "elsewhere") and len(build.read_dataset(cfg.data).train_labels) == 8


def test_auto_device_is_cuda_when_available_else_cpu(monkeypatch):
    for available, device in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert build.pick_device("auto") == torch.device(device)
    assert build.pick_device("cpu") == torch.device("cpu")  # a named device is taken as it is


def test_amp_is_bfloat16_where_supported_else_float16_with_a_loss_scaler(monkeypatch):
    cfg = config.load_config(["trainer.amp=true"])
    cpu = build.step_settings(cfg, torch.device("cpu"))
    assert cpu.autocast_dtype == torch.bfloat16 and not cpu.scaler.is_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # settings only: nothing runs on the GPU
    for bfloat16, dtype in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bfloat16)
        gpu = build.step_settings(cfg, torch.device("cuda"))
        assert gpu.autocast_dtype == dtype and gpu.scaler.is_enabled() == (dtype == torch.float16)
    assert build.step_settings(config.load_config([]), torch.device("cpu")).autocast_dtype is None  # amp is off by default



def test_the_step_runs_under_autocast_only_with_amp():
    with build.StepSettings(autocast_dtype=torch.bfloat16).autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with build.StepSettings().autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32

@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_every_documented_activation_is_accepted(activation):
    cfg = config.load_config([f"model.activation={activation}", "linear=torch"])
    config.validate(cfg)
    net = build.make_model(cfg, build.read_dataset(cfg.data), torch.device("cpu"))
    assert any(type(module).__name__.lower() == activation for module in net.modules())


def test_fake_data_is_drawn_from_the_runs_seed():
    def images(seed):
        cfg = config.load_config(["data=fake", "data.train_size=8", "data.val_size=4", f"seed={seed}"])
        return build.read_dataset(cfg.data).train_images

    assert torch.equal(images(1), images(1)) and not torch.equal(images(1), images(2))


def test_cfg_job_prints_the_whole_config(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--cfg", "job"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = OmegaConf.create(result.stdout)
    assert set(printed) == {"model", "linear", "conv", "data", "optim", "sched", "seed", "trainer"}
    assert printed.trainer.epochs == 20 and printed.model.hidden_sizes == [256, 256]
    assert not (tmp_path / "outputs").exists()  # printing runs nothing
