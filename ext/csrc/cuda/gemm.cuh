// The CUDA GEMM on the FMA units, for float32 (unless TF32 is allowed) and float64, and what
// both GEMM kernels share (GemmParams, the operand views, split-K's K range): C (M x N) =
// A (M x K) · B (K x N) + bias, optional ReLU, for any sizes, strides and alignment. A
// register-blocked shared-memory kernel: each 256-thread block computes a 128 x 128 tile of C,
// each thread an 8 x 8 register tile, stepping through K 8 at a time with the next K tile loaded
// while the current one is used. float16, bfloat16 and TF32 go to gemm_tc.cuh (gemm_launch.cuh).
#pragma once

#include "kernel_common.cuh"

namespace ext::cuda {

constexpr int kBlockM = 128;  // a block's tile of C is 128 x 128: each loaded element feeds 128 FMAs,
constexpr int kBlockN = 128;  // enough reuse to keep the FMA units ahead of global memory
constexpr int kBlockK = 8;    // 2 buffers x (A + B) x 8 x 132 floats = 17 KB of shared memory
constexpr int kThreadM = 8;   // a thread's 8 x 8 tile of C: 64 FMAs for every 16 shared loads
constexpr int kThreadN = 8;
constexpr int kThreadsN = kBlockN / kThreadN;  // 16 threads across a block's columns
constexpr int kHalfTile = 64;  // a thread's 8 rows (cols) are two runs of 4, 64 apart: a warp's
                               // 128-bit shared loads then cover consecutive addresses, free of bank conflicts
constexpr int kSmemPad = 4;    // per row of a shared tile: the two half-warps storing along K land in
                               // different banks; 4 keeps every row 16-byte aligned

static_assert((kBlockM / kThreadM) * (kBlockN / kThreadN) == kThreads, "one thread per 8 x 8 tile of C");
static_assert(kBlockM * kBlockK == kThreads * kRun && kBlockN == kBlockM,
              "each thread loads exactly one run of each operand's tile, so one loader serves A and B");
static_assert(kThreadM == 2 * kRun && kBlockM == 2 * kHalfTile, "a thread's rows are two runs, a half tile apart");

// Fault injection, for the emulation tests only (tests/cuda_emu): each switch breaks one rule so
// a test can show the harness catches it. A real build defines none of them.
#if defined(EMU_BREAK_SYNC)
#define EXT_TILE_BARRIER()  // missing: the next tile overwrites shared memory other threads still read
#elif defined(EMU_BREAK_BARRIER)
#define EXT_TILE_BARRIER() \
  if (threadIdx.x != 0) __syncthreads()  // a barrier one thread never reaches
#else
#define EXT_TILE_BARRIER() __syncthreads()
#endif
#if defined(EMU_BREAK_BOUNDS)
constexpr int kKBoundSlack = 1;  // off by one: the last K tile reads one element past each row
#else
constexpr int kKBoundSlack = 0;
#endif

// One operand as an (outer x K) matrix: A itself (outer = M) or Bᵀ (outer = N).
// Element (o, k) is ptr[o * outer_stride + k * k_stride].
template <typename T>
struct TileOperand {
  const T* ptr;
  int64_t outer_size;
  int64_t outer_stride;
  int64_t k_stride;
  bool runs_along_k;  // a thread's kRun elements are consecutive in K (else in the outer dimension)
  bool wide_loads;    // those runs are contiguous and aligned in memory: one wide load each
  bool chunk_loads;   // runs of 16 bytes are too: the tensor-core kernel's cp.async copies (gemm_tc.cuh)
};

// Chooses, on the host, how a block's threads read this operand: along whichever
// dimension is contiguous, with wide loads when every run is aligned.
template <typename T>
inline TileOperand<T> make_tile_operand(const T* ptr, int64_t outer_size, int64_t outer_stride,
                                        int64_t k_stride) {
  const bool runs_along_k = k_stride == 1 && outer_stride != 1;
  const int64_t run_stride = runs_along_k ? k_stride : outer_stride;
  const int64_t between_runs_stride = runs_along_k ? outer_stride : k_stride;
#if defined(EMU_BREAK_ALIGNMENT)
  // the pointer's alignment left unchecked
  const auto aligned_runs = [&](int64_t) { return run_stride == 1 && between_runs_stride != 0; };
#else
  const auto aligned_runs = [&](int64_t align_bytes) {
    return run_stride == 1 && reinterpret_cast<uintptr_t>(ptr) % align_bytes == 0 &&
           (between_runs_stride * int64_t(sizeof(T))) % align_bytes == 0;
  };
#endif
  return {ptr, outer_size, outer_stride, k_stride, runs_along_k, aligned_runs(alignof(Run<T>)),
          aligned_runs(kMaxAccessBytes)};
}

template <typename T>
struct GemmParams {
  TileOperand<T> a;  // M x K
  TileOperand<T> b;  // Bᵀ: N x K
  int64_t K;
  const T* bias;  // N elements, or nullptr
  bool relu;
  T* c;  // M x N, row-major
  int64_t ldc;
  // Split-K (split_k.cuh): blockIdx.z covers K from z k_split on, at most k_split of it, and its
  // sums go, without bias or ReLU, to partial[z] (M x N, dense) for split_k_reduce_kernel.
  int64_t k_split = 0;          // 0: no split, the whole K and the epilogue above
  acc_t<T>* partial = nullptr;
};

// This block's share of K: [k_begin, k_begin + depth).
struct KRange {
  int64_t k_begin;
  int64_t depth;
};

template <typename T>
__device__ __forceinline__ KRange block_k_range(const GemmParams<T>& p) {
  if (p.k_split == 0) return {0, p.K};
  const int64_t k_begin = int64_t(blockIdx.z) * p.k_split;
  return {k_begin, (p.K - k_begin < p.k_split ? p.K - k_begin : p.k_split)};
}

// Y (M x N) = X (M x K) · Wᵀ + bias, where W is N x K.
template <typename T>
inline GemmParams<T> linear_params(const StridedMatrix<T>& x, const StridedMatrix<T>& w, const T* bias,
                                   bool relu, T* y) {
  return {make_tile_operand(x.ptr, x.rows, x.row_stride, x.col_stride),
          make_tile_operand(w.ptr, w.rows, w.row_stride, w.col_stride), x.cols, bias, relu, y, w.rows};
}

// dX (M x K) = dY (M x N) · W (N x K): Bᵀ = Wᵀ, read through W's strides.
template <typename T>
inline GemmParams<T> backward_input_params(const StridedMatrix<T>& dy, const StridedMatrix<T>& w, T* dx) {
  return {make_tile_operand(dy.ptr, dy.rows, dy.row_stride, dy.col_stride),
          make_tile_operand(w.ptr, w.cols, w.col_stride, w.row_stride), dy.cols, nullptr, false, dx,
          w.cols};
}

// dW (N x K) = dYᵀ (N x M) · X (M x K): A = dYᵀ and Bᵀ = Xᵀ, both read through strides, no copy.
template <typename T>
inline GemmParams<T> backward_weight_params(const StridedMatrix<T>& dy, const StridedMatrix<T>& x, T* dw) {
  return {make_tile_operand(dy.ptr, dy.cols, dy.col_stride, dy.row_stride),
          make_tile_operand(x.ptr, x.cols, x.col_stride, x.row_stride), dy.rows, nullptr, false, dw,
          x.cols};
}

// Blocks along x walk M (up to 2^31 - 1 of them), along y walk N (up to 65535, N <= 8,388,480).
template <typename T>
inline dim3 gemm_grid(const GemmParams<T>& p) {
  return dim3(unsigned((p.a.outer_size + kBlockM - 1) / kBlockM), unsigned((p.b.outer_size + kBlockN - 1) / kBlockN));
}
constexpr int64_t kMaxGemmN = int64_t(65535) * kBlockN;

// Where this thread's run starts inside a kBlockM x kBlockK tile.
struct RunOrigin {
  int outer;
  int k;
};

__device__ __forceinline__ RunOrigin run_origin(bool runs_along_k) {
  constexpr int runs_per_k_row = kBlockK / kRun;     // 2 threads share one row of 8 K values
  constexpr int runs_per_outer_row = kBlockM / kRun;  // 32 threads (a warp) share one K slice
  const int t = int(threadIdx.x);
  return runs_along_k ? RunOrigin{t / runs_per_k_row, (t % runs_per_k_row) * kRun}
                      : RunOrigin{(t % runs_per_outer_row) * kRun, t / runs_per_outer_row};
}

// This thread's place in one operand, set up once: the offset of its run in the current K
// tile (moved on by kBlockK columns per tile) and how many of the run's outer indices exist
// (0 past the edge, kRun inside). Kept small: every register here is one the 8 x 8
// accumulators cannot use.
struct RunCursor {
  int64_t offset;
  int outer_valid;
  int k_origin;  // the run's k within the K tile
};

template <typename T>
__device__ __forceinline__ RunCursor start_cursor(const TileOperand<T>& op, int64_t outer0) {
  const RunOrigin origin = run_origin(op.runs_along_k);
  const int64_t o = outer0 + origin.outer;
  const int64_t outer_left = op.outer_size - o;
  const int outer_valid = outer_left <= 0 ? 0 : outer_left >= kRun ? kRun : int(outer_left);
  return {o * op.outer_stride + origin.k * op.k_stride, outer_valid, origin.k};
}

// Reads this thread's run of the current K tile into registers, zeros past the edges;
// k_left is K minus the tile's first k.
template <typename T>
__device__ __forceinline__ void fetch_run(const TileOperand<T>& op, const RunCursor& cursor, int64_t k_left,
                                          acc_t<T> (&run)[kRun]) {
  const int o_step = op.runs_along_k ? 0 : 1;
  const int k_step = op.runs_along_k ? 1 : 0;
  const bool whole_run = (kRun - 1) * o_step < cursor.outer_valid && cursor.k_origin + (kRun - 1) * k_step < k_left;
  if (op.wide_loads && whole_run) {
    const Run<T> loaded = *reinterpret_cast<const Run<T>*>(op.ptr + cursor.offset);
#pragma unroll
    for (int i = 0; i < kRun; ++i) run[i] = to_acc(loaded.v[i]);
    return;
  }
  const int64_t step = op.runs_along_k ? op.k_stride : op.outer_stride;
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const bool inside = i * o_step < cursor.outer_valid && cursor.k_origin + i * k_step < k_left + kKBoundSlack;
    run[i] = inside ? to_acc(op.ptr[cursor.offset + i * step]) : acc_t<T>(0);
  }
}

// A K slice of a tile: shared[k][outer], so a thread's 4 rows (cols) at one k are one 128-bit load.
template <typename Acc>
struct alignas(16) SharedTile {
  Acc at[kBlockK][kBlockM + kSmemPad];
};

template <typename Acc>
__device__ __forceinline__ void store_run(bool runs_along_k, const Acc (&run)[kRun], SharedTile<Acc>& tile) {
  const RunOrigin origin = run_origin(runs_along_k);
  if (runs_along_k) {
#pragma unroll
    for (int i = 0; i < kRun; ++i) tile.at[origin.k + i][origin.outer] = run[i];
  } else {
    Run<Acc> packed;
#pragma unroll
    for (int i = 0; i < kRun; ++i) packed.v[i] = run[i];
    *reinterpret_cast<Run<Acc>*>(&tile.at[origin.k][origin.outer]) = packed;
  }
}

// This thread's 8 values of one K slice: two 4-runs, a half tile apart.
template <typename Acc>
__device__ __forceinline__ void load_fragment(const Acc* slice, int first, Acc (&fragment)[2 * kRun]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const Run<Acc> run = *reinterpret_cast<const Run<Acc>*>(slice + half * kHalfTile + first);
#pragma unroll
    for (int i = 0; i < kRun; ++i) fragment[half * kRun + i] = run.v[i];
  }
}

template <typename Acc>
__device__ __forceinline__ void multiply_tiles(const SharedTile<Acc>& a, const SharedTile<Acc>& b, int row0,
                                               int col0, Acc (&acc)[kThreadM][kThreadN]) {
#pragma unroll
  for (int k = 0; k < kBlockK; ++k) {
    Acc a_fragment[kThreadM];
    Acc b_fragment[kThreadN];
    load_fragment(a.at[k], row0, a_fragment);
    load_fragment(b.at[k], col0, b_fragment);
#pragma unroll
    for (int i = 0; i < kThreadM; ++i) {
#pragma unroll
      for (int j = 0; j < kThreadN; ++j) acc[i][j] += a_fragment[i] * b_fragment[j];
    }
  }
}

// The kernel's shared memory: double-buffered, one tile is read while the next is written.
template <typename Acc>
struct GemmShared {
  SharedTile<Acc> a[2];
  SharedTile<Acc> b[2];
};

// Two blocks per SM need at most 128 registers a thread (65536 / 512). float64's 8 x 8
// accumulators alone take 128, so float64 runs one block per SM.
template <typename T>
constexpr int kGemmMinBlocksPerSm = std::is_same_v<T, double> ? 1 : 2;

template <typename T>
__global__ void __launch_bounds__(kThreads, kGemmMinBlocksPerSm<T>) gemm_kernel(const GemmParams<T> p) {
  using Acc = acc_t<T>;
  EXT_SHARED_MEMORY(shared);
  GemmShared<Acc>& tiles = shared_as<GemmShared<Acc>>(shared);
  SharedTile<Acc>* a_tiles = tiles.a;
  SharedTile<Acc>* b_tiles = tiles.b;

  const int64_t m0 = int64_t(blockIdx.x) * kBlockM;
  const int64_t n0 = int64_t(blockIdx.y) * kBlockN;
  const int row0 = (int(threadIdx.x) / kThreadsN) * kRun;  // this thread's first row (and col) in the tile
  const int col0 = (int(threadIdx.x) % kThreadsN) * kRun;

  const KRange k_range = block_k_range(p);
  RunCursor a_cursor = start_cursor(p.a, m0);
  RunCursor b_cursor = start_cursor(p.b, n0);
  a_cursor.offset += k_range.k_begin * p.a.k_stride;
  b_cursor.offset += k_range.k_begin * p.b.k_stride;
  Acc a_run[kRun];
  Acc b_run[kRun];
  fetch_run(p.a, a_cursor, k_range.depth, a_run);
  fetch_run(p.b, b_cursor, k_range.depth, b_run);
  store_run(p.a.runs_along_k, a_run, a_tiles[0]);
  store_run(p.b.runs_along_k, b_run, b_tiles[0]);
  __syncthreads();

  Acc acc[kThreadM][kThreadN] = {};
  const int64_t k_tiles = (k_range.depth + kBlockK - 1) / kBlockK;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int current = int(kt & 1);
    const bool has_next = kt + 1 < k_tiles;
    if (has_next) {  // issue the next tile's global loads now; they land while the FMAs below run
      const int64_t k_left = k_range.depth - (kt + 1) * kBlockK;
      a_cursor.offset += kBlockK * p.a.k_stride;
      b_cursor.offset += kBlockK * p.b.k_stride;
      fetch_run(p.a, a_cursor, k_left, a_run);
      fetch_run(p.b, b_cursor, k_left, b_run);
    }
    multiply_tiles(a_tiles[current], b_tiles[current], row0, col0, acc);
    if (has_next) {
      store_run(p.a.runs_along_k, a_run, a_tiles[current ^ 1]);
      store_run(p.b.runs_along_k, b_run, b_tiles[current ^ 1]);
    }
    // One barrier per K tile: it orders this tile's reads before the next overwrite of the
    // same buffer, and the stores above before the next tile's reads.
    EXT_TILE_BARRIER();
  }

  // Epilogue: bias and ReLU fused into the one store of C. Tile-relative 32-bit indices and
  // one row at a time keep the 64 accumulators' neighbours few (no spills).
  const int rows_left = p.a.outer_size - m0 < kBlockM ? int(p.a.outer_size - m0) : kBlockM;
  const int cols_left = p.b.outer_size - n0 < kBlockN ? int(p.b.outer_size - n0) : kBlockN;
  const bool split = p.partial != nullptr;  // split-K: this split's sums as they are, into its partial product
  Acc bias[kThreadN];
#pragma unroll
  for (int j = 0; j < kThreadN; ++j) {
    const int col = (j / kRun) * kHalfTile + col0 + j % kRun;
    bias[j] = !split && p.bias != nullptr && col < cols_left ? to_acc(p.bias[n0 + col]) : Acc(0);
  }
#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int row = (i / kRun) * kHalfTile + row0 + i % kRun;
    if (row >= rows_left) continue;
    const int64_t c_row = m0 + row;
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) {
      const int col = (j / kRun) * kHalfTile + col0 + j % kRun;
      if (col >= cols_left) continue;
      if (split) {
        p.partial[(int64_t(blockIdx.z) * p.a.outer_size + c_row) * p.b.outer_size + n0 + col] = acc[i][j];
        continue;
      }
      Acc value = acc[i][j] + bias[j];
      if (p.relu && value < Acc(0)) value = Acc(0);  // NaN passes through, as in torch.relu
      p.c[c_row * p.ldc + n0 + col] = from_acc<T>(value);
    }
  }
}

}  // namespace ext::cuda
