// The interface between the blocked GEMM driver (gemm.cpp) and the register-tile
// microkernels, one family per instruction set (microkernel_<isa>.cpp). Every
// family is the same template (microkernel_impl.h) compiled for its own target.
#pragma once

#include <cstdint>

namespace ext::cpu {

// Most vectors per row of a register tile (NR = NV x lanes), over all paths.
constexpr int kMaxTileVectors = 4;

// One register tile: C[rows x cols] = (accumulate ? C : bias) + A·B over a depth of kc,
// then max(., 0) if relu. With accumulate, A·B is summed in registers and added to C at
// the store; without, each sum starts from its bias (a value per column, or per row, or
// 0). A[i, k] = a[i * a_row_stride + k *
// a_k_stride] (a packed panel, or the caller's matrix read in place); B's row k
// is NR values at b + k * b_k_stride (a packed panel, b_k_stride = NR, or the
// caller's row-major matrix read in place). rows <= MR and cols <= NR; rows
// beyond `rows` of A and columns beyond `cols` of B must be readable (packed
// panels are zero-padded).
template <typename T>
struct TileArgs {
  int64_t kc;
  const T* a;
  int64_t a_row_stride, a_k_stride;
  const T* b;
  int64_t b_k_stride;
  // Indexed B (the indexed tiles only): row k's v-th vector is the `lanes` values at
  // b_vectors[v] + b_offsets[k]. The direct convolution reads its input so, in place
  // (conv.cpp: shifted planes), where a packed B would be im2col's nine copies.
  const int64_t* b_offsets;
  const T* b_vectors[kMaxTileVectors];
  T* c;
  int64_t ldc;
  int64_t rows, cols;
  const T* bias;  // cols values, used when !accumulate; nullptr means zero
  const T* row_bias;  // or rows values, one per row (a product computed as Cᵀ, gemm.cpp)
  bool accumulate;
  bool relu;
  // Where set (Microkernel::copying_b_tiles only), B's rows are also stored here as the tile
  // reads them, as a packed panel (row k at b_copy + k * NR): the first row tile of a panel
  // packs it for the others (gemm.cpp).
  T* b_copy;
  // Where set (Microkernel::copying_a_tiles only), A's MR values of each k, read in place with
  // unit row stride, are also stored here as a packed panel (k at a_copy + k * MR): the first
  // column panel's row tiles pack A for the others (gemm.cpp).
  T* a_copy;
};

// Row counts each microkernel has an instance for: MR, about 3 MR / 4, MR / 2 and MR / 4.
constexpr int kRowVariants = 4;

template <typename T>
struct Microkernel {
  using TileFn = void (*)(const TileArgs<T>&);
  int64_t mr, nr;  // register tile: MR rows x NR columns of C
  int64_t lanes;   // NR = NV vectors of `lanes` values
  // Tiles that are not full run the smallest instance that covers them, reading
  // the same panels (any a_k_stride and b_k_stride): [r][v - 1] computes
  // rows_of_variant[r] rows and v vectors of columns (cols <= v * lanes). A
  // ragged last column panel of a wide tile runs only the vectors it needs,
  // and none through the local edge copy when its width is whole vectors; a
  // ragged row panel runs fewer rows than MR (the 10 rows of a 10-class head's
  // dW: 8 + 2; 14 rows: 8 + 6, where 6 rows ran the 8-row tile through the
  // edge copy before the 3/4 instance). Descending: [0] is MR.
  int64_t rows_of_variant[kRowVariants];
  // A with unit row stride (a packed panel, or a column-major operand).
  TileFn unit_row_stride_tiles[kRowVariants][kMaxTileVectors];
  // A with unit k stride (a row-major operand read in place, no packing).
  TileFn unit_k_stride_tiles[kRowVariants][kMaxTileVectors];
  // The same two with indexed B (TileArgs::b_offsets).
  TileFn indexed_b_unit_row_stride_tiles[kRowVariants][kMaxTileVectors];
  TileFn indexed_b_unit_k_stride_tiles[kRowVariants][kMaxTileVectors];
  // The same two with a bias by row (TileArgs::row_bias): a product computed as Cᵀ.
  TileFn row_bias_unit_row_stride_tiles[kRowVariants][kMaxTileVectors];
  TileFn row_bias_unit_k_stride_tiles[kRowVariants][kMaxTileVectors];
  // Full tiles (MR x NR, B read in place, no bias by row) that also copy B into a packed
  // panel (TileArgs::b_copy): [0] A with unit row stride, [1] with unit k stride.
  TileFn copying_b_tiles[2];
  // Full tiles with A read in place with unit row stride (a column-major A: dW's dYᵀ) that also
  // copy A into a packed panel (TileArgs::a_copy): [0] B packed, [1] B copied too (b_copy).
  TileFn copying_a_tiles[2];
  // A one-vector column panel (NR of `lanes`: a wide tile's last 16 columns at N = 256 or 784, or
  // all of a narrow product) has only MR sums per tile, too few on a core that issues two 512-bit
  // FMAs a cycle: 2 MR rows x one vector, A read in place (unit k stride), for two row tiles at once.
  int64_t tall_one_vector_rows;
  TileFn tall_one_vector_tile;
  int row_variant(int64_t rows) const {  // the smallest instance that covers `rows`
    int variant = 0;
    while (variant + 1 < kRowVariants && rows <= rows_of_variant[variant + 1]) ++variant;
    return variant;
  }
  TileFn tile_unit_k_stride(int64_t rows, int64_t cols) const {
    return unit_k_stride_tiles[row_variant(rows)][(cols - 1) / lanes];
  }
  TileFn tile_indexed_b(bool unit_row_stride, int64_t rows, int64_t cols) const {
    return (unit_row_stride ? indexed_b_unit_row_stride_tiles : indexed_b_unit_k_stride_tiles)[row_variant(rows)]
                                                                                                [(cols - 1) / lanes];
  }
  // A shallow product's row panel (K of a few values: dX of a 10-class head): shallow_rows
  // rows of C across all of t.cols, a whole number of vectors, in tiles shallow_nr wide (then
  // one vector), A and B read in place (unit k stride, b_k_stride B's row stride). One call
  // a panel rather than a tile: at K = 10 the driver's work per tile cost as much again.
  int64_t shallow_rows, shallow_nr;
  TileFn shallow_row_panel;
  // Its instances: [0] for 8 sums in flight (4 cycles of latency, 2 FMAs a cycle of 256 bits or
  // 1 of 512), [1] for 16 (2 of 512 bits: Zen 5). shallow_nr and shallow_row_panel are [0] until
  // gemm.cpp picks by the FMAs the core issues a cycle (with_shallow_tiles_for).
  int64_t shallow_nrs[2];
  TileFn shallow_row_panels[2];
  // Packs A[rows x kc] into MR-row panels (k-major inside a panel), zero-padded.
  void (*pack_a)(const T* a, int64_t row_stride, int64_t k_stride, int64_t rows, int64_t kc, T* dst);
  // Packs B[kc x cols] into NR-column panels (k-major inside a panel), zero-padded.
  void (*pack_b)(const T* b, int64_t k_stride, int64_t col_stride, int64_t kc, int64_t cols, T* dst);
};

// Each path has a wide tile for most products, a narrow one (NR of one vector)
// for outputs with few columns, like a 10-class head, where the wide tile would
// spend most of its FMAs on padding, and one for products with many rows
// (kManyRowsMinRows in gemm.cpp), where a wider, shorter tile pays, and one for
// C of exactly its MR rows (a 10-class head's dW), a taller, narrower tile whose
// one row panel covers them all, where the wide tile ran 8 + 2 rows (the wide
// tile again on paths where none was measured faster).
template <typename T>
struct Microkernels {
  Microkernel<T> wide, narrow, many_rows, tall;
  // out[n] = sum over r of a[r * row_stride + n] for n < cols (contiguous rows,
  // db's reduction), each column adding its rows in order.
  void (*sum_rows)(const T* a, int64_t row_stride, int64_t rows, int64_t cols, T* out);
  // ReLU's backward: masked[r, c] = 0 where output[r, c] <= 0, else dy[r, c]; with sums,
  // also sums[c] = the column sums of masked, added as sum_rows adds. Rows contiguous.
  void (*relu_backward_sum_rows)(const T* dy, int64_t dy_row_stride, const T* output, int64_t output_row_stride,
                                 int64_t rows, int64_t cols, T* masked, int64_t masked_row_stride, T* sums);
  // dst[j * dst_row_stride + i] = src[i * src_row_stride + j] for i < rows, j < cols.
  void (*transpose)(const T* src, int64_t src_row_stride, int64_t rows, int64_t cols, T* dst, int64_t dst_row_stride);
};

template <typename T> Microkernels<T> portable_microkernels();
template <typename T> Microkernels<T> avx2_microkernels();
template <typename T> Microkernels<T> avx512_microkernels();

}  // namespace ext::cpu
