// Split-K for products whose output tiles do not fill the GPU: the forward of 128x784 -> 256
// is 2 tiles of 128 x 128 for 132 SMs. Each of S splits multiplies one range of K into its own
// float32 (float64) partial product, and one more kernel adds the S partials in split order,
// then the bias, ReLU and the rounding to the output type: deterministic, no atomics.
//
// The rule (choose_split_k), for T tiles of 128 x 128, an SM count P and a least depth D:
//   - no split if T >= P, or if K < 2 x D: every split keeps at least D of K, enough to
//     outweigh the partials' extra traffic (S x M x N x 4 bytes written and read again) and
//     the second launch;
//   - else S = min(P / T, K / D, 16), each split's depth K / S rounded up to 32 (a K tile of
//     every kernel, and 16-byte aligned offsets for every dtype's wide loads).
// D is the kernel's: 64 for the FMA kernels (gemm.cuh, conv.cuh), 256 for the tensor cores'.
#pragma once

#include "kernel_common.cuh"

namespace ext::cuda {

// A 128 x 128 x 64 FMA block is 2.1 MFLOP, about 4 us on one H100 SM (0.51 TFLOP/s): as long
// as a launch. On an H100, 64 took float32 forwards of 128x784->256 from 0.042 ms (3 splits of
// 288) to 0.022-0.025 (9 of 96) and 128x2048->1000 from 0.043 to 0.033; no timed shape got
// slower (bench/README.md, "On a GPU"). A tensor-core block runs the same K several times
// faster, so its least depth stays at 256, the one timed: smaller ones were not.
constexpr int64_t kMinSplitDepthFma = 64;
constexpr int64_t kMinSplitDepthTensorCores = 256;
constexpr int kMaxSplits = 16;         // bounds the partials' memory and the reduction's reads
constexpr int64_t kSplitGranule = 32;

struct SplitK {
  int splits;       // 1: no split
  int64_t k_split;  // K per split (0 when not split)
};

inline SplitK choose_split_k(int64_t tiles, int64_t K, int sm_count, int64_t min_depth) {
  if (tiles >= sm_count || K < 2 * min_depth) return {1, 0};
  int64_t splits = sm_count / tiles;
  if (K / min_depth < splits) splits = K / min_depth;
  if (kMaxSplits < splits) splits = kMaxSplits;
  if (splits < 2) return {1, 0};
  const int64_t depth = ((K + splits - 1) / splits + kSplitGranule - 1) / kSplitGranule * kSplitGranule;
  return {int((K + depth - 1) / depth), depth};
}

template <typename T>
struct SplitKReduceParams {
  const acc_t<T>* partial;  // splits x M x N, dense
  int splits;
  int64_t M;
  int64_t N;
  const T* bias;  // N elements, or nullptr
  bool relu;
  T* c;  // M x N, row-major
  int64_t ldc;
};

template <typename T>
inline dim3 split_k_reduce_grid(const SplitKReduceParams<T>& p) {
  return dim3(unsigned((p.M * p.N + kThreads - 1) / kThreads));
}

// One thread per output element: consecutive threads, consecutive columns, coalesced.
template <typename T>
__global__ void __launch_bounds__(kThreads) split_k_reduce_kernel(const SplitKReduceParams<T> p) {
  using Acc = acc_t<T>;
  const int64_t index = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= p.M * p.N) return;
  const int64_t row = index / p.N;
  const int64_t col = index % p.N;
  Acc sum = 0;
  for (int s = 0; s < p.splits; ++s) sum += p.partial[s * p.M * p.N + index];
  if (p.bias != nullptr) sum += to_acc(p.bias[col]);
  if (p.relu && sum < Acc(0)) sum = Acc(0);  // NaN passes through, as in torch.relu
  p.c[row * p.ldc + col] = from_acc<T>(sum);
}

}  // namespace ext::cuda
