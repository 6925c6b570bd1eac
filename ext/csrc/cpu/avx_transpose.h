// In-register transposes for packing a transposed operand (the forward's
// B = Wᵀ): 8x8 floats or 4x4 doubles per step instead of one scalar at a time.
// Included inside an AVX target region (microkernel_avx2.cpp, microkernel_avx512.cpp).
#include <immintrin.h>

#include <cstdint>

namespace ext::cpu {
namespace {

// dst[j * dst_stride + i] = src[i * src_stride + j] for i, j < 8.
inline void transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // a(i,0) a(i+1,0) a(i,1) a(i+1,1) | cols 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // cols 2, 3 | cols 6, 7
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // u[0..3]: columns 0..3 (low half) and 4..7 (high half) of rows 0-3; u[4..7] of rows 4-7.
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * dst_stride, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * dst_stride, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for i, j < 4.
inline void transpose4x4(const double* src, int64_t src_stride, double* dst, int64_t dst_stride) {
  __m256d r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_loadu_pd(src + i * src_stride);
  const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
  const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
  _mm256_storeu_pd(dst, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(dst + dst_stride, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(dst + 2 * dst_stride, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(dst + 3 * dst_stride, _mm256_permute2f128_pd(t1, t3, 0x31));
}

inline void transpose_block(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  transpose8x8(src, src_stride, dst, dst_stride);
}
inline void transpose_block(const double* src, int64_t src_stride, double* dst, int64_t dst_stride) {
  transpose4x4(src, src_stride, dst, dst_stride);
}
// The transpose part of an AVX Simd description (see microkernel_impl.h): one
// 32-byte block square, 8x8 floats or 4x4 doubles. AVX2 and AVX-512 share it.
template <typename T>
struct AvxTranspose {
  static constexpr int kTransposeBlock = 32 / sizeof(T);
  static void transpose(const T* src, int64_t src_stride, T* dst, int64_t dst_stride) {
    transpose_block(src, src_stride, dst, dst_stride);
  }
};

}  // namespace
}  // namespace ext::cpu
