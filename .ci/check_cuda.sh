#!/usr/bin/env bash
# Static checks of the CUDA kernels, without a GPU: nvcc compiles every .cu under
# ext/csrc for sm_80 and sm_90 (object files only) with -Xptxas -v, fails if any
# kernel spills registers, and prints from the SASS how many FFMA and 128-bit
# shared loads (LDS.128) the float32 forward kernel has, so a slow path shows.
#
# Usage: bash .ci/check_cuda.sh    (VENV: the venv with torch, for its headers; default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ARCHS=(80 90)
FORWARD_KERNEL=_ZN3ext4cuda11gemm_kernelIfEEvNS0_10GemmParamsIT_EE  # ext::cuda::gemm_kernel<float>
start_s=$SECONDS

NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
[[ -x $NVCC ]] || { echo "check_cuda: nvcc not found on PATH or in $CUDA_HOME/bin; set CUDA_HOME" >&2; exit 1; }
CUOBJDUMP=""
for candidate in "$(command -v cuobjdump || true)" "$CUDA_HOME/bin/cuobjdump" \
                 "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump; do
  if [[ -n $candidate && -x $candidate ]]; then CUOBJDUMP=$candidate; break; fi
done
[[ -n $CUOBJDUMP ]] || { echo "check_cuda: cuobjdump not found (CUDA_HOME/bin, PATH, or triton in $VENV); install the CUDA toolkit's cuobjdump" >&2; exit 1; }
TORCH_DIR=$("$VENV/bin/python" -c 'import importlib.util; print(importlib.util.find_spec("torch").submodule_search_locations[0])')
TORCH_INCLUDES=(-I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include")

# The flags torch.utils.cpp_extension gives nvcc, plus the checks'.
FLAGS=(-std=c++20 -O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -Xcompiler -fPIC -Xptxas -v)
for arch in "${ARCHS[@]}"; do FLAGS+=(-gencode "arch=compute_$arch,code=sm_$arch"); done

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
mapfile -t SOURCES < <(find ext/csrc -name '*.cu' | sort)
[[ ${#SOURCES[@]} -gt 0 ]] || { echo "check_cuda: no .cu files under ext/csrc" >&2; exit 1; }

status=0
for source in "${SOURCES[@]}"; do
  object="$OUT/$(basename "${source%.cu}").o"
  echo "== nvcc $source (sm_${ARCHS[0]}, sm_${ARCHS[1]})"
  if ! "$NVCC" -c "$source" -o "$object" "${TORCH_INCLUDES[@]}" "${FLAGS[@]}" 2> "$object.ptxas"; then
    cat "$object.ptxas" >&2
    echo "check_cuda: FAIL: nvcc could not compile $source" >&2
    exit 1
  fi
  # One line per kernel and architecture: registers and spills; fails on any spill.
  "$VENV/bin/python" - "$object.ptxas" <<'PY' || { echo "check_cuda: FAIL: register spills in $source" >&2; status=1; }
import re, sys
spilled = False
kernel = arch = ""
for line in open(sys.argv[1]):
    if m := re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line):
        kernel, arch = m.groups()
    elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
        stores, loads = map(int, m.groups())
        spilled |= stores + loads > 0
    elif (m := re.search(r"Used (\d+) registers", line)) and kernel:
        print(f"  {arch} regs {m[1]:>3}  spill stores {stores}  spill loads {loads}  {kernel}")
        kernel = ""
sys.exit(1 if spilled else 0)
PY
  for arch in "${ARCHS[@]}"; do
    "$CUOBJDUMP" -sass -arch "sm_$arch" "$object" |
      awk -v want="$FORWARD_KERNEL" -v arch="sm_$arch" '
        /Function :/ { inside = ($3 == want) }
        inside && /FFMA/ { ffma++ }
        inside && /LDS\.128/ { lds128++ }
        END { if (ffma + lds128 > 0) printf "  %s gemm_kernel<float>: %d FFMA, %d LDS.128\n", arch, ffma, lds128 }'
  done
done
echo "check_cuda: $([[ $status == 0 ]] && echo "OK, no spills" || echo FAILED) (${#SOURCES[@]} file(s), $((SECONDS - start_s)) s)"
exit $status
