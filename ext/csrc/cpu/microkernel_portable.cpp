// Portable microkernels: plain C++ on 16-byte generic vectors (GCC/Clang vector
// extensions), which every target lowers to its own SIMD (SSE2, NEON, ...).
// 4 x 2-vector tiles fit the 16 registers of the smallest of those.
#include "microkernel_impl.h"

namespace ext::cpu {
namespace {

template <typename Scalar>
struct GenericVector {
  using T = Scalar;
  using V [[gnu::vector_size(16)]] = Scalar;
  static constexpr int kLanes = 16 / sizeof(Scalar);
  static V fma(V a, V b, V c) { return a * b + c; }
  static V broadcast(T x) {
    V v;
    for (int i = 0; i < kLanes; ++i) v[i] = x;
    return v;
  }
  static constexpr int kTransposeBlock = 4;
  static void transpose(const T* src, int64_t src_stride, T* dst, int64_t dst_stride) {
    for (int i = 0; i < kTransposeBlock; ++i)
      for (int j = 0; j < kTransposeBlock; ++j) dst[j * dst_stride + i] = src[i * src_stride + j];
  }
};

}  // namespace

// float 4x8 and 4x4, double 4x4 and 4x2; the wide tile serves many rows and the tall tile's rows too.
template <> Microkernels<float> portable_microkernels<float>() {
  const Microkernel<float> wide = make_microkernel<GenericVector<float>, 4, 2>();
  return {wide, make_microkernel<GenericVector<float>, 4, 1>(), wide, wide,
          &sum_rows_contiguous<GenericVector<float>>, &relu_backward_sum_rows<GenericVector<float>>,
          &transpose_matrix<GenericVector<float>>};
}
template <> Microkernels<double> portable_microkernels<double>() {
  const Microkernel<double> wide = make_microkernel<GenericVector<double>, 4, 2>();
  return {wide, make_microkernel<GenericVector<double>, 4, 1>(), wide, wide,
          &sum_rows_contiguous<GenericVector<double>>, &relu_backward_sum_rows<GenericVector<double>>,
          &transpose_matrix<GenericVector<double>>};
}

}  // namespace ext::cpu
