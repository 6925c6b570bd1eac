// The interface between the blocked GEMM driver (gemm.cpp) and the register-tile
// microkernels, one family per instruction set (microkernel_<isa>.cpp). Every
// family is the same template (microkernel_impl.h) compiled for its own target.
#pragma once

#include <cstdint>

namespace ext::cpu {

// One register tile: C[rows x cols] = (accumulate ? C : bias row or 0) + A·B over
// a depth of kc, then max(., 0) if relu. A[i, k] = a[i * a_row_stride + k *
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
  T* c;
  int64_t ldc;
  int64_t rows, cols;
  const T* bias;  // cols values, used when !accumulate; nullptr means zero
  bool accumulate;
  bool relu;
};

template <typename T>
struct Microkernel {
  int64_t mr, nr;  // register tile: MR rows x NR columns of C
  // A with unit row stride (a packed panel, or a column-major operand).
  void (*tile_unit_row_stride)(const TileArgs<T>&);
  // A with unit k stride (a row-major operand read in place, no packing).
  void (*tile_unit_k_stride)(const TileArgs<T>&);
  // Packs A[rows x kc] into MR-row panels (k-major inside a panel), zero-padded.
  void (*pack_a)(const T* a, int64_t row_stride, int64_t k_stride, int64_t rows, int64_t kc, T* dst);
  // Packs B[kc x cols] into NR-column panels (k-major inside a panel), zero-padded.
  void (*pack_b)(const T* b, int64_t k_stride, int64_t col_stride, int64_t kc, int64_t cols, T* dst);
};

// Each path has a wide tile for most products and a narrow one (NR of one
// vector) for outputs with few columns, like a 10-class head, where the wide
// tile would spend most of its FMAs on padding.
template <typename T>
struct Microkernels {
  Microkernel<T> wide, narrow;
};

template <typename T> Microkernels<T> portable_microkernels();
template <typename T> Microkernels<T> avx2_microkernels();
template <typename T> Microkernels<T> avx512_microkernels();

}  // namespace ext::cpu
