// Which GEMM kernel runs for which dtype, in one place for the ops' host code (linear_host.h)
// and the emulation's test driver: float16 and bfloat16 on the tensor cores (gemm_tc.cuh);
// float32 on them as TF32 when the caller allows it (torch.backends.cuda.matmul.allow_tf32,
// off by default, as for torch's own matmuls), else on the FMA units (gemm.cuh), as float64.
// Device::launch(kernel, grid, shared_bytes, params) is linear_host.h's launch policy.
#pragma once

#include "gemm.cuh"
#include "gemm_tc.cuh"

namespace ext::cuda {

template <typename T>
constexpr bool kIs16Bit = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <typename T>
bool on_tensor_cores(bool allow_tf32) {
  return kIs16Bit<T> || (std::is_same_v<T, float> && allow_tf32);
}

// The dynamic shared memory each GEMM kernel is launched with (.ci/check_cuda.sh prints it too).
template <typename T>
constexpr size_t kTensorCoreSharedBytes = sizeof(tc::Shared<T>);
template <typename T>
constexpr size_t kFmaSharedBytes = sizeof(GemmShared<acc_t<T>>);

// The tensor-core kernel instantiated for the operands' orientations (K-major or not, each).
template <typename Device, typename T>
void launch_tensor_core_gemm(const GemmParams<T>& params) {
  const auto launch = [&](auto kernel) {
    Device::launch(kernel, tc::gemm_grid(params), kTensorCoreSharedBytes<T>, params);
  };
  if (params.a.runs_along_k) {
    params.b.runs_along_k ? launch(tc::gemm_kernel<T, true, true>) : launch(tc::gemm_kernel<T, true, false>);
  } else {
    params.b.runs_along_k ? launch(tc::gemm_kernel<T, false, true>) : launch(tc::gemm_kernel<T, false, false>);
  }
}

template <typename Device, typename T>
void launch_gemm_kernel(const GemmParams<T>& params, bool allow_tf32) {
  if constexpr (kIs16Bit<T> || std::is_same_v<T, float>) {
    if (on_tensor_cores<T>(allow_tf32)) return launch_tensor_core_gemm<Device>(params);
  }
  if constexpr (!kIs16Bit<T>) Device::launch(gemm_kernel<T>, gemm_grid(params), kFmaSharedBytes<T>, params);
}

}  // namespace ext::cuda
