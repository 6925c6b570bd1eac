#!/usr/bin/env bash
# Static checks of the CUDA kernels, without a GPU: nvcc compiles every .cu under ext/csrc for
# sm_80 and sm_90 (object files only) with -Xptxas -v, then prints, per kernel and arch, its
# registers, dynamic shared memory (.ci/kernel_shared_bytes.cu), the blocks of 256 threads an
# SM holds by those two, and from the SASS its tensor-core (HMMA), ldmatrix (LDSM), cp.async
# (LDGSTS) and FMA (FFMA/DFMA) instruction counts.
# It fails on any register spill, on fewer than 2 blocks per SM for any kernel but float64's,
# and on a float16/bfloat16 GEMM kernel without HMMA.
#
# Usage: bash .ci/check_cuda.sh    (PYTHON: an interpreter with torch, for its headers; default $VENV/bin/python,
#                                  VENV defaulting to .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ARCHS=(80 90)
start_s=$SECONDS

NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
[[ -x $NVCC ]] || { echo "check_cuda: nvcc not found on PATH or in $CUDA_HOME/bin; set CUDA_HOME" >&2; exit 1; }
CUOBJDUMP=""
for candidate in "$(command -v cuobjdump || true)" "$CUDA_HOME/bin/cuobjdump" \
                 "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump; do
  if [[ -n $candidate && -x $candidate ]]; then CUOBJDUMP=$candidate; break; fi
done
[[ -n $CUOBJDUMP ]] || { echo "check_cuda: cuobjdump not found (CUDA_HOME/bin, PATH, or triton in $VENV); install the CUDA toolkit's cuobjdump" >&2; exit 1; }
TORCH_DIR=$("$PYTHON" -c 'import importlib.util; print(importlib.util.find_spec("torch").submodule_search_locations[0])')
TORCH_INCLUDES=(-I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include")

# The flags torch.utils.cpp_extension gives nvcc, plus the checks'.
FLAGS=(-std=c++20 -O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -Xcompiler -fPIC -Xptxas -v)
for arch in "${ARCHS[@]}"; do FLAGS+=(-gencode "arch=compute_$arch,code=sm_$arch"); done

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
mapfile -t SOURCES < <(find ext/csrc -name '*.cu' | sort)
[[ ${#SOURCES[@]} -gt 0 ]] || { echo "check_cuda: no .cu files under ext/csrc" >&2; exit 1; }

# The dynamic shared memory each kernel is launched with: host code, run here.
"$NVCC" -std=c++20 --expt-relaxed-constexpr .ci/kernel_shared_bytes.cu -o "$OUT/kernel_shared_bytes"
"$OUT/kernel_shared_bytes" > "$OUT/shared_bytes.txt"

for source in "${SOURCES[@]}"; do
  object="$OUT/$(basename "${source%.cu}").o"
  echo "== nvcc $source (sm_${ARCHS[0]}, sm_${ARCHS[1]})"
  if ! "$NVCC" -c "$source" -o "$object" "${TORCH_INCLUDES[@]}" "${FLAGS[@]}" 2> "$object.ptxas"; then
    cat "$object.ptxas" >&2
    echo "check_cuda: FAIL: nvcc could not compile $source" >&2
    exit 1
  fi
  for arch in "${ARCHS[@]}"; do "$CUOBJDUMP" -sass -arch "sm_$arch" "$object" > "$object.sm_$arch.sass"; done
done

status=0
"$PYTHON" - "$OUT" <<'PY' || status=1
import re, subprocess, sys
from pathlib import Path

out = Path(sys.argv[1])
# Per SM: the register file, the shared memory a kernel's blocks may use, and what each block
# reserves (CUDA C Programming Guide, compute capabilities 8.0 and 9.0).
SM = {"sm_80": {"regs": 65536, "shared": 164 * 1024, "reserved": 1024, "max_threads": 2048},
      "sm_90": {"regs": 65536, "shared": 228 * 1024, "reserved": 1024, "max_threads": 2048}}
THREADS = 256  # kThreads in kernel_common.cuh: every kernel's block


PRODUCTS = ["forward", "backward_input", "backward_weight"]  # conv.cuh's ConvProduct, in order


def demangle(name):
    text = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    text = text[:text.index(">(") + 1] if ">(" in text else text.split("(")[0]  # without the parameter list
    text = re.sub(r"\(ext::cuda::ConvProduct\)(\d)", lambda m: PRODUCTS[int(m[1])], text)
    return text.removeprefix("void ")


def blocks_per_sm(arch, regs, shared):
    # Registers go to warps in units of 256 (a thread's count rounded up to 8), and warps to
    # an SM in fours; shared memory per block adds the reserved 1 KiB.
    warp_regs = -(-regs * 32 // 256) * 256
    by_regs = (SM[arch]["regs"] // warp_regs) // 4 * 4 // (THREADS // 32)
    by_shared = SM[arch]["shared"] // (shared + SM[arch]["reserved"])
    return min(by_regs, by_shared, SM[arch]["max_threads"] // THREADS)


shared_bytes = dict(line.rsplit(" ", 1) for line in (out / "shared_bytes.txt").read_text().splitlines())
failures = []
print(f"  {'arch':<6} {'regs':>4} {'spill B':>7} {'shared B':>8} {'blocks/SM':>9} {'HMMA':>5} {'LDSM':>5} "
      f"{'LDGSTS':>6} {'FFMA':>5} {'DFMA':>5}  kernel")
for ptxas in sorted(out.glob("*.o.ptxas")):
    kernel = arch = ""
    rows = []
    for line in ptxas.read_text().splitlines():
        if m := re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line):
            kernel, arch = m.groups()
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spilled = int(m[1]) + int(m[2])
        elif (m := re.search(r"Used (\d+) registers", line)) and kernel:
            rows.append((arch, kernel, int(m[1]), spilled))
            kernel = ""
    for arch, mangled, regs, spilled in sorted(rows):
        name = demangle(mangled)
        # orientation and product arguments share their type's shared memory
        kernel_type = re.sub(r", (true|false|forward|backward_input|backward_weight)", "", name)
        sass = (Path(str(ptxas).removesuffix(".ptxas")).with_suffix(f".o.{arch}.sass")).read_text()
        body = sass.split(f"Function : {mangled}")[1].split("Function :")[0] if f"Function : {mangled}" in sass else ""
        counts = {op: len(re.findall(rf"\b{op}\b", body)) for op in ("HMMA", "LDSM", "LDGSTS", "FFMA", "DFMA")}
        if kernel_type not in shared_bytes:
            failures.append(f"{name}: not in .ci/kernel_shared_bytes.cu")
            continue
        shared = int(shared_bytes[kernel_type])
        blocks = blocks_per_sm(arch, regs, shared)
        print(f"  {arch:<6} {regs:>4} {spilled:>7} {shared:>8} {blocks:>9} {counts['HMMA']:>5} {counts['LDSM']:>5} "
              f"{counts['LDGSTS']:>6} {counts['FFMA']:>5} {counts['DFMA']:>5}  {name}")
        if spilled:
            failures.append(f"{name} on {arch}: {spilled} bytes of register spills")
        if blocks < 2 and not re.search(r"<double[,>]", name):
            failures.append(f"{name} on {arch}: {blocks} block(s) per SM, fewer than 2")
        if "gemm_kernel<__" in name and counts["HMMA"] == 0:
            failures.append(f"{name} on {arch}: a 16-bit GEMM without tensor-core instructions (HMMA)")
for failure in failures:
    print(f"check_cuda: FAIL: {failure}", file=sys.stderr)
sys.exit(1 if failures else 0)
PY
verdict=$([[ $status == 0 ]] && echo "OK: no spills, 2+ blocks per SM, HMMA in the 16-bit GEMMs" || echo FAILED)
echo "check_cuda: $verdict (${#SOURCES[@]} file(s), $((SECONDS - start_s)) s)"
exit $status
