// Split-K for products whose output tiles do not fill the GPU: the forward of 128x784 -> 256
// is 2 tiles of 128 x 128 for 132 SMs. Each of S splits multiplies one range of K into its own
// float32 (float64) partial product, and one more kernel adds the S partials in split order,
// then the bias, ReLU and the rounding to the output type: deterministic, no atomics.
//
// The rule (choose_split_k), for T tiles of 128 x 128 and an SM count P:
//   - no split if T >= P, or if K < 2 x 256: every split keeps at least kMinSplitDepth of K,
//     enough K tiles to run the pipeline well and to outweigh the partials' extra traffic
//     (S x M x N x 4 bytes written and read again) and the second launch;
//   - else S = min(P / T, K / 256, 16), each split's depth K / S rounded up to 32 (a K tile of
//     every kernel, and 16-byte aligned offsets for every dtype's wide loads).
#pragma once

#include "kernel_common.cuh"

namespace ext::cuda {

constexpr int64_t kMinSplitDepth = 256;
constexpr int kMaxSplits = 16;         // bounds the partials' memory and the reduction's reads
constexpr int64_t kSplitGranule = 32;

struct SplitK {
  int splits;       // 1: no split
  int64_t k_split;  // K per split (0 when not split)
};

inline SplitK choose_split_k(int64_t tiles, int64_t K, int sm_count) {
  if (tiles >= sm_count || K < 2 * kMinSplitDepth) return {1, 0};
  int64_t splits = sm_count / tiles;
  if (K / kMinSplitDepth < splits) splits = K / kMinSplitDepth;
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
