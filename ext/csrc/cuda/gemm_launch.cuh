// Which GEMM kernel runs for which dtype, in one place for the ops' host code (linear_host.h)
// and the emulation's test driver: float16 and bfloat16 on the tensor cores (gemm_tc.cuh),
// float32 and float64 on the FMA units (gemm.cuh). Device::launch(kernel, grid, shared_bytes,
// params) is linear_host.h's launch policy.
#pragma once

#include "gemm.cuh"
#include "gemm_tc.cuh"

namespace ext::cuda {

template <typename T>
constexpr bool kOnTensorCores = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// The dynamic shared memory each GEMM kernel is launched with (.ci/check_cuda.sh prints it too).
template <typename T>
constexpr size_t kGemmSharedBytes = kOnTensorCores<T> ? sizeof(tc::Shared<T>) : sizeof(GemmShared<acc_t<T>>);

template <typename Device, typename T>
void launch_gemm_kernel(const GemmParams<T>& params) {
  if constexpr (kOnTensorCores<T>) {
    Device::launch(tc::gemm_kernel<T>, tc::gemm_grid(params), kGemmSharedBytes<T>, params);
  } else {
    Device::launch(gemm_kernel<T>, gemm_grid(params), kGemmSharedBytes<T>, params);
  }
}

}  // namespace ext::cuda
