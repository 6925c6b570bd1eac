"""bench/train.py runs the trainer's own epoch for both linears and reports their times (no timing limits)."""
import re

import pytest
import torch

from bench import machine, train as bench_train
from bench.machine import describe_cpu


def test_bench_reports_both_linears_and_their_ratio_with_its_interval(capsys, tmp_path):
    table = tmp_path / "bench_train.md"
    ratios = bench_train.main(["--epochs", "2", "--train-size", "256", "--batch-size", "64", "--markdown", str(table)])
    assert set(ratios) == {"torch"} and ratios["torch"].low <= ratios["torch"].value <= ratios["torch"].high
    shown = capsys.readouterr().out
    assert "torch " in shown and "custom " in shown
    # 8 timed steps are too few for an interval: the verdict says so rather than give a bare ratio or a point
    assert re.search(r"custom's speedup over torch \(mean step time ratio\): [\d.]+x: "
                     r"too few steps to time \(8 timed steps per side, under 20\)", shown)
    markdown = table.read_text()
    assert markdown.startswith("`python -m bench.train --epochs 2") and "| torch | " in markdown
    assert describe_cpu() in markdown  # a figure names the CPU it was measured on


def test_bench_runs_the_trainers_switches_and_a_compiled_torch_side(monkeypatch):
    seen = {}

    def one_epoch(model, loader, optimizer, device, progress=None, settings=None):
        seen.setdefault("sides", []).append((type(model).__name__, settings.autocast_dtype, settings.memory_format))
        return real_epoch(model, loader, optimizer, device, progress, settings)

    real_epoch = bench_train.train.train_one_epoch
    monkeypatch.setattr(bench_train.train, "train_one_epoch", one_epoch)
    ratios = bench_train.main(["--epochs", "1", "--train-size", "128", "--batch-size", "64", "--compiled-torch",
                               "trainer.amp=true", "trainer.channels_last=true"])
    assert set(ratios) == {"torch", "torch.compile"}
    kinds = {model_class for model_class, _, _ in seen["sides"]}
    assert "OptimizedModule" in kinds and len(kinds) == 2  # the third side runs compiled, the others eager
    assert {(dtype, memory_format) for _, dtype, memory_format in seen["sides"]} == {
        (torch.bfloat16, torch.channels_last)}


def test_the_cpu_is_named_with_its_core(monkeypatch):
    zen3 = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "1",
            "flags": "fpu avx2 fma"}
    monkeypatch.setattr(machine, "cpuinfo", lambda: zen3)
    assert machine.describe_cpu().startswith("AMD EPYC (family 25, model 1: Zen 3; avx2, fma), ")
    monkeypatch.setattr(machine, "cpuinfo", lambda: {**zen3, "cpu family": "26", "model": "2",
                                                    "flags": "avx512f avx2 fma"})
    assert machine.describe_cpu().startswith("AMD EPYC (family 26, model 2: Zen 5; avx512f, avx2, fma), ")
    assert machine.amd_core(25, 0x11) == "Zen 4"


def test_a_gpu_is_named_with_its_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert machine.describe_device(torch.device("cuda", 0)) == "cuda:0 (NVIDIA H200)"
    assert machine.describe_device("cuda") == "cuda (NVIDIA H200)"
    assert machine.describe_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: '0' is not a positive integer"),
    (["--threads", "two"], "argument --threads: 'two' is not a positive integer"),
    (["linear.fuse_relu=maybe"], "error: linear.fuse_relu=maybe is invalid: it must be true or false"),
    (["trainer.epoch=3"], "error: trainer.epoch is not a setting; did you mean trainer.epochs?"),
    (["--train-size", "16", "--batch-size", "1", "model=resnet18"],
     "error: data.batch_size=1 is too small: model=resnet18's BatchNorm needs 2 samples a step"),
])
def test_a_bad_argument_or_override_is_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_conv_flag_runs_the_custom_resnet_on_our_convolutions(monkeypatch):
    import ext
    seen = []
    real_epoch = bench_train.train.train_one_epoch

    def one_epoch(model, *args, **kwargs):
        seen.append({type(m) for m in model.modules() if isinstance(m, torch.nn.Conv2d)})
        return real_epoch(model, *args, **kwargs)

    monkeypatch.setattr(bench_train.train, "train_one_epoch", one_epoch)
    bench_train.main(["--epochs", "1", "--train-size", "16", "--batch-size", "8", "--conv", "model=resnet18",
                      "data.image_size=[3,16,16]"])
    assert seen == [{torch.nn.Conv2d}, {ext.Conv2d}] * 2  # torch, custom; warm-up and timed epoch


def test_bench_conv_times_each_pass_and_names_the_cpu(capsys, tmp_path):
    from bench import conv as bench_conv
    table = tmp_path / "bench_conv.md"
    bench_conv.main(["--threads", "1", "--shapes", "8->16@6k3s1,4->8@5k1s2", "--batch", "2", "--rounds", "2",
                     "--min-run-time", "0.01", "--markdown", str(table)])
    shown = capsys.readouterr().out
    markdown = table.read_text()
    assert describe_cpu() in markdown and markdown.startswith("`python -m bench.conv --threads 1")
    for shape in ("8->16@6k3s1", "4->8@5k1s2"):
        assert all(f"| {shape} | {p} |" in markdown for p in ("forward", "backward", "fwd+bwd"))
    assert re.search(r"geomean torch/ext, fwd\+bwd: [\d.]+ \(2 rounds: too few for an interval\); lowest [\d.]+", shown)
    assert bench_conv.flops(bench_conv.ConvShape(8, 16, 6, 3, 1), 2, "forward") == 2 * 2 * 16 * 36 * 8 * 9
    with pytest.raises(SystemExit):
        bench_conv.main(["--shapes", "8->16@32"])  # malformed: one line from the parser


def test_bench_conv_notes_the_rows_where_a_side_page_faulted():
    from bench import conv as bench_conv
    from bench.linear import Row
    shape = bench_conv.ConvShape(64, 64, 32, 3, 1)
    quiet = Row("cpu", "", (0, 0, 0), "forward", (1e-3,), (1e-3,), None, (0.0, 0.5))
    faulting = Row("cpu", "", (0, 0, 0), "backward", (1e-3,), (1e-3,), None, (30_723.75, 0.0))
    notes = bench_conv.fault_notes([(shape, "forward", quiet), (shape, "backward", faulting)])
    assert notes == ["note: 64->64@32k3s1 backward: page faults per call: torch 30,724 (bench/README.md, Memory)"]


def test_bench_conv_says_when_ext_passes_the_peak_by_skipping_the_padding(capsys):
    from bench import conv as bench_conv
    from bench.linear import Row
    shape = bench_conv.ConvShape(512, 512, 4, 3, 1)
    flops = bench_conv.flops(shape, 128, "forward")  # 9.66e9: at 100 GFLOP/s of peak, 0.0966 s
    slow = [(shape, p, Row("cpu", "", (0, 0, 0), p, (1.0,), (1.0,), None)) for p in ("backward", "fwd+bwd")]
    for ext_s, noted in ((0.09, True), (0.1, False)):
        row = Row("cpu", "", (0, 0, 0), "forward", (0.12,), (ext_s,), None)
        lines = bench_conv.table_lines("### t", [(shape, "forward", row)] + slow, 128, flops / 0.0966 / 1e9)
        assert any("so its share of the peak can pass 100%" in line for line in lines) == noted


def test_bench_conv_cuda_says_when_there_is_no_gpu(tmp_path):
    from bench import conv as bench_conv
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: gpu_day.sh runs the CUDA tables")
    table = tmp_path / "bench_conv_cuda.md"
    bench_conv.main(["--cuda", "--shapes", "8->16@6k3s1", "--batch", "2", "--markdown", str(table)])
    assert "CUDA: skipped (no usable GPU)" in table.read_text()
