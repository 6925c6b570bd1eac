// Which GEMM kernel runs for which dtype, in one place for the ops' host code (linear_host.h)
// and the emulation's test driver: float16 and bfloat16 on the tensor cores (gemm_tc.cuh);
// float32 on them as TF32 when the caller allows it (torch.backends.cuda.matmul.allow_tf32,
// off by default, as for torch's own matmuls), else on the FMA units (gemm.cuh), as float64.
// Device::launch(kernel, grid, shared_bytes, params) is linear_host.h's launch policy.
#pragma once

#include "gemm.cuh"
#include "gemm_tc.cuh"
#include "split_k.cuh"

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
void launch_tensor_core_gemm(const GemmParams<T>& params, int splits) {
  const auto launch = [&](auto kernel) {
    dim3 grid = tc::gemm_grid(params);
    grid.z = unsigned(splits);
    Device::launch(kernel, grid, kTensorCoreSharedBytes<T>, params);
  };
  if (params.a.runs_along_k) {
    params.b.runs_along_k ? launch(tc::gemm_kernel<T, true, true>) : launch(tc::gemm_kernel<T, true, false>);
  } else {
    params.b.runs_along_k ? launch(tc::gemm_kernel<T, false, true>) : launch(tc::gemm_kernel<T, false, false>);
  }
}

// The split of K (split_k.cuh) for this product on `sm_count` SMs: by the least depth of the
// kernel that will run it.
template <typename T>
SplitK choose_gemm_split(const GemmParams<T>& params, bool allow_tf32, int sm_count) {
  const int64_t M = params.a.outer_size, N = params.b.outer_size;
  const int64_t tiles = ((M + kBlockM - 1) / kBlockM) * ((N + kBlockN - 1) / kBlockN);  // both kernels' tile
  static_assert(kBlockM == tc::kBlockM && kBlockN == tc::kBlockN);
  const int64_t min_depth = on_tensor_cores<T>(allow_tf32) ? kMinSplitDepthTensorCores : kMinSplitDepthFma;
  return choose_split_k(tiles, params.K, sm_count, min_depth);
}

// C = A·B (+ bias, ReLU) on `sm_count` SMs: split-K where the tiles do not fill them
// (split_k.cuh), with partials from allocate_partials(elements), a buffer of acc_t<T> that must
// stay valid until the launched kernels have run.
template <typename Device, typename T, typename Allocate>
void launch_gemm_kernel(GemmParams<T> params, bool allow_tf32, int sm_count, Allocate allocate_partials) {
  const int64_t M = params.a.outer_size, N = params.b.outer_size;
  const SplitK split = choose_gemm_split(params, allow_tf32, sm_count);
  SplitKReduceParams<T> reduce{nullptr, split.splits, M, N, params.bias, params.relu, params.c, params.ldc};
  if (split.splits > 1) {
    params.k_split = split.k_split;
    params.partial = allocate_partials(int64_t(split.splits) * M * N);
    reduce.partial = params.partial;
  }
  bool launched = false;
  if constexpr (kIs16Bit<T> || std::is_same_v<T, float>) {
    if (on_tensor_cores<T>(allow_tf32)) {
      launch_tensor_core_gemm<Device>(params, split.splits);
      launched = true;
    }
  }
  if constexpr (!kIs16Bit<T>) {
    if (!launched) {
      dim3 grid = gemm_grid(params);
      grid.z = unsigned(split.splits);
      Device::launch(gemm_kernel<T>, grid, kFmaSharedBytes<T>, params);
    }
  }
  if (split.splits > 1) Device::launch(split_k_reduce_kernel<T>, split_k_reduce_grid(reduce), 0, reduce);
}

}  // namespace ext::cuda
