// Test-only emulation of the CUDA execution model, so the real kernel headers
// (ext/csrc/cuda/*.cuh) compile with g++ and run on the CPU.
//
// - One OS thread per CUDA thread of a block; blocks run one after another.
// - threadIdx / blockIdx / blockDim / gridDim are thread_local.
// - __shared__ makes a kernel's shared arrays static: since only one block runs
//   at a time, one static array is exactly that block's shared memory, seen by
//   all its threads (and by ThreadSanitizer as memory the threads share).
// - __syncthreads() is a real barrier among the block's threads. If not every
//   thread reaches it within EMU_BARRIER_TIMEOUT_S seconds (default 30), the
//   process prints which block and how many threads arrived, and exits with
//   kBarrierTimeoutExit: an error, never a hang.
// - __half and __nv_bfloat16 convert with round-to-nearest-even, like the GPU.
// Include this before any kernel header.
#pragma once

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// ---- 16-bit floating-point types: storage bits plus the conversions the kernels use ----

struct __half {
  uint16_t bits;
};

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));  // rebias 15 -> 127
}

inline __half __float2half_rn(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  constexpr uint32_t kFloatInf = 0x7f800000u;
  constexpr uint32_t kRoundsToHalfInf = 0x477ff000u;   // 65520: halfway between 65504 and 2^16, ties to inf
  constexpr uint32_t kSmallestHalfNormal = 0x38800000u;  // 2^-14
  if (magnitude > kFloatInf) return {uint16_t(sign | 0x7e00u)};  // NaN stays NaN
  if (magnitude >= kRoundsToHalfInf) return {uint16_t(sign | 0x7c00u)};
  if (magnitude < kSmallestHalfNormal) {  // subnormal half: count units of 2^-24, rounded to even
    const float units = std::nearbyint(std::bit_cast<float>(magnitude) * 0x1p24f);
    return {uint16_t(sign | uint16_t(units))};
  }
  const uint32_t rebiased = magnitude - (112u << 23);  // exponent 127 -> 15
  const uint32_t round_to_even = 0xfffu + ((rebiased >> 13) & 1u);
  return {uint16_t(sign | ((rebiased + round_to_even) >> 13))};
}

inline float __bfloat162float(__nv_bfloat16 b) { return std::bit_cast<float>(uint32_t(b.bits) << 16); }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {uint16_t((bits >> 16) | 0x40u)};  // NaN stays NaN
  const uint32_t round_to_even = 0x7fffu + ((bits >> 16) & 1u);
  return {uint16_t((bits + round_to_even) >> 16)};
}

// ---- blocks, barriers, launch ----

namespace emu {

constexpr int kBarrierTimeoutExit = 86;

inline double barrier_timeout_s() {
  const char* text = std::getenv("EMU_BARRIER_TIMEOUT_S");
  return text != nullptr ? std::atof(text) : 30.0;
}

// The running block: its barrier and who has left the kernel.
class Block {
 public:
  Block(dim3 index, unsigned num_threads) : index_(index), num_threads_(num_threads) {}

  void sync_threads() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == num_threads_) {
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
      return;
    }
    const auto timeout = std::chrono::duration<double>(barrier_timeout_s());
    if (!all_arrived_.wait_for(lock, timeout, [&] { return generation_ != generation; })) {
      std::fprintf(stderr,
                   "emu: __syncthreads() timed out after %g s in block (%u,%u,%u): %u of %u threads "
                   "arrived, %u had already left the kernel. A barrier must be reached by every thread "
                   "of the block (is it inside a branch some threads skip?)\n",
                   barrier_timeout_s(), index_.x, index_.y, index_.z, arrived_, num_threads_, exited_);
      std::fflush(stderr);
      std::_Exit(kBarrierTimeoutExit);
    }
  }

  void thread_exited() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++exited_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  dim3 index_;
  unsigned num_threads_;
  unsigned arrived_ = 0;
  unsigned exited_ = 0;
  uint64_t generation_ = 0;
};

inline Block* running_block = nullptr;  // set before a block's threads start, so they all see it

// kernel<<<grid, block>>>(args...): the blocks one after another, each as blockDim OS threads.
// A grid CUDA would refuse (a zero dimension, y or z over 65535) is refused here too, as the
// error a real launch reports, so host code that launches one fails its tests.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, void (*kernel)(Params...), const Args&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw std::runtime_error("emu: invalid configuration argument: grid (" + std::to_string(grid.x) + ", " +
                             std::to_string(grid.y) + ", " + std::to_string(grid.z) + ")");
  }
  const unsigned num_threads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block state(dim3(bx, by, bz), num_threads);
        running_block = &state;
        std::vector<std::thread> threads;
        threads.reserve(num_threads);
        for (unsigned t = 0; t < num_threads; ++t) {
          threads.emplace_back([&, t] {
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            blockIdx = dim3(bx, by, bz);
            blockDim = block;
            gridDim = grid;
            kernel(args...);
            state.thread_exited();
          });
        }
        for (std::thread& thread : threads) thread.join();
        running_block = nullptr;
      }
    }
  }
}

}  // namespace emu

inline void __syncthreads() { emu::running_block->sync_threads(); }
