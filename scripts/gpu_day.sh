#!/usr/bin/env bash
# A day with a GPU, in one command: builds the extension for the GPU at hand, runs the static
# kernel checks (.ci/check_cuda.sh), the CUDA tests on the real kernels (tests/test_cuda_ops.py),
# bench.linear's CUDA tables against cuBLAS (float32, float32 with TF32, bfloat16; the MLP shapes
# and 4096^3, with issue 24's goals), bench.conv's against cuDNN (float32, bfloat16: the ResNet
# shapes), Nsight Compute's reading of the 4096^3 forward's kernel in float32 and bfloat16 (where ncu
# is installed), the whole MLP training step on the GPU, float32 (torch.compile'd nn.Linear as a third
# side) and under autocast, and the whole ResNet-18 step with conv=custom, float32 and under autocast
# (bench.train), and writes it all into one markdown report. A failing step is reported and the
# next one still runs; the exit status is 1 if any step failed.
#
# Usage: bash scripts/gpu_day.sh [REPORT]     (default: $OUT/gpu_day.md under the device tool, else gpu_day.md)
#   PYTHON      the interpreter with torch (default python3)
#   QUICK=1     bench.linear and bench.conv --quick, shorter training runs (on an H200: 167 s with
#               CHECK_CUDA=0, the build 53 s of it, before the ncu steps were added)
#   CHECK_CUDA=0  skip .ci/check_cuda.sh (static, needs no GPU: run it beforehand where device time is free)
#   STEP_TIMEOUT  seconds after which a step is stopped and reported failed (default: none)
#               (on an H200 with 16 host CPUs, 2026-11-28, CHECK_CUDA=0: 218 s in all, the build 62 s,
#               bench.linear 37 s, bench.conv 44 s, each MLP step about 18 s, before the torch.compile side
#               (about 50 s more) and the ResNet-18 steps (about 35 s each) were added)
# Each step's whole output goes to REPORT's sibling *_logs.txt; the report keeps its tail.
#
# A machine without a package registry (the device tool's) lacks hydra-core, which bench.train
# needs. Fetch it beforehand where pip works, into .whl/ (git-ignored), and carry .whl:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.8 omegaconf==2.3.1
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3    # PyPI has only its sdist
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
REPORT=${1:-${OUT:+$OUT/}gpu_day.md}
LOGS=$(mktemp -d)
FULL_LOGS=${REPORT%.md}_logs.txt
: > "$FULL_LOGS"
start_s=$SECONDS
failed=()

if ! "$PYTHON" -c "import hydra" 2>/dev/null && compgen -G ".whl/*" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
      --target /tmp/gpu_day_site .whl/* &&
    export PYTHONPATH=/tmp/gpu_day_site${PYTHONPATH:+:$PYTHONPATH}
fi

gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi")
{
  echo "# GPU day: $gpu"
  echo
  echo "Commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M UTC'), torch" \
       "$("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1)," \
       "$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no nvcc')."
  echo
} > "$REPORT"

# step NAME COMMAND...: runs it, logs it, and puts its exit status, time and output (or the
# markdown it wrote to $LOGS/NAME.md) into the report.
step() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-0}" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  { echo "=== $name (exit $rc): $*"; cat "$LOGS/$name.log"; } >> "$FULL_LOGS"
  {
    echo "## $name (exit $rc, $((SECONDS - t0)) s)"
    echo
    if [[ -s $LOGS/$name.md ]]; then  # it starts with its own command line
      cat "$LOGS/$name.md"
    else
      echo "\`$*\`"; echo
      echo '```'; tail -n "${TAIL:-60}" "$LOGS/$name.log"; echo '```'
    fi
    echo
  } >> "$REPORT"
  [[ $rc == 0 ]] || failed+=("$name")
  tail -n 3 "$LOGS/$name.log"
}

# The full bench.linear --cuda-only ran past 150 s on an H200 with its CPU defaults (0.2 s blocks, 5 rounds);
# on a GPU 0.03 s blocks hold thousands of the small products' calls.
timing=(--min-run-time 0.03 --rounds 3)
epochs=(--epochs 3 --train-size 60000)
resnet_epochs=(--epochs 3 --train-size 12800)
if [[ ${QUICK:-0} == 1 ]]; then
  timing=(--quick); epochs=(--epochs 2 --train-size 10000); resnet_epochs=(--epochs 2 --train-size 2560)
fi

step build "$PYTHON" -m ext
[[ ${CHECK_CUDA:-1} == 0 ]] || step check_cuda env PYTHON="$PYTHON" bash .ci/check_cuda.sh
step cuda_tests "$PYTHON" -m pytest tests/test_cuda_ops.py -q -rfE --tb=short -p no:cacheprovider
step bench_linear "$PYTHON" -m bench.linear --cuda-only "${timing[@]}" --markdown "$LOGS/bench_linear.md"
step bench_conv "$PYTHON" -m bench.conv --cuda "${timing[@]}" --markdown "$LOGS/bench_conv.md"
# Nsight Compute's reading of the 4096^3 forward's kernel: where its cycles go (bench/README.md, "On a GPU").
if command -v ncu >/dev/null; then
  for precision in float32 bfloat16; do
    TAIL=150 step "ncu_$precision" ncu --clock-control none -k regex:gemm_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
      "$PYTHON" -m bench.profile_cuda --precision "$precision"
  done
fi
if "$PYTHON" -c "import hydra" 2>/dev/null; then
  step bench_train_float32 "$PYTHON" -m bench.train "${epochs[@]}" --compiled-torch \
      --markdown "$LOGS/bench_train_float32.md"
  step bench_train_amp "$PYTHON" -m bench.train "${epochs[@]}" --markdown "$LOGS/bench_train_amp.md" trainer.amp=true
  # The whole ResNet-18 step (CIFAR-size images) with its convolutions on ours too: the comparison a user
  # runs with model=resnet18 conv=custom.
  step bench_train_resnet18 "$PYTHON" -m bench.train --conv "${resnet_epochs[@]}" \
      --markdown "$LOGS/bench_train_resnet18.md" model=resnet18 'data.image_size=[3,32,32]'
  step bench_train_resnet18_amp "$PYTHON" -m bench.train --conv "${resnet_epochs[@]}" \
      --markdown "$LOGS/bench_train_resnet18_amp.md" model=resnet18 'data.image_size=[3,32,32]' trainer.amp=true
else
  echo "## bench_train: skipped (no hydra-core, and no wheels for it in .whl/: see scripts/gpu_day.sh)" >> "$REPORT"
  failed+=(bench_train)
fi

summary="${#failed[@]} step(s) failed${failed[*]:+: ${failed[*]}}; $((SECONDS - start_s)) s"
echo "Done: $summary" >> "$REPORT"
echo "gpu_day: $summary; report in $REPORT"
[[ ${#failed[@]} == 0 ]]
