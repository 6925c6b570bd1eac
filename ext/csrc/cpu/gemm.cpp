// Placeholder reference kernels: correct, simple, parallel over output rows.
// The BLIS-style packed AVX2 kernels replace these (issue 4).
#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <stdexcept>

namespace ext::cpu {

namespace {
CpuPath g_active_path = CpuPath::Portable;
}

CpuPath best_cpu_path() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? CpuPath::Avx2Fma
                                                                         : CpuPath::Portable;
}
CpuPath active_cpu_path() { return g_active_path; }
void set_cpu_path(CpuPath path) {
  if (path == CpuPath::Avx2Fma && best_cpu_path() != CpuPath::Avx2Fma)
    throw std::runtime_error("this CPU has no AVX2+FMA");
  g_active_path = path;
}
const char* cpu_path_name(CpuPath path) {
  return path == CpuPath::Avx2Fma ? "avx2+fma" : "portable";
}

template <typename T>
void gemm(int64_t M, int64_t N, int64_t K,
          const T* A, int64_t a_rs, int64_t a_cs,
          const T* B, int64_t b_rs, int64_t b_cs,
          const T* bias, bool relu, T* C, int64_t ldc) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      T* c = C + m * ldc;
      for (int64_t n = 0; n < N; ++n) c[n] = bias ? bias[n] : T(0);
      for (int64_t k = 0; k < K; ++k) {
        const T a = A[m * a_rs + k * a_cs];
        const T* b = B + k * b_rs;
        for (int64_t n = 0; n < N; ++n) c[n] += a * b[n * b_cs];
      }
      if (relu)
        for (int64_t n = 0; n < N; ++n) c[n] = std::max(c[n], T(0));
    }
  });
}

template <typename T>
void sum_rows(int64_t M, int64_t N, const T* A, int64_t a_rs, int64_t a_cs, T* out) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      T s = 0;
      for (int64_t m = 0; m < M; ++m) s += A[m * a_rs + n * a_cs];
      out[n] = s;
    }
  });
}

template void gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                          const float*, int64_t, int64_t, const float*, bool, float*, int64_t);
template void gemm<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t,
                           const double*, int64_t, int64_t, const double*, bool, double*, int64_t);
template void sum_rows<float>(int64_t, int64_t, const float*, int64_t, int64_t, float*);
template void sum_rows<double>(int64_t, int64_t, const double*, int64_t, int64_t, double*);

}  // namespace ext::cpu
