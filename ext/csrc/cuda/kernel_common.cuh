// What every CUDA kernel here shares: the accumulator type per dtype, the
// conversions to and from it, wide loads, and the strided-matrix view.
// Compiles with nvcc, and with g++ after tests/cuda_emu/cuda_emu.h, which
// emulates the CUDA execution model so the tests run these kernels on the CPU.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cstdint>
#include <type_traits>

namespace ext::cuda {

constexpr int kThreads = 256;  // per block, for every kernel: 8 warps hide latency, 256 x 255 registers fit an SM

// float16 and bfloat16 accumulate in float32; float64 stays float64.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Back to the storage type, rounding to nearest even.
template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return x;
  }
}

// A run of kRun consecutive elements moved as one aligned access: for float
// one 16-byte load (LDG.128 / LDS.128), for double two, for 16-bit types 8 bytes.
constexpr int kRun = 4;
constexpr int kMaxAccessBytes = 16;  // the widest single load or store a CUDA thread can issue

template <typename T>
struct alignas(sizeof(T) * kRun < kMaxAccessBytes ? sizeof(T) * kRun : kMaxAccessBytes) Run {
  T v[kRun];
};

// A kernel's shared memory is the launch's dynamic shared memory, laid out by a struct of
// the kernel's: the host passes sizeof that struct at launch (at most 48 KiB, the limit
// without opting in). Dynamic rather than static, so the CPU emulation can give every block
// fresh memory filled with NaNs, and a read before a write shows.
#ifdef __CUDACC__
#define EXT_SHARED_MEMORY(name) extern __shared__ __align__(128) unsigned char name[]
#endif
constexpr int kMaxSharedBytes = 48 * 1024;

template <typename Layout>
__device__ __forceinline__ Layout& shared_as(unsigned char* memory) {
  static_assert(sizeof(Layout) <= kMaxSharedBytes, "over the shared memory a launch gets without opting in");
  return *reinterpret_cast<Layout*>(memory);
}

// A read-only 2-D view with arbitrary strides, in elements: (r, c) is ptr[r * row_stride + c * col_stride].
template <typename T>
struct StridedMatrix {
  const T* ptr;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t col_stride;
};

}  // namespace ext::cuda
