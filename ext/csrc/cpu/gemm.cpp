// BLIS/Goto-style GEMM: the five loops around a register-tile microkernel.
//
//   jc (NC columns of B: the packed B block stays in L3)
//    pc (KC deep: one packed B block, KC x NC)
//     ic (MC rows of A: the packed A block stays in L2)
//      jr (NR columns: one B micro-panel, KC x NR, stays in L1)
//       ir (MR rows: one microkernel call, an MR x NR tile of C in registers)
//
// Threads split C into slabs of whole tiles (columns of NR, or rows of MR); each
// runs the five loops on its slab. No thread ever splits K, so every element of
// C sees the same operations in the same order whatever the thread count.
#include "gemm.h"

#include "microkernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

namespace ext::cpu {

namespace {

// Cache sizes the blocking targets: Zen3 per core (32 KiB L1d, 512 KiB L2) and
// its shared 32 MiB L3. Larger caches (this Xeon host: 48 KiB L1d, 2 MiB L2)
// hold the same blocks with room to spare.
constexpr int64_t kL1dBytes = 32 * 1024;
constexpr int64_t kL2Bytes = 512 * 1024;

// KC: depth of one block. 1 KiB of K per row or column, so a B micro-panel
// (KC x NR, 16 KiB for NR = 16 floats or 8 doubles) fills half of L1d and stays
// there while the A micro-panels stream past; the other half takes A and C.
template <typename T>
constexpr int64_t kKC = 1024 / sizeof(T);  // 256 floats, 128 doubles
static_assert(kKC<float> * 16 * sizeof(float) == kL1dBytes / 2);

// MC: rows of one packed A block (MC x KC). MC * 1 KiB = 240 KiB, under half of
// L2 so the B micro-panels and C tiles fit beside it; a multiple of every MR.
constexpr int64_t kMC = 240;
static_assert(kMC * kKC<float> * static_cast<int64_t>(sizeof(float)) <= kL2Bytes / 2);

// NC: columns of one packed B block (KC x NC = 4 MiB per thread), an eighth of
// the 32 MiB L3 for each of two threads; a multiple of every NR. Wider than
// every layer here, so B is packed once per K block.
constexpr int64_t kNC = 4096;

// Below this many flops one thread finishes before a second one wakes up (a few
// microseconds), so small products stay on the calling thread.
constexpr double kParallelMinFlops = 4e6;

CpuPath g_active_path = best_cpu_path();

template <typename T>
Microkernel<T> microkernel(CpuPath path) {
  switch (path) {
    case CpuPath::Avx512: return avx512_microkernel<T>();
    case CpuPath::Avx2Fma: return avx2_microkernel<T>();
    case CpuPath::Portable: break;
  }
  return portable_microkernel<T>();
}

// Per-thread packing buffer, 64-byte aligned, grown on demand and reused
// across calls so the hot path never allocates.
class PackBuffer {
 public:
  ~PackBuffer() { std::free(data_); }
  template <typename T>
  T* get(int64_t count) {
    const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
    if (bytes > capacity_) {
      std::free(data_);
      data_ = std::aligned_alloc(64, bytes);
      if (!data_) throw std::bad_alloc();
      capacity_ = bytes;
    }
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

thread_local PackBuffer t_packed_a, t_packed_b;

// The five loops on one slab of C: rows [m0, m1), columns [n0, n1).
template <typename T>
void gemm_slab(const Microkernel<T>& uk, int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K,
               const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t b_rs, int64_t b_cs,
               const T* bias, bool relu, T* C, int64_t ldc) {
  const int64_t MR = uk.mr, NR = uk.nr, KC = kKC<T>;
  // A row-major with rows of whole MR panels is read in place: packing it would
  // cost as much as the small products it feeds. Only a ragged last panel is packed.
  const bool read_a_in_place = a_cs == 1;
  T* packed_b = t_packed_b.get<T>(std::min(kNC, (n1 - n0 + NR - 1) / NR * NR) * KC);
  T* packed_a = t_packed_a.get<T>((read_a_in_place ? MR : kMC) * KC);
  TileArgs<T> tile{};
  tile.ldc = ldc;
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = std::min(kNC, n1 - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min(KC, K - pc);
      uk.pack_b(B + pc * b_rs + jc * b_cs, b_rs, b_cs, kc, nc, packed_b);
      tile.kc = kc;
      tile.accumulate = pc > 0;
      tile.relu = relu && pc + kc == K;
      for (int64_t ic = m0; ic < m1; ic += kMC) {
        const int64_t mc = std::min(kMC, m1 - ic);
        const T* a_block = A + ic * a_rs + pc * a_cs;
        if (!read_a_in_place) uk.pack_a(a_block, a_rs, a_cs, mc, kc, packed_a);
        for (int64_t jr = 0; jr < nc; jr += NR) {
          tile.b = packed_b + jr * kc;
          tile.cols = std::min(NR, nc - jr);
          tile.bias = pc == 0 && bias ? bias + jc + jr : nullptr;
          for (int64_t ir = 0; ir < mc; ir += MR) {
            tile.rows = std::min(MR, mc - ir);
            tile.c = C + (ic + ir) * ldc + jc + jr;
            if (!read_a_in_place) {
              tile.a = packed_a + ir * kc;
              tile.a_k_stride = MR;
              uk.tile_unit_row_stride(tile);
            } else if (tile.rows == MR) {
              tile.a = a_block + ir * a_rs;
              tile.a_row_stride = a_rs;
              uk.tile_unit_k_stride(tile);
            } else {
              uk.pack_a(a_block + ir * a_rs, a_rs, a_cs, tile.rows, kc, packed_a);
              tile.a = packed_a;
              tile.a_k_stride = MR;
              uk.tile_unit_row_stride(tile);
            }
          }
        }
      }
    }
  }
}

// C = bias (or 0), then relu: what the product is when K == 0.
template <typename T>
void fill_bias(int64_t M, int64_t N, const T* bias, bool relu, T* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const T value = bias ? bias[n] : T(0);
      C[m * ldc + n] = relu ? std::max(value, T(0)) : value;
    }
}

}  // namespace

bool cpu_supports(CpuPath path) {
  __builtin_cpu_init();  // we may run from a static initializer, before libgcc's own
  switch (path) {
    case CpuPath::Avx512: return __builtin_cpu_supports("avx512f");
    case CpuPath::Avx2Fma: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuPath::Portable: return true;
  }
  return false;
}

CpuPath best_cpu_path() {
  for (CpuPath path : {CpuPath::Avx512, CpuPath::Avx2Fma})
    if (cpu_supports(path)) return path;
  return CpuPath::Portable;
}

CpuPath active_cpu_path() { return g_active_path; }

void set_cpu_path(CpuPath path) {
  if (!cpu_supports(path))
    throw std::runtime_error(std::string("this CPU cannot run the ") + cpu_path_name(path) + " path");
  g_active_path = path;
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::Avx512: return "avx512";
    case CpuPath::Avx2Fma: return "avx2+fma";
    case CpuPath::Portable: break;
  }
  return "portable";
}

std::optional<CpuPath> cpu_path_from_name(std::string_view name) {
  for (CpuPath path : {CpuPath::Portable, CpuPath::Avx2Fma, CpuPath::Avx512})
    if (name == cpu_path_name(path)) return path;
  return std::nullopt;
}

template <typename T>
void gemm(int64_t M, int64_t N, int64_t K,
          const T* A, int64_t a_rs, int64_t a_cs,
          const T* B, int64_t b_rs, int64_t b_cs,
          const T* bias, bool relu, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return fill_bias(M, N, bias, relu, C, ldc);
  const Microkernel<T> uk = microkernel<T>(g_active_path);
  const int64_t m_panels = (M + uk.mr - 1) / uk.mr, n_panels = (N + uk.nr - 1) / uk.nr;
  const bool small = 2.0 * M * N * K < kParallelMinFlops;
  const int64_t threads = small ? 1 : at::get_num_threads();
  // Split the wider side: each slab re-packs the other operand's part, so split
  // where that part is smaller (A is M x K, B is K x N) while every slab has a panel.
  const bool split_columns = n_panels >= threads && (M <= N || m_panels < threads);
  const int64_t panels = split_columns ? n_panels : m_panels;
  const int64_t slabs = std::min(threads, panels);
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    for (int64_t slab = first; slab < last; ++slab) {
      const int64_t p0 = panels * slab / slabs, p1 = panels * (slab + 1) / slabs;
      if (split_columns) {
        gemm_slab(uk, 0, M, p0 * uk.nr, std::min(N, p1 * uk.nr), K, A, a_rs, a_cs, B, b_rs, b_cs,
                  bias, relu, C, ldc);
      } else {
        gemm_slab(uk, p0 * uk.mr, std::min(M, p1 * uk.mr), 0, N, K, A, a_rs, a_cs, B, b_rs, b_cs,
                  bias, relu, C, ldc);
      }
    }
  });
}

// Adds the rows of A into out. Along contiguous rows the inner loop runs over
// columns (vectorised, one accumulator per column); otherwise each column is a
// contiguous run summed in place. Either way each out[n] adds its M values in
// row order, independent of threads.
template <typename T>
void sum_rows(int64_t M, int64_t N, const T* A, int64_t a_rs, int64_t a_cs, T* out) {
  constexpr int64_t kColumnsPerTask = 1024;  // 4-8 KiB of accumulators: L1-resident
  const int64_t grain = M * N < 65536 ? N : kColumnsPerTask;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (a_cs == 1) {
      std::fill(out + n0, out + n1, T(0));
      for (int64_t m = 0; m < M; ++m) {
        const T* row = A + m * a_rs;
        for (int64_t n = n0; n < n1; ++n) out[n] += row[n];
      }
    } else {
      for (int64_t n = n0; n < n1; ++n) {
        T sum = 0;
        for (int64_t m = 0; m < M; ++m) sum += A[m * a_rs + n * a_cs];
        out[n] = sum;
      }
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
