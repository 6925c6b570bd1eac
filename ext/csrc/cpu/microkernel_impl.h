// The register-tile microkernel and the packing routines, written once over a
// small SIMD description `Simd`: vector type V with kLanes lanes of T, fma,
// broadcast, and a kTransposeBlock-square transpose for packing.
// Each microkernel_<isa>.cpp includes this file inside its own
// `#pragma GCC target` region, so the same code becomes AVX-512, AVX2+FMA or
// portable machine code. No include guard on purpose: one inclusion per target,
// in an unnamed namespace, so the per-target copies never merge at link time.
#include "microkernel.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace ext::cpu {
namespace {

template <class Simd>
inline typename Simd::V load(const typename Simd::T* p) {
  typename Simd::V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class Simd>
inline void store(typename Simd::T* p, typename Simd::V v) {
  std::memcpy(p, &v, sizeof v);
}

// C tile = init + A·B, MR x (NV * lanes) values held in registers for the whole
// k loop, for a tile whose MR rows and NR columns all exist (edge tiles: `tile`).
// kUnitRowStride picks the A addressing at compile time so the packed case (the
// hot one) has no stride multiplies; kIndexedB the B addressing.
// full_tile_at takes the tile's A, B, C and bias as arguments, in registers, and everything else from t;
// full_tile takes them from t (below).
template <class Simd, int MR, int NV, bool kUnitRowStride, bool kIndexedB, bool kRowBias, bool kCopyB = false,
          bool kCopyA = false>
void full_tile_at(const TileArgs<typename Simd::T>& t, const typename Simd::T* a, const typename Simd::T* b,
                  typename Simd::T* c, const typename Simd::T* bias) {
  static_assert(!kCopyA || kUnitRowStride, "A is copied from unit row stride only");
  using T = typename Simd::T;
  using V = typename Simd::V;
  constexpr int W = Simd::kLanes;

  // Every loop over the tile's rows and vectors is unrolled by pragma, early
  // enough for GCC to keep acc in registers from start to end. Without it GCC
  // 12 kept acc as a stack array, loaded into registers around the k loop and
  // stored back after it (202 zmm stack accesses in the 8x48 tile, 12 with):
  // per tile, 72 extra memory operations that shallow products pay. Measured
  // (1 thread, interleaved with torch): dX 128x256->10 7.6 -> 6.9 us, 128x512->10
  // 13.0 -> 11.7 us, dW of the 10-class head (10x256, K = 128) 8.1 -> 6.9 us,
  // dW 128x256->256 96.2 -> 94.3 us; 1024^3 unchanged.
  // Each sum starts from its bias: by column, or by row (kRowBias) in a product computed as Cᵀ
  // (gemm.cpp), so either way every element is summed alike. Row bias is an instance of its own:
  // a run-time choice here cost the heads' dX 3-4% (1 thread, processes alternating).
  V acc[MR][NV];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16")
    for (int v = 0; v < NV; ++v)
      if constexpr (kRowBias)
        acc[i][v] = t.accumulate ? V{} : Simd::broadcast(t.row_bias[i]);
      else
        acc[i][v] = !t.accumulate && bias ? load<Simd>(bias + v * W) : V{};

  [[maybe_unused]] T* b_copy = t.b_copy;
  [[maybe_unused]] T* a_copy = t.a_copy;
  const int64_t a_row_stride = kUnitRowStride ? 1 : t.a_row_stride;
  const int64_t a_k_stride = kUnitRowStride ? t.a_k_stride : 1;
  // Rows in groups of 8, each from a base of its own (a 16-row tile: tall_one_vector_tile), so that
  // the groups share 8 row offsets: with 16 offsets GCC ran out of registers and read them from the stack.
  constexpr int kGroupRows = MR > 8 && MR % 8 == 0 ? 8 : MR, kGroups = MR / kGroupRows;
  [[maybe_unused]] const T* a_groups[kGroups];
  if constexpr (kGroups > 1)
    _Pragma("GCC unroll 4")
    for (int g = 0; g < kGroups; ++g) a_groups[g] = a + g * kGroupRows * a_row_stride;
#pragma GCC unroll 4
  for (int64_t k = 0; k < t.kc; ++k) {
    V b_row[NV];
    if constexpr (kIndexedB) {
      const int64_t offset = t.b_offsets[k];
      _Pragma("GCC unroll 16")
      for (int v = 0; v < NV; ++v) b_row[v] = load<Simd>(t.b_vectors[v] + offset);
    } else {
      _Pragma("GCC unroll 16")
      for (int v = 0; v < NV; ++v) b_row[v] = load<Simd>(b + v * W);
    }
    if constexpr (kCopyB) {
      _Pragma("GCC unroll 16")
      for (int v = 0; v < NV; ++v) store<Simd>(b_copy + v * W, b_row[v]);
      b_copy += NV * W;
    }
    if constexpr (kCopyA) {
      std::memcpy(a_copy, a, MR * sizeof(T));
      a_copy += MR;
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; ++i) {
      const V a_value = Simd::broadcast(kGroups == 1 ? a[i * a_row_stride]
                                                    : a_groups[i / kGroupRows][i % kGroupRows * a_row_stride]);
      _Pragma("GCC unroll 16")
      for (int v = 0; v < NV; ++v) acc[i][v] = Simd::fma(a_value, b_row[v], acc[i][v]);
    }
    if constexpr (kGroups > 1)
      _Pragma("GCC unroll 4")
      for (int g = 0; g < kGroups; ++g) a_groups[g] += a_k_stride;
    a += a_k_stride;
    b += t.b_k_stride;
  }

  // A later K block's sum joins C only now, rather than the k loop starting from C:
  // each element then rounds its K as blocked sums (error growing with KC and the
  // number of blocks) rather than as one chain K long. Measured here (float32, 64x32
  // outputs, rms error relative to float64, one chain -> blocked): K = 4096 1.14e-6 ->
  // 4.1e-7, K = 65536 4.6e-6 -> 4.7e-7 (torch 3.5e-7, 3.9e-7); speed unchanged or up
  // to 0.7% faster (1 thread, 1024^3 and 2048^3, forward, dX and dW).
  const int64_t ldc = t.ldc;
  const bool accumulate = t.accumulate, relu = t.relu;
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i, c += ldc)
    _Pragma("GCC unroll 16")
    for (int v = 0; v < NV; ++v) {
      V value = acc[i][v];
      if (accumulate) value += load<Simd>(c + v * W);
      if (relu) value = value < V{} ? V{} : value;  // NaN stays NaN, as in torch.relu
      store<Simd>(c + v * W, value);
    }
}

template <class Simd, int MR, int NV, bool kUnitRowStride, bool kIndexedB, bool kRowBias, bool kCopyB = false,
          bool kCopyA = false>
void full_tile(const TileArgs<typename Simd::T>& t) {
  full_tile_at<Simd, MR, NV, kUnitRowStride, kIndexedB, kRowBias, kCopyB, kCopyA>(t, t.a, t.b, t.c, t.bias);
}

// Any tile: a full one directly; an edge tile through a full-size local tile, so
// that the hot loop never branches. The full tile is a function of its own and
// its epilogue goes a row at a time: with the edge copy in the same function and
// the epilogue in three passes over the tile, GCC kept the 8x48 tile's 24 store
// addresses on the stack, computed before the k loop and reloaded after it.
// Measured on Zen 4 (1 thread): the tile alone at kc = 10 (tile_gflops) 86.6 ->
// 96.8 GFLOP/s, at 64 110 -> 113; dX 128x256->10 9.2 -> 8.3 us and 128x512->10
// 17.0 -> 15.5 (processes alternating, faster in each of 8 rounds); the MLP's
// other products and 1024^3 1.00-1.02x. Each half gave about half of it.
template <class Simd, int MR, int NV, bool kUnitRowStride, bool kIndexedB = false, bool kRowBias = false>
void tile(const TileArgs<typename Simd::T>& t) {
  using T = typename Simd::T;
  constexpr int NR = NV * Simd::kLanes;
  if (t.rows == MR && t.cols == NR) return full_tile<Simd, MR, NV, kUnitRowStride, kIndexedB, kRowBias>(t);
  alignas(64) T edge_c[MR * NR];
  alignas(64) T edge_bias[NR];
  T edge_row_bias[MR];
  TileArgs<T> edge = t;
  edge.c = edge_c;
  edge.ldc = NR;
  std::fill_n(edge_c, MR * NR, T(0));  // padding lanes: no garbage (denormals are slow)
  if (t.accumulate)
    for (int64_t i = 0; i < t.rows; ++i) std::copy_n(t.c + i * t.ldc, t.cols, edge_c + i * NR);
  if (t.bias) {
    std::fill_n(edge_bias, NR, T(0));
    std::copy_n(t.bias, t.cols, edge_bias);
    edge.bias = edge_bias;
  }
  if (kRowBias && t.row_bias) {
    std::fill_n(edge_row_bias, MR, T(0));
    std::copy_n(t.row_bias, t.rows, edge_row_bias);
    edge.row_bias = edge_row_bias;
  }
  full_tile<Simd, MR, NV, kUnitRowStride, kIndexedB, kRowBias>(edge);
  for (int64_t i = 0; i < t.rows; ++i) std::copy_n(edge_c + i * NR, t.cols, t.c + i * t.ldc);
}

// A shallow product's row panel (Microkernel::shallow_row_panel): R rows of C across
// t.cols (whole vectors), NV vectors a tile, then one vector at a time. At K = 10 a tile
// does 10 k steps and then stores all it holds; with fewer, smaller tiles than the wide
// tile's the stores overlap the next tile's FMAs better. Measured on Zen 4 (a standalone
// loop, 1 thread, C = A·B with K = 10 and 128 x 512 of C, GFLOP/s): 8 x 3 vectors 95,
// 4 x 2 114, 4 x 3 112, 4 x 4 108, 8 x 1 112; at K = 32 all within 2%. Run by gemm_slab a
// tile at a time (each tile's arguments and tile-table lookup), the 4 x 2 tiles took dX
// 128x512->10 0.94 of the wide tiles' time (processes alternating); as one call a panel, 0.89.
// Each tile gets its column's B, C and bias as arguments (shallow_tile), not as fields of a
// TileArgs stored between tiles: at K = 10 a tile's 16 stores of C are a large part of it, and
// the next tile's fields, stored behind them, held it up. Measured on Zen 5 (1 thread): the 4 x 4
// panels of 128 x 256 of C at K = 10 alone (a standalone loop, best of 15 x 2000 runs) 3.16 -> 2.73
// us; the 8x48 tile at K = 256 and 784 the same either way. dX, processes alternating, medians of
// 6-10 rounds over three runs, new / old: 128x256->10 0.94-0.97, 128x512->10 0.94-1.04,
// 128x784->10 0.90-1.03; 2 threads 0.97 and 0.99.
template <class Simd, int R, int NV>
inline void shallow_tile(const TileArgs<typename Simd::T>& t, int64_t column) {
  full_tile_at<Simd, R, NV, false, false, false>(t, t.a, t.b + column, t.c + column,
                                                 t.bias ? t.bias + column : nullptr);
}

template <class Simd, int R, int NV>
void shallow_row_panel(const TileArgs<typename Simd::T>& t) {
  constexpr int W = Simd::kLanes;
  int64_t j = 0;
  for (; j + NV * W <= t.cols; j += NV * W) shallow_tile<Simd, R, NV>(t, j);
  for (; j < t.cols; j += W) shallow_tile<Simd, R, 1>(t, j);
}

// dst = srcᵀ (rows x cols of src): Simd::transpose's blocks in squares of whole 64-byte cache
// lines (2 x 2 blocks: each source line read is used up at once, see pack_panels), then the
// ragged edges. Packs a transposed operand, and writes C from a product computed as Cᵀ.
template <class Simd>
void transpose_matrix(const typename Simd::T* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                      typename Simd::T* dst, int64_t dst_row_stride) {
  constexpr int B = Simd::kTransposeBlock;
  constexpr int64_t S = 2 * B;
  const int64_t rows_blocked = rows / B * B, cols_blocked = cols / B * B;
  for (int64_t i0 = 0; i0 < rows_blocked; i0 += S)
    for (int64_t j0 = 0; j0 < cols_blocked; j0 += S)
      for (int64_t i = i0; i < std::min(i0 + S, rows_blocked); i += B)
        for (int64_t j = j0; j < std::min(j0 + S, cols_blocked); j += B)
          Simd::transpose(src + i * src_row_stride + j, src_row_stride, dst + j * dst_row_stride + i, dst_row_stride);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows_blocked ? cols_blocked : 0; j < cols; ++j)
      dst[j * dst_row_stride + i] = src[i * src_row_stride + j];
}

// Panels of P consecutive "lines" (rows of A, columns of B), each k-major:
// dst[panel][k][p] = src[(panel * P + p) * line_stride + k * k_stride], zero-padded.
// Reads follow whichever stride is 1; when that is k, whole blocks are
// transposed in registers (Simd::transpose), so a transposed operand packs fast.
template <class Simd, int P>
void pack_panels(const typename Simd::T* src, int64_t line_stride, int64_t k_stride, int64_t lines,
                 int64_t kc, typename Simd::T* dst) {
  using T = typename Simd::T;
  if (line_stride == 1) {
    // Each k is a contiguous run of the source (A column-major, B row-major).
    // G panels at a time, so each k reads whole cache lines (G x P values a
    // multiple of 64 bytes: 8 panels of 6 floats) and no line is fetched once
    // per panel. Measured here, packing dW's A (dYᵀ, 6-row panels, K = 512):
    // 1024 rows 248 -> 133 us (dY's 4 KiB rows had evicted each other from L1
    // between panels), 256 rows 32 -> 26 us.
    constexpr int G = 64 / std::gcd<int>(P * sizeof(T), 64);
    for (; lines >= G * P; lines -= G * P, src += G * P, dst += G * P * kc)
      for (int64_t k = 0; k < kc; ++k)
        for (int g = 0; g < G; ++g) std::memcpy(dst + g * P * kc + k * P, src + k * k_stride + g * P, P * sizeof(T));
  }
  for (int64_t first = 0; first < lines; first += P, dst += P * kc) {
    const int64_t count = std::min<int64_t>(P, lines - first);
    const T* panel = src + first * line_stride;
    if (line_stride == 1 && count == P) {
      for (int64_t k = 0; k < kc; ++k) std::memcpy(dst + k * P, panel + k * k_stride, P * sizeof(T));
    } else if (k_stride == 1) {
      // B x B blocks through registers (transpose_matrix), then the ragged right and bottom edges.
      // Lines outermost, in squares of whole 64-byte cache lines (2 x 2 blocks of 8x8 floats or 4x4
      // doubles), so each line read is used up at once. With k outermost, the forward's B = Wᵀ read
      // 32 bytes of each of 48 lines of W per step, and where W's rows are a multiple of 4 KiB apart
      // (K = 2048) all 48 fall in one L1 set of 12 ways and were fetched twice from L2. Measured
      // (forward, processes alternating, medians of 4): 128x2048->1000 2588 -> 2399 us on 1 thread,
      // 1343 -> 1228 on 2; 128x256->256 0.98 on both, 128x784->256 within the noise. A 16x16
      // AVX-512 transpose (64 shuffles per 256 floats, against 96 in four 8x8) was no faster:
      // 128x2048->1000 1.006 and 1.028 of the 8x8 blocks' time on 1 and 2 threads.
      transpose_matrix<Simd>(panel, line_stride, count, kc, dst, P);
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t p = 0; p < count; ++p) dst[k * P + p] = panel[p * line_stride + k * k_stride];
    }
    for (int64_t k = 0; count < P && k < kc; ++k) std::fill(dst + k * P + count, dst + (k + 1) * P, T(0));
  }
}

// Column sums over contiguous rows, kSumVectors vectors of columns held in
// registers down all the rows: each column still adds its rows in order, so the
// sums are those of a scalar loop, only wider. (Compiled in gemm.cpp, for the
// baseline target, the scalar loop ran at a third of torch's speed: db of a
// 512x256 dY took 15 us against 6.)
template <class Simd>
void sum_rows_contiguous(const typename Simd::T* a, int64_t row_stride, int64_t rows, int64_t cols,
                         typename Simd::T* out) {
  using T = typename Simd::T;
  using V = typename Simd::V;
  constexpr int W = Simd::kLanes, kSumVectors = 4;
  int64_t n = 0;
  for (; n + kSumVectors * W <= cols; n += kSumVectors * W) {
    V acc[kSumVectors] = {};
    for (int64_t r = 0; r < rows; ++r)
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kSumVectors; ++v) acc[v] += load<Simd>(a + r * row_stride + n + v * W);
    _Pragma("GCC unroll 4")
    for (int v = 0; v < kSumVectors; ++v) store<Simd>(out + n + v * W, acc[v]);
  }
  for (; n + W <= cols; n += W) {
    V acc{};
    for (int64_t r = 0; r < rows; ++r) acc += load<Simd>(a + r * row_stride + n);
    store<Simd>(out + n, acc);
  }
  for (; n < cols; ++n) {
    T sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += a[r * row_stride + n];
    out[n] = sum;
  }
}

// ReLU's backward for rows of dY whose values are contiguous: masked = dY where the
// layer's output is > 0, else 0 (as threshold_backward: a NaN output passes dY on),
// and, with `sums`, the column sums of masked in the same pass, each column adding
// its rows in order as sum_rows_contiguous does (so db is the same to the bit).
template <class Simd>
void relu_backward_sum_rows(const typename Simd::T* dy, int64_t dy_row_stride, const typename Simd::T* output,
                            int64_t output_row_stride, int64_t rows, int64_t cols, typename Simd::T* masked,
                            int64_t masked_row_stride, typename Simd::T* sums) {
  using T = typename Simd::T;
  using V = typename Simd::V;
  constexpr int W = Simd::kLanes, kSumVectors = 4;
  const V zero{};
  auto mask = [&](int64_t r, int64_t n) {  // vector n .. n + W of row r, masked and stored
    const V kept = load<Simd>(output + r * output_row_stride + n) <= zero ? zero : load<Simd>(dy + r * dy_row_stride + n);
    store<Simd>(masked + r * masked_row_stride + n, kept);
    return kept;
  };
  int64_t n = 0;
  for (; n + kSumVectors * W <= cols; n += kSumVectors * W) {
    V acc[kSumVectors] = {};
    for (int64_t r = 0; r < rows; ++r)
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kSumVectors; ++v) acc[v] += mask(r, n + v * W);
    if (sums)
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kSumVectors; ++v) store<Simd>(sums + n + v * W, acc[v]);
  }
  for (; n + W <= cols; n += W) {
    V acc{};
    for (int64_t r = 0; r < rows; ++r) acc += mask(r, n);
    if (sums) store<Simd>(sums + n, acc);
  }
  for (; n < cols; ++n) {
    T sum = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T kept = output[r * output_row_stride + n] <= T(0) ? T(0) : dy[r * dy_row_stride + n];
      masked[r * masked_row_stride + n] = kept;
      sum += kept;
    }
    if (sums) sums[n] = sum;
  }
}

// Instances of an R-row tile for 1 .. kMaxTileVectors vectors of columns (at most NV).
template <class Simd, int R, int NV, bool kUnitRowStride, bool kIndexedB = false, bool kRowBias = false>
void set_tiles(typename Microkernel<typename Simd::T>::TileFn (&tiles)[kMaxTileVectors]) {
  tiles[0] = &tile<Simd, R, 1, kUnitRowStride, kIndexedB, kRowBias>;
  tiles[1] = &tile<Simd, R, std::min(2, NV), kUnitRowStride, kIndexedB, kRowBias>;
  tiles[2] = &tile<Simd, R, std::min(3, NV), kUnitRowStride, kIndexedB, kRowBias>;
  tiles[3] = &tile<Simd, R, std::min(4, NV), kUnitRowStride, kIndexedB, kRowBias>;
}

// The tiles of one row count: [unit row stride, unit k stride] x [packed B, indexed B].
template <class Simd, int R, int NV>
void set_row_variant(Microkernel<typename Simd::T>& uk, int variant) {
  set_tiles<Simd, R, NV, true>(uk.unit_row_stride_tiles[variant]);
  set_tiles<Simd, R, NV, false>(uk.unit_k_stride_tiles[variant]);
  set_tiles<Simd, R, NV, true, true>(uk.indexed_b_unit_row_stride_tiles[variant]);
  set_tiles<Simd, R, NV, false, true>(uk.indexed_b_unit_k_stride_tiles[variant]);
  set_tiles<Simd, R, NV, true, false, true>(uk.row_bias_unit_row_stride_tiles[variant]);
  set_tiles<Simd, R, NV, false, false, true>(uk.row_bias_unit_k_stride_tiles[variant]);
}

template <class Simd, int MR, int NV>
Microkernel<typename Simd::T> make_microkernel() {
  using T = typename Simd::T;
  constexpr int NR = NV * Simd::kLanes;
  static_assert(NV <= kMaxTileVectors);
  constexpr int kThreeQuarters = (3 * MR + 3) / 4, kHalf = (MR + 1) / 2, kQuarter = (MR + 3) / 4;
  static_assert(kRowVariants == 4);
  Microkernel<T> uk{};
  uk.mr = MR;
  uk.nr = NR;
  uk.lanes = Simd::kLanes;
  uk.rows_of_variant[0] = MR;
  uk.rows_of_variant[1] = kThreeQuarters;
  uk.rows_of_variant[2] = kHalf;
  uk.rows_of_variant[3] = kQuarter;
  set_row_variant<Simd, MR, NV>(uk, 0);
  set_row_variant<Simd, kThreeQuarters, NV>(uk, 1);
  set_row_variant<Simd, kHalf, NV>(uk, 2);
  set_row_variant<Simd, kQuarter, NV>(uk, 3);
  uk.copying_b_tiles[0] = &full_tile<Simd, MR, NV, true, false, false, true>;
  uk.copying_b_tiles[1] = &full_tile<Simd, MR, NV, false, false, false, true>;
  uk.copying_a_tiles[0] = &full_tile<Simd, MR, NV, true, false, false, false, true>;
  uk.copying_a_tiles[1] = &full_tile<Simd, MR, NV, true, false, false, true, true>;
  uk.tall_one_vector_rows = 2 * MR;
  uk.tall_one_vector_tile = &tile<Simd, 2 * MR, 1, false>;
  // The shallow tile: half the rows, and vectors enough for 8 sums in flight (4 cycles of FMA
  // latency, two 256-bit FMAs or one 512-bit a cycle), kShallowVectors x kHalf of them; or for 16
  // (two 512-bit FMAs a cycle), which gemm.cpp picks on such a core (with_shallow_tiles_for).
  constexpr int kShallowVectors = std::min(kMaxTileVectors, (8 + kHalf - 1) / kHalf);
  constexpr int kShallowVectorsFor16 = std::min(kMaxTileVectors, (16 + kHalf - 1) / kHalf);
  uk.shallow_rows = kHalf;
  uk.shallow_nrs[0] = kShallowVectors * Simd::kLanes;
  uk.shallow_row_panels[0] = &shallow_row_panel<Simd, kHalf, kShallowVectors>;
  uk.shallow_nrs[1] = kShallowVectorsFor16 * Simd::kLanes;
  uk.shallow_row_panels[1] = &shallow_row_panel<Simd, kHalf, kShallowVectorsFor16>;
  uk.shallow_nr = uk.shallow_nrs[0];
  uk.shallow_row_panel = uk.shallow_row_panels[0];
  uk.pack_a = [](const T* a, int64_t row_stride, int64_t k_stride, int64_t rows, int64_t kc, T* dst) {
    pack_panels<Simd, MR>(a, row_stride, k_stride, rows, kc, dst);
  };
  uk.pack_b = [](const T* b, int64_t k_stride, int64_t col_stride, int64_t kc, int64_t cols, T* dst) {
    pack_panels<Simd, NR>(b, col_stride, k_stride, cols, kc, dst);
  };
  return uk;
}

}  // namespace
}  // namespace ext::cpu
