// Measures the FMA peak the benchmark compares kernels against.
#include "gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ext::cpu {

namespace {

// Independent accumulator chains: FMA latency (4 cycles) times two FMA ports
// needs 8 in flight; 10 leave slack and still fit in 16 ymm registers.
constexpr int kChains = 10;
// ~5 ms per trial; the best of several trials filters out moments when another
// process holds a core (the machine is shared).
constexpr int64_t kIterations = 4'000'000;
constexpr int kTrials = 7;

// Runs kChains independent FMA chains on vectors V (GCC vector type) for
// `iterations` rounds; inlined into a target-specific caller, whose target turns
// `acc * a + b` into one vector FMA. Returns a lane so the loop is kept.
template <typename V, int Chains = kChains>
[[gnu::always_inline]] inline float fma_chains(int64_t iterations) {
  V acc[Chains];
  for (int i = 0; i < Chains; ++i) acc[i] = V{} + static_cast<float>(i);
  const V a = V{} + 0.999999f, b = V{} + 1e-7f;
  for (int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < Chains; ++i) acc[i] = acc[i] * a + b;
  V total = acc[0];
  for (int i = 1; i < Chains; ++i) total += acc[i];
  return total[0];
}

__attribute__((target("avx2,fma"))) float fma_chains_avx2(int64_t iterations) {
  return fma_chains<__m256>(iterations);
}
template <int Chains = kChains>
__attribute__((target("avx512f"))) float fma_chains_avx512(int64_t iterations) {
  return fma_chains<__m512, Chains>(iterations);
}

// Seconds per FMA of fma_chains_avx512<Chains>: the best of a few short trials (the machine is shared).
template <int Chains>
double seconds_per_avx512_fma() {
  constexpr int64_t kRateIterations = 50'000;
  std::atomic<float> sink{0};
  double best = 1e30;
  for (int trial = 0; trial < 5; ++trial) {
    const auto start = std::chrono::steady_clock::now();
    sink = sink + fma_chains_avx512<Chains>(kRateIterations);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds / (static_cast<double>(kRateIterations) * Chains));
  }
  return best + 0.0 * sink;
}

}  // namespace

// 4 chains are bound by the FMA's latency (4 cycles on every CPU the project ran on): one FMA a
// cycle whatever the core has. 12 chains reach its throughput. Their rates' ratio is the FMAs the
// core issues a cycle, whatever its clock.
int avx512_fmas_per_cycle() {
  static const int fmas = [] {
    if (!cpu_supports(CpuPath::Avx512)) return 0;
    // LINEAR_LAB_FMAS_PER_CYCLE=1 or 2 runs what another CPU would pick (tests, comparisons).
    if (const char* forced = std::getenv("LINEAR_LAB_FMAS_PER_CYCLE")) {
      const std::string value = forced;
      if (value != "1" && value != "2")
        throw std::runtime_error("LINEAR_LAB_FMAS_PER_CYCLE='" + value + "' is not 1 or 2; unset it to measure");
      return value == "1" ? 1 : 2;
    }
    const double ratio = seconds_per_avx512_fma<4>() / seconds_per_avx512_fma<12>();
    return ratio > 1.5 ? 2 : 1;
  }();
  return fmas;
}

void run_on_threads(int64_t count, const std::function<void(int64_t)>& work) {
  std::vector<std::thread> threads;
  try {
    for (int64_t i = 0; i < count; ++i) threads.emplace_back(work, i);
  } catch (...) {
    for (std::thread& thread : threads) thread.join();
    throw;
  }
  for (std::thread& thread : threads) thread.join();
}

double measure_fma_peak_gflops(int64_t num_threads) {
  const bool avx512 = cpu_supports(CpuPath::Avx512);
  if (!avx512 && !cpu_supports(CpuPath::Avx2Fma)) return 0.0;
  const int lanes = avx512 ? 16 : 8;
  num_threads = std::max<int64_t>(1, num_threads);
  const double flops = 2.0 * lanes * kChains * static_cast<double>(kIterations) * num_threads;
  std::atomic<float> sink{0};
  double best_gflops = 0.0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const auto start = std::chrono::steady_clock::now();
    run_on_threads(num_threads, [&](int64_t) {
      const float result = avx512 ? fma_chains_avx512(kIterations) : fma_chains_avx2(kIterations);
      sink = sink + result;
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best_gflops = std::max(best_gflops, flops / seconds / 1e9);
  }
  return best_gflops + 0.0 * sink;
}

}  // namespace ext::cpu
