// AVX2+FMA microkernels: 16 ymm registers hold a 6 x 2-vector accumulator tile
// (12 registers) plus two B vectors and one broadcast A value.
#include "microkernel.h"

#include <immintrin.h>

// Standard headers come in before the target pragma: compiled inside it, their
// inline functions could merge with the portable build's and run AVX code there.
#include <algorithm>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "avx_transpose.h"
#include "microkernel_impl.h"

namespace ext::cpu {
namespace {

struct Avx2Float : AvxTranspose<float> {
  using T = float;
  using V = __m256;
  static constexpr int kLanes = 8;
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V broadcast(T x) { return _mm256_set1_ps(x); }
};

struct Avx2Double : AvxTranspose<double> {
  using T = double;
  using V = __m256d;
  static constexpr int kLanes = 4;
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V broadcast(T x) { return _mm256_set1_pd(x); }
};

}  // namespace

// float 6x16 and 6x8, double 6x8 and 6x4; the wide tile serves many rows and the tall tile's rows too.
template <> Microkernels<float> avx2_microkernels<float>() {
  const Microkernel<float> wide = make_microkernel<Avx2Float, 6, 2>();
  return {wide, make_microkernel<Avx2Float, 6, 1>(), wide, wide, &sum_rows_contiguous<Avx2Float>,
          &relu_backward_sum_rows<Avx2Float>, &transpose_matrix<Avx2Float>};
}
template <> Microkernels<double> avx2_microkernels<double>() {
  const Microkernel<double> wide = make_microkernel<Avx2Double, 6, 2>();
  return {wide, make_microkernel<Avx2Double, 6, 1>(), wide, wide, &sum_rows_contiguous<Avx2Double>,
          &relu_backward_sum_rows<Avx2Double>, &transpose_matrix<Avx2Double>};
}

}  // namespace ext::cpu

#pragma GCC pop_options
