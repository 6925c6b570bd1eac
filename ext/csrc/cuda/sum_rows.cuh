// db = the sum of dY over its rows, deterministically: every output is summed in
// one fixed order by one thread, with no atomics, so results repeat bit for bit.
#pragma once

#include "kernel_common.cuh"

namespace ext::cuda {

constexpr int kSumCols = 32;                      // a warp reads 32 consecutive columns of a row: coalesced
constexpr int kSumRowLanes = kThreads / kSumCols;  // 8 lanes of rows per column, each summing every 8th row

template <typename T>
struct SumRowsParams {
  StridedMatrix<T> a;  // M x N
  T* out;              // N elements
};

template <typename T>
inline dim3 sum_rows_grid(const SumRowsParams<T>& p) {
  return dim3(unsigned((p.a.cols + kSumCols - 1) / kSumCols));
}

template <typename Acc>
struct SumRowsShared {
  Acc lane_sums[kSumRowLanes][kSumCols];
};

template <typename T>
constexpr size_t kSumRowsSharedBytes = sizeof(SumRowsShared<acc_t<T>>);  // the launch's dynamic shared memory

template <typename T>
__global__ void __launch_bounds__(kThreads) sum_rows_kernel(const SumRowsParams<T> p) {
  using Acc = acc_t<T>;
  EXT_SHARED_MEMORY(shared);
  auto& lane_sums = shared_as<SumRowsShared<Acc>>(shared).lane_sums;

  const int col_in_block = int(threadIdx.x) % kSumCols;
  const int lane = int(threadIdx.x) / kSumCols;
  const int64_t col = int64_t(blockIdx.x) * kSumCols + col_in_block;
  Acc sum = 0;
  if (col < p.a.cols) {
    for (int64_t row = lane; row < p.a.rows; row += kSumRowLanes) {
      sum += to_acc(p.a.ptr[row * p.a.row_stride + col * p.a.col_stride]);
    }
  }
  lane_sums[lane][col_in_block] = sum;
  __syncthreads();
  if (lane == 0 && col < p.a.cols) {
    Acc total = 0;
#pragma unroll
    for (int l = 0; l < kSumRowLanes; ++l) total += lane_sums[l][col_in_block];
    p.out[col] = from_acc<T>(total);
  }
}

}  // namespace ext::cuda
