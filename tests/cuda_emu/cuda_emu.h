// Test-only emulation of the CUDA execution model, so the real kernel headers
// (ext/csrc/cuda/*.cuh) compile with g++ and run on the CPU.
//
// - One OS thread per CUDA thread of a block; blocks run one after another.
// - threadIdx / blockIdx / blockDim / gridDim are thread_local.
// - Shared memory is the launch's dynamic shared memory (EXT_SHARED_MEMORY in the kernels):
//   each block gets a fresh heap allocation of exactly the launch's size, filled with 0xff
//   bytes, a NaN in every float format. A read before any write shows as a NaN in the result,
//   and AddressSanitizer sees a read or write past the end.
// - __syncthreads() is a real barrier among the block's threads. If not every thread reaches
//   it within EMU_BARRIER_TIMEOUT_S seconds (default 30), the process prints which block and
//   how many threads arrived, and exits with kBarrierTimeoutExit: an error, never a hang.
// - Warps: lanes are threads 32w .. 32w + 31. The warp-wide instructions (mma.sync, ldmatrix,
//   shuffles; ptx_emu.h) meet at their warp's Warp below: each lane brings its registers,
//   the last to arrive computes the instruction for all 32 from the PTX ISA's definition.
// - __half and __nv_bfloat16 convert with round-to-nearest-even, like the GPU.
// Include this before any kernel header.
#pragma once

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <new>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <array>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
// A kernel's shared memory: this block's poisoned allocation (see above).
#define EXT_SHARED_MEMORY(name) unsigned char* const name = emu::shared_memory()

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

constexpr int kBarrierTimeoutExit = 86;  // a barrier or warp-wide instruction some threads never reached
constexpr int kMisuseExit = 87;          // an instruction used against its rules (bad address, divergence)

// The SMs of the emulated GPU, for host code that sizes its work to them (split-K): an H100's
// 132 unless EMU_SM_COUNT says otherwise.
inline int sm_count() {
  const char* text = std::getenv("EMU_SM_COUNT");
  return text != nullptr ? std::atoi(text) : 132;
}

inline double barrier_timeout_s() {
  const char* text = std::getenv("EMU_BARRIER_TIMEOUT_S");
  return text != nullptr ? std::atof(text) : 30.0;
}

[[noreturn]] inline void fail(const std::string& message, int exit_code = kMisuseExit) {
  std::fprintf(stderr, "emu: %s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(exit_code);
}

inline unsigned linear_thread_index() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// One warp's meeting point for its warp-wide (.sync.aligned) instructions: every lane executes
// the same instruction, each with its own registers, and each gets its own results.
class Warp {
 public:
  static constexpr int kLanes = 32;
  static constexpr int kWords = 12;  // the most 32-bit registers a lane brings to or takes from one instruction
  using Words = std::array<uint32_t, kWords>;
  using Lanes = std::array<Words, kLanes>;

  Warp(unsigned index, unsigned lanes) : index_(index), lanes_(lanes) {}

  // Lane `lane` arrives at `instruction` with `mine`; the last lane to arrive runs
  // compute(inputs, outputs) once for the warp; every lane leaves with outputs[lane].
  template <typename Compute>
  Words exchange(const char* instruction, unsigned lane, const Words& mine, Compute compute) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (arrived_ == 0) {
      instruction_ = instruction;
    } else if (std::strcmp(instruction_, instruction) != 0) {
      fail("warp " + std::to_string(index_) + " diverged: lane " + std::to_string(lane) + " reached " +
           instruction + " while other lanes wait at " + instruction_ +
           "; a .sync.aligned instruction must be executed by every lane of the warp together");
    }
    inputs_[lane] = mine;
    const uint64_t generation = generation_;
    if (++arrived_ == lanes_) {
      compute(inputs_, outputs_);
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
      return outputs_[lane];
    }
    const auto timeout = std::chrono::duration<double>(barrier_timeout_s());
    if (!all_arrived_.wait_for(lock, timeout, [&] { return generation_ != generation; })) {
      fail(std::string(instruction) + " timed out after " + std::to_string(barrier_timeout_s()) + " s in warp " +
           std::to_string(index_) + ": " + std::to_string(arrived_) + " of " + std::to_string(lanes_) +
           " lanes arrived (is it inside a branch some lanes skip?)",
           kBarrierTimeoutExit);
    }
    return outputs_[lane];  // read under the lock: the next instruction's compute waits for every lane
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  unsigned index_;
  unsigned lanes_;
  unsigned arrived_ = 0;
  uint64_t generation_ = 0;
  const char* instruction_ = "";
  Lanes inputs_{};
  Lanes outputs_{};
};

constexpr unsigned char kSharedPoison = 0xff;  // 0xffff... is a NaN in float64, float32, float16 and bfloat16

// The running block: its barrier, its warps, its shared memory, and who has left the kernel.
class Block {
 public:
  Block(dim3 index, unsigned num_threads, size_t shared_bytes)
      : index_(index), num_threads_(num_threads), shared_bytes_(shared_bytes) {
    for (unsigned first = 0; first < num_threads; first += Warp::kLanes) {
      const unsigned lanes = std::min<unsigned>(Warp::kLanes, num_threads - first);
      warps_.push_back(std::make_unique<Warp>(first / Warp::kLanes, lanes));
    }
    if (shared_bytes > 0) {  // exactly the launch's size, so AddressSanitizer sees any access past it
      shared_ = static_cast<unsigned char*>(::operator new(shared_bytes, std::align_val_t(128)));
      std::memset(shared_, kSharedPoison, shared_bytes);
    }
  }
  ~Block() {
    if (shared_ != nullptr) ::operator delete(shared_, std::align_val_t(128));
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  unsigned char* shared_memory() const { return shared_; }
  bool in_shared_memory(const void* pointer, size_t bytes) const {
    const auto* p = static_cast<const unsigned char*>(pointer);
    return shared_ != nullptr && p >= shared_ && p + bytes <= shared_ + shared_bytes_;
  }
  Warp& warp_of(unsigned thread) { return *warps_[thread / Warp::kLanes]; }

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
  size_t shared_bytes_;
  unsigned char* shared_ = nullptr;
  std::vector<std::unique_ptr<Warp>> warps_;
  unsigned arrived_ = 0;
  unsigned exited_ = 0;
  uint64_t generation_ = 0;
};

inline Block* running_block = nullptr;  // set before a block's threads start, so they all see it

inline void thread_exit_hook();  // ptx_emu.h: drops the thread's unfinished asynchronous copies

inline unsigned char* shared_memory() { return running_block->shared_memory(); }

constexpr size_t kDefaultSharedLimit = 48 * 1024;

// kernel<<<grid, block, shared_bytes>>>(args...): the blocks one after another, each as blockDim
// OS threads with its own shared memory.
// A grid CUDA would refuse (a zero dimension, y or z over 65535) is refused here too, as the
// error a real launch reports, so host code that launches one fails its tests.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, size_t shared_bytes, void (*kernel)(Params...), const Args&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw std::runtime_error("emu: invalid configuration argument: grid (" + std::to_string(grid.x) + ", " +
                             std::to_string(grid.y) + ", " + std::to_string(grid.z) + ")");
  }
  if (shared_bytes > kDefaultSharedLimit) {  // more needs cudaFuncSetAttribute, which no host code here calls
    throw std::runtime_error("emu: too many resources requested for launch: " + std::to_string(shared_bytes) +
                             " bytes of dynamic shared memory, over the 48 KiB a kernel gets without opting in");
  }
  const unsigned num_threads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block state(dim3(bx, by, bz), num_threads, shared_bytes);
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
            thread_exit_hook();
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

#include "ptx_emu.h"  // the warp-level instructions of ext/csrc/cuda/ptx.cuh
