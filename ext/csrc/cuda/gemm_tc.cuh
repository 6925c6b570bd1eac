// The tensor-core GEMM, for float16 and bfloat16 and for float32 as TF32 (when torch allows
// it: gemm_launch.cuh): gemm_kernel's contract (gemm.cuh: the same GemmParams, any sizes,
// strides and alignment, bias and ReLU fused, split-K), with the products on the tensor cores:
// mma.sync m16n8k16 (m16n8k8 for TF32), float32 accumulators, one rounding at the store.
//
// Tiles. A block computes 128 x 128 of C with 8 warps in a 2 x 4 grid, each warp 64 x 32:
// 4 x 4 mma tiles of 16 x 8, so 64 float32 accumulators a thread. Per 16-deep step a warp
// loads 4 A and 4 B fragments (6 ldmatrix.x4) for 16 mma: each fragment feeds 4 mma.
//
// Pipeline. K goes by 32 (16 for TF32) through a 3-stage cp.async pipeline: while the tensor
// cores work on one stage, the copies of the next two are in flight. Per K tile: wait for the
// oldest group, one barrier (which both publishes that stage and retires the stage read last
// time), issue the copies into the retired stage, multiply. 3 stages x (A + B) x 128 x 64 bytes
// = 48 KiB of shared memory and at most 128 registers a thread: 2 blocks per SM on sm_80 and sm_90.
//
// Orientation. Shared memory keeps each operand's tile in the orientation it has in global
// memory, so every copy is 16 contiguous bytes: K-major ([outer][k], 4 chunks of 8 elements a
// row) when k is contiguous, outer-major ([k][outer], 16 chunks a row) when the outer index
// is. ldmatrix reads a K-major tile straight into mma fragments and an outer-major one with
// .trans, so dX's Wᵀ and dW's dYᵀ and Xᵀ are read transposed with no copy. Operands that are
// neither contiguous nor 16-byte aligned take scalar loads into the same tiles. ldmatrix cannot
// transpose 32-bit elements: TF32 operands that are not K-major are transposed on the way in.
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

// Tile sizes in elements; per stage, a tile row is 64 bytes whatever the element type, so the
// same shared memory, copies and swizzle serve 16-bit (K 32 a stage) and float32 as TF32 (K 16).
constexpr int kBlockM = 128;  // a block's tile of C, as in gemm.cuh: 128 x 128
constexpr int kBlockN = 128;
constexpr int kRowBytes = 64;  // of each operand's tile row per stage
constexpr int kStages = 3;     // tiles in shared memory: one multiplied while two are copied
constexpr int kWarpsN = 4;     // 8 warps, 2 along M and 4 along N
constexpr int kWarpM = 64;     // each warp's tile of C
constexpr int kWarpN = 32;
constexpr int kMmaM = 16;      // mma.sync.m16n8k16 (16-bit) and m16n8k8 (TF32)
constexpr int kMmaN = 8;
constexpr int kTilesM = kWarpM / kMmaM;  // 4 x 4 mma tiles a warp
constexpr int kTilesN = kWarpN / kMmaN;
constexpr int kMinBlocksPerSm = 2;

template <typename T>
constexpr int kChunk = 16 / int(sizeof(T));  // elements in one 16-byte copy (and one ldmatrix row)
template <typename T>
constexpr int kBlockK = kRowBytes / int(sizeof(T));  // 32 (16-bit) or 16 (TF32)
template <typename T>
constexpr int kMmaK = 2 * kChunk<T>;  // 16 or 8: an A fragment is two chunks deep
template <typename T>
constexpr int kTileElements = kBlockM * kBlockK<T>;
template <typename T>
constexpr int kChunksPerThread = kTileElements<T> / kChunk<T> / kThreads;  // 2 per operand per stage

static_assert(kBlockM == kBlockN, "one loader serves A and B");
static_assert((kBlockM / kWarpM) * (kBlockN / kWarpN) * 32 == kThreads, "8 warps cover the block's tile");
static_assert(kTilesN % 2 == 0, "B fragments come two n-tiles per ldmatrix.x4");
static_assert(kRowBytes / 16 == 4, "swizzled_offset's K-major XOR mask assumes 4 chunks a row");

template <typename T>
struct Shared {
  T a[kStages][kTileElements<T>];
  T b[kStages][kTileElements<T>];
};

// Where element (outer, k) of a tile lives. K-major rows are 64 bytes, two to a 128-byte bank
// line: chunk c of row r goes to c ^ ((r / 2) % 4), so the 8 consecutive rows one ldmatrix reads
// cover the line's 8 16-byte bank groups. Outer-major rows (16-bit only) are 256 bytes: chunk c
// of row r goes to c ^ (r % 8), for the 8 rows one ldmatrix.trans reads.
template <typename T>
__device__ __forceinline__ int swizzled_offset(bool k_major, int outer, int k) {
  constexpr int chunk = kChunk<T>;
  if (k_major) return outer * kBlockK<T> + ((k / chunk) ^ ((outer >> 1) & 3)) * chunk + k % chunk;
  return k * kBlockM + ((outer / chunk) ^ (k & 7)) * chunk + outer % chunk;
}

// A tile's orientation in shared memory: as in global memory for 16-bit types (ldmatrix.trans
// reads an outer-major one), always K-major for float, whose outer-major operands are
// transposed on the way in by 4-byte copies: ldmatrix cannot transpose 32-bit elements, and
// reading fragments element by element spilled registers.
template <typename T, bool global_k_major>
constexpr bool kSharedKMajor = global_k_major || sizeof(T) == 4;

template <typename T>
struct alignas(16) Chunk {
  T v[kChunk<T>];
};

// Fault injection, for the emulation tests only (tests/cuda_emu): each switch breaks one rule.
#if defined(EMU_BREAK_NO_WAIT)
#define EXT_WAIT_FOR_STAGE()  // missing: a stage is multiplied before its copies have landed
#elif defined(EMU_BREAK_WAIT_GROUP)
#define EXT_WAIT_FOR_STAGE() ptx::cp_async_wait<kStages - 1>()  // one group too weak: the same, subtler
#else
#define EXT_WAIT_FOR_STAGE() ptx::cp_async_wait<kStages - 2>()  // all but the newest group: tile kt has landed
#endif
#if defined(EMU_BREAK_STAGE_BARRIER)
#define EXT_STAGE_BARRIER()  // missing: copies into a stage race with other warps still reading it
#else
#define EXT_STAGE_BARRIER() __syncthreads()
#endif

// This thread's part of one operand's K tiles, copied into shared memory, zero past every edge:
// 16-byte chunks along the contiguous dimension, or (float, outer-major in global memory) single
// elements, consecutive threads reading consecutive addresses, stored K-major. Operands that are
// not contiguous and 16-byte aligned (TileOperand::chunk_loads) go through registers instead.
// What stays fixed over the block's K range (the thread's source, rows and the outer edge) is
// worked out once, before the K loop; per tile the source steps on and only the K edge is checked.
// Redone every tile, that 64-bit address and edge arithmetic made the integer pipe the busiest in
// Nsight Compute on an H200, the kernel issue-bound (bench/README.md, "On a GPU"); worked out once,
// a 16-bit K tile is 152 SASS instructions a warp around its 32 HMMA, not 199 (sm_90a, cp.async).
template <typename T, bool k_major>
struct TileCopier {
  static constexpr bool kElements = !k_major && sizeof(T) == 4;  // float, transposed on the way in
  // Elements: thread t copies column t % kBlockM at kElementRows consecutive k from
  // kElementRows * (t / kBlockM), walking one pointer down the column (64-bit offsets per element,
  // or a swizzled chunk per element, kept across the K loop spilled registers).
  static constexpr int kElementRows = kBlockK<T> * kBlockM / kThreads;
  // Chunks: a tile row (an outer index when K-major, a k otherwise) is kChunksPerRow chunks; thread
  // t copies chunk t % kChunksPerRow of rows t / kChunksPerRow, + kRowStep, ...
  static constexpr int kChunkSize = kChunk<T>;
  static constexpr int kChunksPerRow = (k_major ? kBlockK<T> : kBlockM) / kChunkSize;
  static constexpr int kRowStep = kThreads / kChunksPerRow;

  const T* src;     // the thread's first element in the next K tile to copy
  int first_row;    // its first tile row (elements: its first k)
  int along;        // its first element within the row (elements: its column, an outer index)
  int outer_limit;  // K-major: the tile's rows inside the operand; else the elements of the thread's
                    // run inside it (elements: 1 or 0)

  __device__ __forceinline__ TileCopier(const TileOperand<T>& op, int64_t outer0, int64_t k_begin) {
    const int64_t outer_left = op.outer_size - outer0;
    if constexpr (kElements) {
      along = int(threadIdx.x) % kBlockM;
      first_row = int(threadIdx.x) / kBlockM * kElementRows;
      outer_limit = along < outer_left ? 1 : 0;
      src = op.ptr + (outer_limit ? (outer0 + along) * op.outer_stride + (k_begin + first_row) * op.k_stride : 0);
    } else {
      first_row = int(threadIdx.x) / kChunksPerRow;
      along = (int(threadIdx.x) % kChunksPerRow) * kChunkSize;
      if constexpr (k_major) {
        outer_limit = outer_left < kBlockM ? int(outer_left) : kBlockM;
      } else {
        const int64_t run_left = outer_left - along;
        outer_limit = run_left <= 0 ? 0 : run_left >= kChunkSize ? kChunkSize : int(run_left);
      }
      src = op.ptr + (outer0 + (k_major ? first_row : along)) * op.outer_stride +
            (k_begin + (k_major ? along : first_row)) * op.k_stride;
    }
  }

  // The next K tile, of whose kBlockK k the first k_left lie in the block's K range, into `tile`.
  __device__ __forceinline__ void copy_next(const TileOperand<T>& op, int k_left, T* tile) {
    if constexpr (kElements) {
      const T* element = src;
#pragma unroll
      for (int k = first_row; k < first_row + kElementRows; ++k, element += op.k_stride) {
        const bool inside = outer_limit && k < k_left;
        T* dst = tile + swizzled_offset<T>(true, along, k);
        if (op.chunk_loads) {
          ptx::cp_async_4(dst, inside ? element : op.ptr, inside ? 4 : 0);
        } else {
          *dst = inside ? *element : 0.0f;
        }
      }
    } else {
      const int64_t row_stride = k_major ? op.outer_stride : op.k_stride;
      const int64_t along_stride = k_major ? op.k_stride : op.outer_stride;
      const int run_left = k_left - along;  // K-major: the thread's run's k inside the K range
      const int run_valid = run_left <= 0 ? 0 : run_left >= kChunkSize ? kChunkSize : run_left;
#pragma unroll
      for (int i = 0; i < kChunksPerThread<T>; ++i) {
        const int row = first_row + i * kRowStep;
        const int valid = k_major ? (row < outer_limit ? run_valid : 0) : (row < k_left ? outer_limit : 0);
        const T* chunk = src + i * kRowStep * row_stride;
        T* dst = tile + (k_major ? swizzled_offset<T>(true, row, along) : swizzled_offset<T>(false, along, row));
        if (op.chunk_loads) {
          ptx::cp_async_16(dst, valid > 0 ? chunk : op.ptr, valid * int(sizeof(T)));  // zero-fills past `valid`
        } else {
          Chunk<T> values;
#pragma unroll
          for (int e = 0; e < kChunkSize; ++e) values.v[e] = e < valid ? chunk[e * along_stride] : from_acc<T>(0.0f);
          *reinterpret_cast<Chunk<T>*>(dst) = values;
        }
      }
    }
    src += kBlockK<T> * op.k_stride;
  }
};

// A float32 register rounded to TF32 (to nearest, ties away, as cuBLAS does); 16-bit pairs as they are.
template <typename T, int N>
__device__ __forceinline__ void round_for_mma(uint32_t (&r)[N]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = ptx::to_tf32(r[i]);
  }
}

// The A fragment (16 x kMmaK, row-major) of the mma tile at rows m0.., k0.. ldmatrix.x4's four
// 8-row matrices are, in order, rows 0-7 / 8-15 of the first chunk of k, then of the second:
// the ISA's a0a1, a2a3, a4a5, a6a7 for 16-bit, and a0, a1, a2, a3 for TF32 (a row of 8 16-bit
// values is 4 floats; lane l gets float l % 4 of row l / 4). Lane l gives the address of row
// l % 8 of matrix l / 8. An outer-major (16-bit) tile is read with .trans.
template <typename T, bool k_major>
__device__ __forceinline__ void load_a_fragment(const T* tile, int m0, int k0, uint32_t (&a)[4]) {
  const int lane = int(threadIdx.x) % 32;
  const int m = m0 + 8 * ((lane >> 3) & 1);
  const int k = k0 + kChunk<T> * (lane >> 4);
  if constexpr (k_major) {
    ptx::ldmatrix_x4(a, tile + swizzled_offset<T>(true, m + (lane & 7), k));
  } else {  // stored [k][m] (16-bit only): each matrix's rows are k, so read it transposed
    ptx::ldmatrix_x4_trans(a, tile + swizzled_offset<T>(false, m, k + (lane & 7)));
  }
  round_for_mma<T>(a);
#if defined(EMU_BREAK_FRAGMENT)
  const uint32_t swap = a[1];  // two fragment registers exchanged
  a[1] = a[2];
  a[2] = swap;
#endif
}

// The B fragments (kMmaK x 8, column-major: Bᵀ's rows are n) of the warp's kTilesN tiles at
// columns n0.., k0.., two tiles per ldmatrix.x4: its matrices are n 0-7 at the first and
// second chunk of k (the first tile's two registers), then n 8-15 likewise.
template <typename T, bool k_major>
__device__ __forceinline__ void load_b_fragments(const T* tile, int n0, int k0, uint32_t (&b)[kTilesN][2]) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < kTilesN; j += 2) {
    const int n = n0 + j * kMmaN + 8 * (lane >> 4);
    const int k = k0 + kChunk<T> * ((lane >> 3) & 1);
    uint32_t r[4];
    if constexpr (k_major) {
      ptx::ldmatrix_x4(r, tile + swizzled_offset<T>(true, n + (lane & 7), k));
    } else {
      ptx::ldmatrix_x4_trans(r, tile + swizzled_offset<T>(false, n, k + (lane & 7)));
    }
    round_for_mma<T>(r);
    b[j][0] = r[0];
    b[j][1] = r[1];
    b[j + 1][0] = r[2];
    b[j + 1][1] = r[3];
  }
}

// Both operands' copiers, and the next K tile of the block's K range into a stage.
template <typename T, bool a_k_major, bool b_k_major>
struct StageLoader {
  TileCopier<T, a_k_major> a;
  TileCopier<T, b_k_major> b;
  int64_t k_left;  // of the block's K range, not yet copied

  __device__ __forceinline__ StageLoader(const GemmParams<T>& p, const KRange& k_range, int64_t m0, int64_t n0)
      : a(p.a, m0, k_range.k_begin), b(p.b, n0, k_range.k_begin), k_left(k_range.depth) {}

  __device__ __forceinline__ void load_next(const GemmParams<T>& p, Shared<T>& tiles, int stage) {
    const int tile_k_left = k_left < kBlockK<T> ? int(k_left) : kBlockK<T>;
    a.copy_next(p.a, tile_k_left, tiles.a[stage]);
    b.copy_next(p.b, tile_k_left, tiles.b[stage]);
    k_left -= kBlockK<T>;
  }
};

template <typename T>
inline dim3 gemm_grid(const GemmParams<T>& p) {
  return dim3(unsigned((p.a.outer_size + kBlockM - 1) / kBlockM), unsigned((p.b.outer_size + kBlockN - 1) / kBlockN));
}

// T: __half or __nv_bfloat16, or float multiplied as TF32. a_k_major and b_k_major: each operand's
// orientation in global memory (TileOperand::runs_along_k), fixed per instantiation so that each
// carries only its own load path.
template <typename T, bool a_k_major, bool b_k_major>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) gemm_kernel(const GemmParams<T> p) {
  EXT_SHARED_MEMORY(shared);
  Shared<T>& tiles = shared_as<Shared<T>>(shared);

  const int64_t m0 = int64_t(blockIdx.x) * kBlockM;
  const int64_t n0 = int64_t(blockIdx.y) * kBlockN;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int warp_m0 = (warp / kWarpsN) * kWarpM;
  const int warp_n0 = (warp % kWarpsN) * kWarpN;
  const KRange k_range = block_k_range(p);
  const int64_t k_tiles = (k_range.depth + kBlockK<T> - 1) / kBlockK<T>;

  // Prologue: the first kStages - 1 tiles in flight, one commit group each (empty past the end,
  // so the count of groups, which cp_async_wait relies on, is the same for every K).
  StageLoader<T, a_k_major, b_k_major> loader(p, k_range, m0, n0);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) loader.load_next(p, tiles, s);
    ptx::cp_async_commit();
  }

  float acc[kTilesM][kTilesN][4] = {};
  int stage = 0;                      // tile kt's, counted round rather than kt % kStages (64-bit)
  int next_stage = kStages - 1;       // tile kt + kStages - 1's
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    EXT_WAIT_FOR_STAGE();  // this thread's copies of tile kt have landed
    EXT_STAGE_BARRIER();  // everyone's have, and every warp is done with tile kt - 1's stage
    if (kt + kStages - 1 < k_tiles) loader.load_next(p, tiles, next_stage);
    ptx::cp_async_commit();
#pragma unroll
    for (int k = 0; k < kBlockK<T>; k += kMmaK<T>) {
      uint32_t b[kTilesN][2];  // the warp's B fragments, then one A fragment at a time: fewer live registers
      load_b_fragments<T, kSharedKMajor<T, b_k_major>>(tiles.b[stage], warp_n0, k, b);
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
        uint32_t a[4];
        load_a_fragment<T, kSharedKMajor<T, a_k_major>>(tiles.a[stage], warp_m0 + i * kMmaM, k, a);
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) ptx::mma<T>(acc[i][j], a, b[j]);
      }
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
    next_stage = next_stage == kStages - 1 ? 0 : next_stage + 1;
  }

  // Epilogue: accumulator r of tile (i, j) is C's row group + 8 (r / 2), column 2 (lane % 4) + r % 2
  // within the tile (the ISA's C fragment); bias and ReLU fused into the one store. Split-K:
  // this split's sums as they are, into its partial product.
  const int rows_left = p.a.outer_size - m0 < kBlockM ? int(p.a.outer_size - m0) : kBlockM;
  const int cols_left = p.b.outer_size - n0 < kBlockN ? int(p.b.outer_size - n0) : kBlockN;
  const bool split = p.partial != nullptr;
  const int group = lane >> 2;
  const int col_in_tile = 2 * (lane & 3);
  float bias[kTilesN][2];
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = warp_n0 + j * kMmaN + col_in_tile + c;
      bias[j][c] = !split && p.bias != nullptr && col < cols_left ? to_acc(p.bias[n0 + col]) : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < kTilesM; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_m0 + i * kMmaM + group + 8 * half;
      if (row >= rows_left) continue;
      const int64_t c_row = m0 + row;
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = warp_n0 + j * kMmaN + col_in_tile + c;
          if (col >= cols_left) continue;
          float value = acc[i][j][2 * half + c];
          if (split) {
            p.partial[(int64_t(blockIdx.z) * p.a.outer_size + c_row) * p.b.outer_size + n0 + col] = value;
            continue;
          }
          value += bias[j][c];
          if (p.relu && value < 0.0f) value = 0.0f;  // NaN passes through, as in torch.relu
          p.c[c_row * p.ldc + n0 + col] = from_acc<T>(value);
        }
      }
    }
  }
}

}  // namespace tc
}  // namespace ext::cuda
