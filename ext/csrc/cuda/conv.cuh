// The CUDA convolution (groups = 1) as implicit GEMM on gemm.cuh's FMA tiling: the same
// 128 x 128 block tile, 8 x 8 register tiles, double-buffered 8-deep K tiles, multiply_tiles and
// store_run, with the im2col gather in the tile loader. No im2col tensor is ever built: each
// thread reads its 4 elements of a K tile straight from the image, zero in the padding.
// All four dtypes; 16-bit ones accumulate in float32 (acc_t) and round once at the store.
//
// Tensors are NCHW-contiguous (the host code, conv_host.h, makes them so). With P = N·OH·OW
// output pixels, Q = N·H·W input pixels and RS = R·S:
//   forward  Y  [K, P]      = W  [K, C·RS]   · col [C·RS, P]       (+ bias per row)
//   dX       dX [C, Q]      = W' [C, RS·K]   · dYcol [RS·K, Q]     (W' = W permuted to C x R x S x K)
//   dW       dW [K, C·RS]   = dY [K, P]      · colᵀ [P, C·RS]      (split-K over P, split_k.cuh)
// A is a plain strided matrix (W, W') but for dW, whose A gathers dY (K x P is not one stride:
// images are K·OH·OW apart). B always gathers. dX's gather is the transposed convolution read
// as a gather: input pixel (ih, iw) takes dY at ((ih + pad - r·dil) / stride, ...) where that
// divides exactly and lies inside dY, so every dX element is one fixed-order sum: no atomics,
// no col2im scatter, deterministic.
//
// A gathered element is the sum of two parts, one from its outer index (a pixel, or a patch
// element for dW's B) and one from its reduction index: an offset and a position (h, w) whose
// sum is tested against the image's bounds. B's outer parts are decoded once per block into
// shared memory (ConvShared::b_outer); the reduction part once per run of 4, so the K loop has
// one or two integer divisions per thread and tile.
#pragma once

#include "gemm.cuh"
#include "split_k.cuh"

namespace ext::cuda {

// The convolution's sizes. 32-bit: conv_host.h checks that every index space (pixels, patch,
// channels) fits, and that positions stay far from kOutside; offsets are computed in 64 bits.
struct ConvShape {
  int batch, in_channels, height, width;     // input N, C, H, W
  int out_channels, kernel_h, kernel_w;      // weight K, R, S
  int stride_h, stride_w, dilation_h, dilation_w;
  int pad_top, pad_left;
  int out_h, out_w;                          // OH, OW
};
constexpr int kMaxConvExtent = 1 << 24;  // heights, widths and kernel reaches: sums with kOutside stay negative

enum class ConvProduct { kForward, kBackwardInput, kBackwardWeight };

// Part of a gathered element's address: an offset in elements, and a position (h, w).
struct alignas(16) Part {
  int64_t offset;
  int h;
  int w;
};
constexpr int kOutside = -(1 << 28);  // the position of an index past an operand's edge: never inside
__device__ __forceinline__ Part outside() { return {0, kOutside, kOutside}; }

// Output pixel q = (n, oh, ow) read from the input: the top-left corner of its window.
__device__ __forceinline__ Part window_corner(const ConvShape& s, int q) {
  const int pixels = s.out_h * s.out_w;
  const int n = q / pixels, p = q - n * pixels, oh = p / s.out_w, ow = p - oh * s.out_w;
  const int h = oh * s.stride_h - s.pad_top, w = ow * s.stride_w - s.pad_left;
  return {(int64_t(n) * s.in_channels * s.height + h) * s.width + w, h, w};
}

// Patch element kk = (c, r, s): where it lies from a window's corner.
__device__ __forceinline__ Part patch_element(const ConvShape& s, int kk) {
  const int taps = s.kernel_h * s.kernel_w;
  const int c = kk / taps, tap = kk - c * taps, r = tap / s.kernel_w, t = tap - r * s.kernel_w;
  const int h = r * s.dilation_h, w = t * s.dilation_w;
  return {(int64_t(c) * s.height + h) * s.width + w, h, w};
}

// dX's B: input pixel i = (n, ih, iw), as a padded position in image n of dY.
__device__ __forceinline__ Part padded_input_pixel(const ConvShape& s, int i) {
  const int pixels = s.height * s.width;
  const int n = i / pixels, p = i - n * pixels, ih = p / s.width, iw = p - ih * s.width;
  return {int64_t(n) * s.out_channels * s.out_h * s.out_w, ih + s.pad_top, iw + s.pad_left};
}

// dX's reduction index j = (r, s, k): channel k of dY, reached from kernel tap (r, s).
__device__ __forceinline__ Part tap_and_channel(const ConvShape& s, int j) {
  const int tap = j / s.out_channels, k = j - tap * s.out_channels, r = tap / s.kernel_w, t = tap - r * s.kernel_w;
  return {int64_t(k) * s.out_h * s.out_w, r * s.dilation_h, t * s.dilation_w};
}

// forward and dW: the input under a window corner plus a patch element, zero in the padding.
template <typename T>
__device__ __forceinline__ acc_t<T> window_element(const T* input, const ConvShape& s, const Part& a, const Part& b) {
  const int h = a.h + b.h, w = a.w + b.w;
#if defined(EMU_BREAK_PADDING)
  const bool inside = h >= 0 && h <= s.height && unsigned(w) < unsigned(s.width);  // one row past the image
#else
  const bool inside = unsigned(h) < unsigned(s.height) && unsigned(w) < unsigned(s.width);
#endif
  return inside ? to_acc(input[a.offset + b.offset]) : acc_t<T>(0);
}

// dX: dY at output position ((pixel - tap) / stride) where that is exact and inside dY.
template <typename T>
__device__ __forceinline__ acc_t<T> transposed_element(const T* grad_output, const ConvShape& s, const Part& pixel,
                                                       const Part& tap) {
  int h = pixel.h - tap.h, w = pixel.w - tap.w;
  if (h < 0 || w < 0) return acc_t<T>(0);
  if (s.stride_h != 1) {
    if (h % s.stride_h != 0) return acc_t<T>(0);
    h /= s.stride_h;
  }
  if (s.stride_w != 1) {
    if (w % s.stride_w != 0) return acc_t<T>(0);
    w /= s.stride_w;
  }
  if (h >= s.out_h || w >= s.out_w) return acc_t<T>(0);
  return to_acc(grad_output[pixel.offset + tap.offset + int64_t(h) * s.out_w + w]);
}

template <typename T>
struct ConvGemmParams {
  ConvShape s;
  TileOperand<T> a;   // W (forward) or W' (dX), M x K; dW gathers its A (dY) instead
  const T* image;     // what B gathers: the input (forward, dW) or dY (dX)
  const T* grad_output;  // dW's A
  int64_t M;
  int64_t N;
  int64_t K;
  const T* bias;  // forward: one per row (output channel), or nullptr
  T* c;           // Y, dX or dW, at the offsets output_row_offset + output_column_offset give
  // dW's split-K, as GemmParams'.
  int64_t k_split = 0;
  acc_t<T>* partial = nullptr;
};

// B's outer part (once per block) and reduction part (once per run and K tile), per product.
template <ConvProduct P>
__device__ __forceinline__ Part b_outer_part(const ConvShape& s, int index) {
  if constexpr (P == ConvProduct::kForward) return window_corner(s, index);
  if constexpr (P == ConvProduct::kBackwardWeight) return patch_element(s, index);
  if constexpr (P == ConvProduct::kBackwardInput) return padded_input_pixel(s, index);
}

template <ConvProduct P>
__device__ __forceinline__ Part b_reduction_part(const ConvShape& s, int index) {
  if constexpr (P == ConvProduct::kForward) return patch_element(s, index);
  if constexpr (P == ConvProduct::kBackwardWeight) return window_corner(s, index);
  if constexpr (P == ConvProduct::kBackwardInput) return tap_and_channel(s, index);
}

template <ConvProduct P, typename T>
__device__ __forceinline__ acc_t<T> b_element(const ConvGemmParams<T>& p, const Part& outer, const Part& reduction) {
  if constexpr (P == ConvProduct::kBackwardInput) return transposed_element(p.image, p.s, outer, reduction);
  if constexpr (P == ConvProduct::kForward) return window_element(p.image, p.s, outer, reduction);
  if constexpr (P == ConvProduct::kBackwardWeight) return window_element(p.image, p.s, reduction, outer);
}

// Where C's element (row, col) goes, as the sum of a row and a column part: Y[n][k][p] (forward:
// row k, column (n, p)), dX[n][c][p] (row c), dW[k][kk] (row k, column kk).
template <ConvProduct P>
__device__ __forceinline__ int64_t output_row_offset(const ConvShape& s, int64_t N, int row) {
  if constexpr (P == ConvProduct::kForward) return int64_t(row) * s.out_h * s.out_w;
  if constexpr (P == ConvProduct::kBackwardInput) return int64_t(row) * s.height * s.width;
  if constexpr (P == ConvProduct::kBackwardWeight) return int64_t(row) * N;
}

template <ConvProduct P>
__device__ __forceinline__ int64_t output_column_offset(const ConvShape& s, int col) {
  if constexpr (P == ConvProduct::kBackwardWeight) return col;
  const int plane = P == ConvProduct::kForward ? s.out_h * s.out_w : s.height * s.width;
  const int rows = P == ConvProduct::kForward ? s.out_channels : s.in_channels;
  const int n = col / plane;
  return int64_t(n) * rows * plane + (col - n * plane);
}

// This thread's run of B in the K tile from k0: 4 consecutive outer indices (columns of the
// block's tile, their parts in `table`) at one reduction index.
template <ConvProduct P, typename T>
__device__ __forceinline__ void fetch_b_run(const ConvGemmParams<T>& p, const Part* table, int64_t k0, int64_t k_end,
                                            acc_t<T> (&run)[kRun]) {
  const RunOrigin origin = run_origin(/*runs_along_k=*/false);
  const int64_t j = k0 + origin.k;
  const Part reduction = j < k_end ? b_reduction_part<P>(p.s, int(j)) : outside();
#pragma unroll
  for (int i = 0; i < kRun; ++i) run[i] = b_element<P>(p, table[origin.outer + i], reduction);
}

// dW's A: this thread's run of dY (channel m0 + outer, pixels k0 + k ..), along the pixels,
// which lie consecutively within an image.
template <typename T>
__device__ __forceinline__ void fetch_grad_output_run(const ConvGemmParams<T>& p, int64_t m0, int64_t k0,
                                                      int64_t k_end, acc_t<T> (&run)[kRun]) {
  const RunOrigin origin = run_origin(/*runs_along_k=*/true);
  const int64_t channel = m0 + origin.outer;
  const int pixels = p.s.out_h * p.s.out_w;
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const int64_t q = k0 + origin.k + i;
    if (channel >= p.M || q >= k_end) {
      run[i] = acc_t<T>(0);
      continue;
    }
    const int n = int(q) / pixels;
    run[i] = to_acc(p.grad_output[(int64_t(n) * p.s.out_channels + channel) * pixels + (int(q) - n * pixels)]);
  }
}

template <typename Acc>
struct ConvShared {
  GemmShared<Acc> tiles;
  Part b_outer[kBlockN];  // the outer parts of the block's kBlockN columns of B
};

template <typename T>
constexpr size_t kConvSharedBytes = sizeof(ConvShared<acc_t<T>>);

#if defined(EMU_BREAK_TABLE_BARRIER)
#define EXT_TABLE_BARRIER()  // missing: threads read parts of B's table before other threads wrote them
#else
#define EXT_TABLE_BARRIER() __syncthreads()
#endif

// Blocks along x walk C's columns (pixels, the large side: up to 2^31 - 1 blocks), along y its
// rows (channels), along z dW's splits.
template <typename T>
inline dim3 conv_grid(const ConvGemmParams<T>& p, int splits) {
  return dim3(unsigned((p.N + kBlockN - 1) / kBlockN), unsigned((p.M + kBlockM - 1) / kBlockM), unsigned(splits));
}

template <typename T, ConvProduct P>
__global__ void __launch_bounds__(kThreads, kGemmMinBlocksPerSm<T>) conv_kernel(const ConvGemmParams<T> p) {
  using Acc = acc_t<T>;
  constexpr bool kGatheredA = P == ConvProduct::kBackwardWeight;
  EXT_SHARED_MEMORY(shared);
  ConvShared<Acc>& memory = shared_as<ConvShared<Acc>>(shared);
  SharedTile<Acc>* a_tiles = memory.tiles.a;
  SharedTile<Acc>* b_tiles = memory.tiles.b;

  const int64_t m0 = int64_t(blockIdx.y) * kBlockM;
  const int64_t n0 = int64_t(blockIdx.x) * kBlockN;
  const int row0 = (int(threadIdx.x) / kThreadsN) * kRun;
  const int col0 = (int(threadIdx.x) % kThreadsN) * kRun;

  if (int(threadIdx.x) < kBlockN) {
    const int64_t column = n0 + threadIdx.x;
    memory.b_outer[threadIdx.x] = column < p.N ? b_outer_part<P>(p.s, int(column)) : outside();
  }
  EXT_TABLE_BARRIER();  // the table is complete before any thread reads it

  const int64_t k_begin = p.k_split == 0 ? 0 : int64_t(blockIdx.z) * p.k_split;
  const int64_t k_end = p.k_split == 0 || p.K - k_begin < p.k_split ? p.K : k_begin + p.k_split;
  const bool a_runs_along_k = kGatheredA || p.a.runs_along_k;
  RunCursor a_cursor{};
  Acc a_run[kRun];
  Acc b_run[kRun];
  if constexpr (kGatheredA) {
    fetch_grad_output_run(p, m0, k_begin, k_end, a_run);
  } else {
    a_cursor = start_cursor(p.a, m0);
    a_cursor.offset += k_begin * p.a.k_stride;
    fetch_run(p.a, a_cursor, k_end - k_begin, a_run);
  }
  fetch_b_run<P>(p, memory.b_outer, k_begin, k_end, b_run);
  store_run(a_runs_along_k, a_run, a_tiles[0]);
  store_run(false, b_run, b_tiles[0]);
  __syncthreads();

  Acc acc[kThreadM][kThreadN] = {};
  const int64_t k_tiles = (k_end - k_begin + kBlockK - 1) / kBlockK;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int current = int(kt & 1);
    const bool has_next = kt + 1 < k_tiles;
    if (has_next) {  // the next tile's loads are issued now and land while the FMAs below run
      const int64_t k0 = k_begin + (kt + 1) * kBlockK;
      if constexpr (kGatheredA) {
        fetch_grad_output_run(p, m0, k0, k_end, a_run);
      } else {
        a_cursor.offset += kBlockK * p.a.k_stride;
        fetch_run(p.a, a_cursor, k_end - k0, a_run);
      }
      fetch_b_run<P>(p, memory.b_outer, k0, k_end, b_run);
    }
    multiply_tiles(a_tiles[current], b_tiles[current], row0, col0, acc);
    if (has_next) {
      store_run(a_runs_along_k, a_run, a_tiles[current ^ 1]);
      store_run(false, b_run, b_tiles[current ^ 1]);
    }
    EXT_TILE_BARRIER();  // as in gemm_kernel: one barrier per K tile
  }

  // Epilogue: one column at a time (its output offset takes a division), bias per row.
  const int rows_left = p.M - m0 < kBlockM ? int(p.M - m0) : kBlockM;
  const int cols_left = p.N - n0 < kBlockN ? int(p.N - n0) : kBlockN;
  const bool split = p.partial != nullptr;
  Acc bias[kThreadM];
#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int row = (i / kRun) * kHalfTile + row0 + i % kRun;
    bias[i] = p.bias != nullptr && row < rows_left ? to_acc(p.bias[m0 + row]) : Acc(0);
  }
#pragma unroll
  for (int j = 0; j < kThreadN; ++j) {
    const int col = (j / kRun) * kHalfTile + col0 + j % kRun;
    if (col >= cols_left) continue;
    const int64_t column_offset = output_column_offset<P>(p.s, int(n0 + col));
#pragma unroll
    for (int i = 0; i < kThreadM; ++i) {
      const int row = (i / kRun) * kHalfTile + row0 + i % kRun;
      if (row >= rows_left) continue;
      if (split) {  // dW: this split's sums as they are, into its partial product (M x N, dense)
        p.partial[(int64_t(blockIdx.z) * p.M + m0 + row) * p.N + n0 + col] = acc[i][j];
        continue;
      }
      p.c[column_offset + output_row_offset<P>(p.s, p.N, int(m0 + row))] = from_acc<T>(acc[i][j] + bias[i]);
    }
  }
}

// db[k] = dY summed over N, OH, OW: one block per channel, each thread a strided share of every
// image's plane, then a fixed-order tree in shared memory: deterministic, no atomics.
template <typename T>
struct SumChannelsParams {
  const T* grad_output;  // N x K x pixels, contiguous
  int64_t batch;
  int64_t channels;
  int64_t pixels;
  T* out;  // K elements
};

template <typename Acc>
struct SumChannelsShared {
  Acc sums[kThreads];
};

template <typename T>
constexpr size_t kSumChannelsSharedBytes = sizeof(SumChannelsShared<acc_t<T>>);

template <typename T>
__global__ void __launch_bounds__(kThreads) sum_channels_kernel(const SumChannelsParams<T> p) {
  using Acc = acc_t<T>;
  EXT_SHARED_MEMORY(shared);
  Acc* sums = shared_as<SumChannelsShared<Acc>>(shared).sums;
  const int64_t channel = blockIdx.x;
  Acc sum = 0;
  for (int64_t n = 0; n < p.batch; ++n) {
    const T* plane = p.grad_output + (n * p.channels + channel) * p.pixels;
    for (int64_t i = threadIdx.x; i < p.pixels; i += kThreads) sum += to_acc(plane[i]);
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.out[channel] = from_acc<T>(sums[0]);
}

// The launches, in one place for the ops' host code (conv_host.h) and the emulation's driver.
// Device::launch(kernel, grid, shared_bytes, params) as in gemm_launch.cuh. Every output here
// has at least one element (the host code returns before launching otherwise).

template <typename Device, typename T>
void launch_conv_forward(const ConvShape& s, const T* input, const T* weight, const T* bias, T* output) {
  const int64_t patch = int64_t(s.in_channels) * s.kernel_h * s.kernel_w;
  ConvGemmParams<T> p{s, make_tile_operand(weight, s.out_channels, patch, int64_t(1)), input, nullptr,
                      s.out_channels, int64_t(s.batch) * s.out_h * s.out_w, patch, bias, output};
  Device::launch(conv_kernel<T, ConvProduct::kForward>, conv_grid(p, 1), kConvSharedBytes<T>, p);
}

// permuted_weight: W as C x R x S x K, contiguous (the host code permutes it).
template <typename Device, typename T>
void launch_conv_backward_input(const ConvShape& s, const T* grad_output, const T* permuted_weight, T* grad_input) {
  const int64_t depth = int64_t(s.kernel_h) * s.kernel_w * s.out_channels;
  ConvGemmParams<T> p{s, make_tile_operand(permuted_weight, s.in_channels, depth, int64_t(1)), grad_output,
                      nullptr, s.in_channels, int64_t(s.batch) * s.height * s.width, depth, nullptr, grad_input};
  Device::launch(conv_kernel<T, ConvProduct::kBackwardInput>, conv_grid(p, 1), kConvSharedBytes<T>, p);
}

// dW's output is small and its reduction long (K x C·R·S over every pixel of the batch): split-K
// by gemm_launch.cuh's rule, partials from allocate_partials(elements) as there.
template <typename Device, typename T, typename Allocate>
void launch_conv_backward_weight(const ConvShape& s, const T* grad_output, const T* input, T* grad_weight,
                                 int sm_count, Allocate allocate_partials) {
  const int64_t patch = int64_t(s.in_channels) * s.kernel_h * s.kernel_w;
  ConvGemmParams<T> p{s, {}, input, grad_output, s.out_channels, patch, int64_t(s.batch) * s.out_h * s.out_w,
                      nullptr, grad_weight};
  const int64_t tiles = ((p.M + kBlockM - 1) / kBlockM) * ((p.N + kBlockN - 1) / kBlockN);
  const SplitK split = choose_split_k(tiles, p.K, sm_count, kMinSplitDepthFma);  // conv runs on the FMA units
  if (split.splits > 1) {
    p.k_split = split.k_split;
    p.partial = allocate_partials(int64_t(split.splits) * p.M * p.N);
  }
  Device::launch(conv_kernel<T, ConvProduct::kBackwardWeight>, conv_grid(p, split.splits), kConvSharedBytes<T>, p);
  if (split.splits > 1) {
    const SplitKReduceParams<T> reduce{p.partial, split.splits, p.M, p.N, nullptr, false, grad_weight, p.N};
    Device::launch(split_k_reduce_kernel<T>, split_k_reduce_grid(reduce), 0, reduce);
  }
}

template <typename Device, typename T>
void launch_conv_backward_bias(const ConvShape& s, const T* grad_output, T* grad_bias) {
  const SumChannelsParams<T> p{grad_output, s.batch, s.out_channels, int64_t(s.out_h) * s.out_w, grad_bias};
  Device::launch(sum_channels_kernel<T>, dim3(unsigned(s.out_channels)), kSumChannelsSharedBytes<T>, p);
}

}  // namespace ext::cuda
