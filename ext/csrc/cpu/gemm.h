// The CPU GEMM behind every linear op. Pure C++: no torch headers here, so the
// kernels compile fast and can be tested on their own.
#pragma once

#include <cstdint>

namespace ext::cpu {

// C (M x N, row-major, leading dimension ldc) = A (M x K) · B (K x N) + bias.
// A and B are strided views: A[m, k] = A[m * a_row_stride + k * a col_stride],
// so a transposed operand costs nothing (dW = dYᵀ·X packs straight from dY).
// bias has N elements or is nullptr. C is overwritten, never read.
// With relu set, C = max(C, 0) is applied in the same store (fused epilogue).
// Results are bit-identical from run to run and for any thread count: work is
// split over output tiles only, never over K.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K,
          const T* A, int64_t a_row_stride, int64_t a_col_stride,
          const T* B, int64_t b_row_stride, int64_t b_col_stride,
          const T* bias, bool relu,
          T* C, int64_t ldc);

// out[n] = sum over m of A[m, n], for an M x N strided view. Deterministic.
template <typename T>
void sum_rows(int64_t M, int64_t N,
              const T* A, int64_t a_row_stride, int64_t a_col_stride,
              T* out);

// Which microkernel family runs. Chosen once at load from the CPU's features;
// tests switch it to check that both paths agree.
enum class CpuPath { Portable, Avx2Fma };
CpuPath best_cpu_path();             // what this CPU supports
CpuPath active_cpu_path();           // what runs now
void set_cpu_path(CpuPath path);     // raises if the CPU lacks it
const char* cpu_path_name(CpuPath path);

// This machine's measured peak of fused multiply-adds, in GFLOP/s (2 flops per
// lane per FMA), running independent vector FMA chains on num_threads threads.
// The benchmark reports each kernel as a % of it.
double measure_fma_peak_gflops(int64_t num_threads);

}  // namespace ext::cpu
