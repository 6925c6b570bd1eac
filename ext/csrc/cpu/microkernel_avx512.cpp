// AVX-512 microkernels. float: an 8 x 3-vector accumulator tile (24 of the 32
// zmm registers) for most products, 6 x 4 vectors (24) from kManyRowsMinRows
// rows on. Both give each B vector loaded and each A value broadcast more FMAs
// than 8 x 2 (the tile before): 24 FMAs per 11 or 10 loads instead of 16 per
// 10. Measured here alone on packed panels (KC = 512, 1 thread): 8x32 196,
// 8x48 212-215, 6x64 205-212 GFLOP/s. In the GEMM, 6x64 is the faster one at
// 512 rows and more (forward 1024^3 175 -> 182, 8x48's 175), but at 128 rows
// its ragged last row panel (128 = 21 x 6 + 2) cost dX 128x784->256 12%
// against 8x48, which never has a ragged row panel at the batch sizes we run
// (gemm.cpp kManyRowsMinRows has the measurements at 256 rows).
// double keeps 8 x 2 vectors (not measured against others).
#include "microkernel.h"

#include <immintrin.h>

// Standard headers come in before the target pragma: compiled inside it, their
// inline functions could merge with the portable build's and run AVX code there.
#include <algorithm>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

#include "avx_transpose.h"
#include "microkernel_impl.h"

namespace ext::cpu {
namespace {

struct Avx512Float : AvxTranspose<float> {
  using T = float;
  using V = __m512;
  static constexpr int kLanes = 16;
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V broadcast(T x) { return _mm512_set1_ps(x); }
};

struct Avx512Double : AvxTranspose<double> {
  using T = double;
  using V = __m512d;
  static constexpr int kLanes = 8;
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V broadcast(T x) { return _mm512_set1_pd(x); }
};

}  // namespace

// float 8x48, 8x16, 6x64 and 10x32; double 8x16, 8x8 and 8x16 (twice).
// The tall tile, 10 x 2 vectors (20 accumulators), runs a 10-class head's dW (10 x in,
// K = batch) as one row panel, where 8x48 ran a tile of 8 rows and one of 2, whose 6
// sums are too few for the FMA pipes (8 in flight). Measured on Zen 4 (dW from a batch
// of 128, best of 3 medians, µs, 8x48 -> 10x32): 1 thread, in = 256 7.65 -> 7.21 and
// 512 13.67 -> 12.91; 2 threads 5.86 -> 5.38 and 8.99 -> 8.42. At 9 rows (through
// the edge copy) 7.80 -> 7.96, and at 18-20 rows on 2 threads 1.1-1.3x slower: 10 only.
template <> Microkernels<float> avx512_microkernels<float>() {
  return {make_microkernel<Avx512Float, 8, 3>(), make_microkernel<Avx512Float, 8, 1>(),
          make_microkernel<Avx512Float, 6, 4>(), make_microkernel<Avx512Float, 10, 2>(),
          &sum_rows_contiguous<Avx512Float>, &relu_backward_sum_rows<Avx512Float>, &transpose_matrix<Avx512Float>};
}
template <> Microkernels<double> avx512_microkernels<double>() {
  const Microkernel<double> wide = make_microkernel<Avx512Double, 8, 2>();
  return {wide, make_microkernel<Avx512Double, 8, 1>(), wide, wide, &sum_rows_contiguous<Avx512Double>,
          &relu_backward_sum_rows<Avx512Double>, &transpose_matrix<Avx512Double>};
}

}  // namespace ext::cpu

#pragma GCC pop_options
