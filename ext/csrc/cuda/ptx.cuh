// The warp-level instructions the tensor-core GEMM uses, as small device functions: inline
// PTX under nvcc. Under g++ the CPU emulation (tests/cuda_emu/ptx_emu.h) defines these same
// functions from the PTX ISA's definitions, so the tests run the kernels that call them.
//
//   mma<T>(d, a, b)            D (16 x 8, float32) += A · B: m16n8k16 for T = __half or
//                              __nv_bfloat16, m16n8k8 .tf32 for T = float
//   to_tf32(bits)              a float32's bits rounded to TF32 (cvt.rna: to nearest, ties away)
//   ldmatrix_x4(r, row)        four 8 x 8 matrices of 16-bit elements from shared memory, lane l
//   ldmatrix_x4_trans(r, row)  giving the address of row l % 8 of matrix l / 8 (transposed: of column)
//   cp_async_16(dst, src, n)   copy n of 16 bytes global -> shared without the registers, zero-fill the rest
//   cp_async_4(dst, src, n)    the same for 4 bytes
//   cp_async_commit()          close this thread's copies issued so far into one group
//   cp_async_wait<N>()         wait until at most N of this thread's groups are still in flight
//
// Fragment layouts (which lane holds which element) are the PTX ISA's, "Matrix fragments for
// mma.m16n8k16 with floating point type" and "... mma.m16n8k8" (.tf32); gemm_tc.cuh says how it
// builds them.
#pragma once

#include "kernel_common.cuh"

#include <cstdint>
#include <type_traits>

#ifdef __CUDACC__

namespace ext::cuda::ptx {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ uint32_t float_bits(float x) { return __float_as_uint(x); }

__device__ __forceinline__ uint32_t to_tf32(uint32_t bits) {
  uint32_t rounded;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(rounded) : "f"(__uint_as_float(bits)));
  return rounded;
}

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float>);
  if constexpr (std::is_same_v<T, float>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// .cg: cached in L2 only; the tile is read once per block from shared memory.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(src_bytes));
}

// .ca: the 4-byte form (cp.async.cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kInFlight>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kInFlight));
}

}  // namespace ext::cuda::ptx

#elif !defined(EXT_PTX_EMULATED)
#error "ptx.cuh: without nvcc, include tests/cuda_emu/cuda_emu.h (which emulates these instructions) first"
#endif
