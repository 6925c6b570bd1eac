"""TensorBoard as a user sees it: a real TensorBoard on 127.0.0.1 over a torch and a custom run, asked through
the data routes its dashboards read (scalars, HParams, Custom Scalars)."""
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import train
from trainer import config, summary


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ask(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """TensorBoard's URL over two one-epoch runs of the default MLP, linear=torch and linear=custom."""
    logdir = tmp_path_factory.mktemp("outputs")
    for num, linear in enumerate(("torch", "custom")):
        train.fit(config.load_config([f"linear={linear}", "trainer.epochs=2"]), logdir / f"{num}_mlp-{linear}")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                "127.0.0.1", "--port", str(port), "--load_fast=false"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # until it answers and has read both runs
            try:
                if len(ask(f"{url}/data/plugin/scalars/tags")) == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "TensorBoard did not load the two runs within 120 s"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_hparams_show_the_configured_lr_and_both_linears(board):
    experiment = ask(f"{board}/data/plugin/hparams/experiment", {"experimentName": ""})
    hparams = {info["name"]: info for info in experiment["hparamInfos"]}
    assert hparams["lr"]["domainInterval"] == {"minValue": 0.001, "maxValue": 0.001}  # not the scheduled rate
    assert sorted(hparams["linear"]["domainDiscrete"]) == ["custom", "torch"] and hparams["linear"]["differs"]
    assert hparams["linear_flop_share"]["domainInterval"]["minValue"] == 1.0
    assert hparams["batch_size"]["domainDiscrete"] == ["64"] and hparams["epochs"]["domainDiscrete"] == ["2"]  # not 64.0000
    metrics = {info["name"]["tag"] for info in experiment["metricInfos"]}
    assert {"val/acc", "time/epoch_s_mean", "time/epoch_s"} <= metrics and "lr" not in metrics


def test_scalars_come_in_three_groups_time_train_val_and_the_learning_rate_has_its_own_name(board):
    tags = ask(f"{board}/data/plugin/scalars/tags")
    for run_tags in tags.values():
        assert {"val/acc", "train/loss", "time/epoch_s", "train/lr"} <= set(run_tags) and "lr" not in run_tags
        # TensorBoard's Time Series opens the first two groups (by name) and folds the rest: epoch time, then
        # loss and accuracy, with val's headers right below
        assert sorted({tag.split("/")[0] for tag in run_tags}) == ["time", "train", "val"]


def test_custom_scalars_lay_out_the_comparison(board):
    layout = ask(f"{board}/data/plugin/custom_scalars/layout")
    (category,) = layout["category"]
    assert category["title"] == "torch vs custom"
    charts = {chart["title"]: chart.get("multiline", chart.get("margin")) for chart in category["chart"]}
    assert {title: chart["tag"] for title, chart in charts.items() if "tag" in chart} == {
        "val/acc": ["^val/acc$"], "train/loss": ["^train/loss$"], "time/epoch_s": ["^time/epoch_s$"]}
    margin = charts["custom's speedup over torch (95% interval)"]["series"][0]
    assert (margin["value"], margin["lower"], margin["upper"]) == summary.SPEEDUP_TAGS
