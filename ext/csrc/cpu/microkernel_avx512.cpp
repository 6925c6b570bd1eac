// AVX-512 microkernels: an 8 x 2-vector accumulator tile (16 of the 32 zmm
// registers): 16 independent FMA chains cover the 4-cycle latency of two FMA
// ports twice over. MR = 8 divides every batch size and layer width we run
// (128, 256, 512, 1000, 1024, ...), so no row tile is ragged; measured here it
// beat 12 rows (fewer FMAs per load, but a ragged last tile at M = 128).
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

// float 8x32 and 8x16, double 8x16 and 8x8.
template <> Microkernels<float> avx512_microkernels<float>() {
  return {make_microkernel<Avx512Float, 8, 2>(), make_microkernel<Avx512Float, 8, 1>()};
}
template <> Microkernels<double> avx512_microkernels<double>() {
  return {make_microkernel<Avx512Double, 8, 2>(), make_microkernel<Avx512Double, 8, 1>()};
}

}  // namespace ext::cpu

#pragma GCC pop_options
