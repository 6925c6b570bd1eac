// Measures the FMA peak the benchmark compares kernels against.
#include "gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace ext::cpu {

namespace {

// Enough independent accumulators to cover FMA latency (4 cycles) times the two
// FMA ports of Zen3: 8 chains keep both ports busy every cycle.
constexpr int kChains = 10;
constexpr int64_t kIterations = 20'000'000;

__attribute__((target("avx2,fma"))) double fma_loop_avx2(int64_t iterations) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float sink[8];
  __m256 total = acc[0];
  for (int i = 1; i < kChains; ++i) total = _mm256_add_ps(total, acc[i]);
  _mm256_storeu_ps(sink, total);
  return sink[0];  // keeps the loop alive
}

}  // namespace

double measure_fma_peak_gflops(int64_t num_threads) {
  if (best_cpu_path() != CpuPath::Avx2Fma) return 0.0;
  num_threads = std::max<int64_t>(1, num_threads);
  std::atomic<double> sink{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < num_threads; ++t)
    threads.emplace_back([&] { sink = sink + fma_loop_avx2(kIterations); });
  for (auto& thread : threads) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double flops = 2.0 * 8 * kChains * static_cast<double>(kIterations) * num_threads;
  return flops / seconds / 1e9 + 0.0 * sink;
}

}  // namespace ext::cpu
