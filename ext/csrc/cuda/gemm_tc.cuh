// The tensor-core GEMM for float16 and bfloat16: gemm_kernel's contract (gemm.cuh: the same
// GemmParams, any sizes, strides and alignment, bias and ReLU fused), with the products on the
// tensor cores: mma.sync m16n8k16, float32 accumulators, one rounding to the 16-bit type at
// the store.
//
// Tiles. A block computes 128 x 128 of C with 8 warps in a 2 x 4 grid, each warp 64 x 32:
// 4 x 4 mma tiles of 16 x 8, so 64 float32 accumulators a thread. Per 16-deep step a warp
// loads 4 A and 4 B fragments (6 ldmatrix.x4) for 16 mma: each fragment feeds 4 mma.
//
// Pipeline. K goes by 32 through a 3-stage cp.async pipeline: while the tensor cores work on
// one stage, the copies of the next two are in flight. Per K tile: wait for the oldest group,
// one barrier (which both publishes that stage and retires the stage read last time), issue
// the copies into the retired stage, multiply. 3 stages x (A + B) x 128 x 32 x 2 bytes = 48 KiB
// of shared memory and at most 128 registers a thread: 2 blocks per SM on sm_80 and sm_90.
//
// Orientation. Shared memory keeps each operand's tile in the orientation it has in global
// memory, so every copy is 16 contiguous bytes: K-major ([outer][k], 4 chunks of 8 elements a
// row) when k is contiguous, outer-major ([k][outer], 16 chunks a row) when the outer index
// is. ldmatrix reads a K-major tile straight into mma fragments and an outer-major one with
// .trans, so dX's Wᵀ and dW's dYᵀ and Xᵀ are read transposed with no copy. Operands that are
// neither contiguous nor 16-byte aligned take scalar loads into the same tiles.
//
// Bank conflicts. The 16-byte chunks are XOR-swizzled within a row so that the 8 rows one
// ldmatrix reads land in 8 different 16-byte bank groups (swizzled_offset below), with no padding.
//
// On sm_90, wgmma and TMA would go further: a warpgroup's 64 x N x 16 products read straight
// from shared memory (no ldmatrix, fewer registers), and one thread's TMA copy per tile in
// place of 256 threads' cp.async. That is a later step.
#pragma once

#include "gemm.cuh"
#include "ptx.cuh"

namespace ext::cuda {

namespace tc {

constexpr int kBlockM = 128;  // a block's tile of C, as in gemm.cuh: 128 x 128
constexpr int kBlockN = 128;
constexpr int kBlockK = 32;   // K per stage: a 64-byte row of each operand per outer index
constexpr int kStages = 3;    // tiles in shared memory: one multiplied while two are copied
constexpr int kWarpsN = 4;    // 8 warps, 2 along M and 4 along N
constexpr int kWarpM = 64;    // each warp's tile of C
constexpr int kWarpN = 32;
constexpr int kMmaM = 16;     // mma.sync.m16n8k16
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
constexpr int kTilesM = kWarpM / kMmaM;  // 4 x 4 mma tiles a warp
constexpr int kTilesN = kWarpN / kMmaN;
constexpr int kChunk = 8;  // 16-bit elements in one 16-byte copy (and in one ldmatrix row)
constexpr int kTileElements = kBlockM * kBlockK;
constexpr int kChunksPerThread = kTileElements / kChunk / kThreads;  // 2 per operand per stage
constexpr int kMinBlocksPerSm = 2;

static_assert(kBlockM == kBlockN, "one loader serves A and B");
static_assert((kBlockM / kWarpM) * (kBlockN / kWarpN) * 32 == kThreads, "8 warps cover the block's tile");
static_assert(kTilesN % 2 == 0, "B fragments come two n-tiles per ldmatrix.x4");
static_assert(kChunksPerThread * kChunk * kThreads == kTileElements, "every thread copies whole chunks");
static_assert(kBlockK / kChunk == 4 && kBlockM / kChunk == 16, "swizzled_offset's XOR masks assume these rows");

template <typename T>
struct Shared {
  T a[kStages][kTileElements];
  T b[kStages][kTileElements];
};

// Where element (outer, k) of a tile lives, for chunk-aligned coordinates along the row.
// K-major rows are 64 bytes, two to a 128-byte bank line: chunk c of row r goes to c ^ ((r/2) % 4),
// so 8 consecutive rows cover the line's 8 bank groups. Outer-major rows are 256 bytes: chunk c of
// row r goes to c ^ (r % 8).
__device__ __forceinline__ int swizzled_offset(bool k_major, int outer, int k) {
  if (k_major) return outer * kBlockK + ((k / kChunk) ^ ((outer >> 1) & 3)) * kChunk + k % kChunk;
  return k * kBlockM + ((outer / kChunk) ^ (k & 7)) * kChunk + outer % kChunk;
}

template <typename T>
struct alignas(16) Chunk {
  T v[kChunk];
};

// Fault injection, for the emulation tests only (tests/cuda_emu): each switch breaks one rule.
#if defined(EMU_BREAK_WAIT_GROUP)
constexpr int kGroupsLeftInFlight = kStages - 1;  // one too many: the stage about to be read may not have landed
#else
constexpr int kGroupsLeftInFlight = kStages - 2;
#endif
#if defined(EMU_BREAK_STAGE_BARRIER)
#define EXT_STAGE_BARRIER()  // missing: copies into a stage race with other warps still reading it
#else
#define EXT_STAGE_BARRIER() __syncthreads()
#endif

// This thread's chunks of one operand's K tile into shared memory, zero past every edge.
template <typename T>
__device__ __forceinline__ void load_tile(const TileOperand<T>& op, int64_t outer0, int64_t k0, int64_t K, T* tile) {
  const bool k_major = op.runs_along_k;
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const int chunk = int(threadIdx.x) + j * kThreads;
    const int outer = k_major ? chunk / (kBlockK / kChunk) : (chunk % (kBlockM / kChunk)) * kChunk;
    const int k = k_major ? (chunk % (kBlockK / kChunk)) * kChunk : chunk / (kBlockM / kChunk);
    const int64_t o = outer0 + outer;
    const int64_t kk = k0 + k;
    const bool line_inside = k_major ? o < op.outer_size : kk < K;  // the coordinate across the chunk
    const int64_t run_left = k_major ? K - kk : op.outer_size - o;  // and how far the chunk's run reaches
    const int valid = !line_inside || run_left <= 0 ? 0 : run_left >= kChunk ? kChunk : int(run_left);
    T* dst = tile + swizzled_offset(k_major, outer, k);
    const T* src = valid > 0 ? op.ptr + o * op.outer_stride + kk * op.k_stride : op.ptr;
    if (op.chunk_loads) {
      ptx::cp_async_16(dst, src, valid * int(sizeof(T)));  // zero-fills the bytes past `valid`
    } else {
      const int64_t step = k_major ? op.k_stride : op.outer_stride;
      Chunk<T> values;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) values.v[i] = i < valid ? src[i * step] : from_acc<T>(0.0f);
      *reinterpret_cast<Chunk<T>*>(dst) = values;
    }
  }
}

// The A fragments (16 x 16, row-major) of the warp's kTilesM tiles at rows m0.., k0..
// ldmatrix.x4's four 8 x 8 matrices are, in order, rows 0-7 / 8-15 at k 0-7, then at k 8-15:
// exactly a0a1, a2a3, a4a5, a6a7. Lane l gives the address of row l % 8 of matrix l / 8.
template <typename T>
__device__ __forceinline__ void load_a_fragments(const T* tile, bool k_major, int m0, int k0,
                                                 uint32_t (&a)[kTilesM][4]) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int i = 0; i < kTilesM; ++i) {
    const int m = m0 + i * kMmaM + 8 * ((lane >> 3) & 1);
    const int k = k0 + 8 * (lane >> 4);
    if (k_major) {
      ptx::ldmatrix_x4(a[i], tile + swizzled_offset(true, m + (lane & 7), k));
    } else {  // stored [k][m]: each matrix's rows are k, so read it transposed
      ptx::ldmatrix_x4_trans(a[i], tile + swizzled_offset(false, m, k + (lane & 7)));
    }
#if defined(EMU_BREAK_FRAGMENT)
    const uint32_t swap = a[i][1];  // rows 8-15 and columns 8-15 exchanged
    a[i][1] = a[i][2];
    a[i][2] = swap;
#endif
  }
}

// The B fragments (16 x 8, column-major: Bᵀ's rows are n) of the warp's kTilesN tiles at
// columns n0.., k0.., two tiles per ldmatrix.x4: its matrices are n 0-7 at k 0-7 and 8-15
// (the first tile's b0b1, b2b3), then n 8-15 likewise.
template <typename T>
__device__ __forceinline__ void load_b_fragments(const T* tile, bool k_major, int n0, int k0,
                                                 uint32_t (&b)[kTilesN][2]) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < kTilesN; j += 2) {
    const int n = n0 + j * kMmaN + 8 * (lane >> 4);
    const int k = k0 + 8 * ((lane >> 3) & 1);
    uint32_t r[4];
    if (k_major) {
      ptx::ldmatrix_x4(r, tile + swizzled_offset(true, n + (lane & 7), k));
    } else {
      ptx::ldmatrix_x4_trans(r, tile + swizzled_offset(false, n, k + (lane & 7)));
    }
    b[j][0] = r[0];
    b[j][1] = r[1];
    b[j + 1][0] = r[2];
    b[j + 1][1] = r[3];
  }
}

template <typename T>
__device__ __forceinline__ void load_stage(const GemmParams<T>& p, Shared<T>& tiles, int64_t m0, int64_t n0,
                                           int64_t k_tile) {
  const int stage = int(k_tile % kStages);
  load_tile(p.a, m0, k_tile * kBlockK, p.K, tiles.a[stage]);
  load_tile(p.b, n0, k_tile * kBlockK, p.K, tiles.b[stage]);
}

template <typename T>
inline dim3 gemm_grid(const GemmParams<T>& p) {
  return dim3(unsigned((p.a.outer_size + kBlockM - 1) / kBlockM), unsigned((p.b.outer_size + kBlockN - 1) / kBlockN));
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) gemm_kernel(const GemmParams<T> p) {
  EXT_SHARED_MEMORY(shared);
  Shared<T>& tiles = shared_as<Shared<T>>(shared);

  const int64_t m0 = int64_t(blockIdx.x) * kBlockM;
  const int64_t n0 = int64_t(blockIdx.y) * kBlockN;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int warp_m0 = (warp / kWarpsN) * kWarpM;
  const int warp_n0 = (warp % kWarpsN) * kWarpN;
  const int64_t k_tiles = (p.K + kBlockK - 1) / kBlockK;

  // Prologue: the first kStages - 1 tiles in flight, one commit group each (empty past the end,
  // so the count of groups, which cp_async_wait relies on, is the same for every K).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(p, tiles, m0, n0, s);
    ptx::cp_async_commit();
  }

  float acc[kTilesM][kTilesN][4] = {};
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    ptx::cp_async_wait<kGroupsLeftInFlight>();  // this thread's copies of tile kt have landed
    EXT_STAGE_BARRIER();  // everyone's have, and every warp is done with tile kt - 1's stage
    if (kt + kStages - 1 < k_tiles) load_stage(p, tiles, m0, n0, kt + kStages - 1);  // into that stage
    ptx::cp_async_commit();

    const int stage = int(kt % kStages);
#pragma unroll
    for (int k = 0; k < kBlockK; k += kMmaK) {
      uint32_t a[kTilesM][4];
      uint32_t b[kTilesN][2];
      load_a_fragments(tiles.a[stage], p.a.runs_along_k, warp_m0, k, a);
      load_b_fragments(tiles.b[stage], p.b.runs_along_k, warp_n0, k, b);
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) ptx::mma_m16n8k16<T>(acc[i][j], a[i], b[j]);
      }
    }
  }

  // Epilogue: accumulator r of tile (i, j) is C's row group + 8 (r / 2), column 2 (lane % 4) + r % 2
  // within the tile (the ISA's C fragment); bias and ReLU fused into the one store.
  const int rows_left = p.a.outer_size - m0 < kBlockM ? int(p.a.outer_size - m0) : kBlockM;
  const int cols_left = p.b.outer_size - n0 < kBlockN ? int(p.b.outer_size - n0) : kBlockN;
  const int group = lane >> 2;
  const int col_in_tile = 2 * (lane & 3);
  float bias[kTilesN][2];
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = warp_n0 + j * kMmaN + col_in_tile + c;
      bias[j][c] = p.bias != nullptr && col < cols_left ? to_acc(p.bias[n0 + col]) : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_m0 + i * kMmaM + group + 8 * half;
      if (row >= rows_left) continue;
      T* c_row = p.c + (m0 + row) * p.ldc + n0;
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = warp_n0 + j * kMmaN + col_in_tile + c;
          if (col >= cols_left) continue;
          float value = acc[i][j][2 * half + c] + bias[j][c];
          if (p.relu && value < 0.0f) value = 0.0f;  // NaN passes through, as in torch.relu
          c_row[col] = from_acc<T>(value);
        }
      }
    }
  }
}

}  // namespace tc
}  // namespace ext::cuda
