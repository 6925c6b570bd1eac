// Test kernels for the emulated warp-level instructions (ptx_emu.h), one warp each. They
// build and read registers by the PTX ISA's tables, written out here on their own, so
// tests/test_cuda_emulation.py can check each instruction against a plain reference
// (A·B + C, the matrices themselves, the lanes' values) computed in Python.
#pragma once

#include "ptx.cuh"

namespace warp_tests {

template <typename T>
uint32_t pack(T low, T high) {
  return uint32_t(low.bits) | (uint32_t(high.bits) << 16);
}

// D (16 x 8) = A (16 x K) · B (K x 8) + C, all row-major; K = 16 for 16-bit T, 8 for float
// (TF32). Fragments, from the ISA: with t = threadID_in_group, register r of A holds row
// groupID (+ 8 if r is odd) at column 2t and 2t + 1 (16-bit, low half first) or t (TF32), + K/2
// if r >= 2; B's register r holds column groupID at row 2t and 2t + 1 (or t), + K/2 r; C and
// D's element i is row groupID (+ 8 if i >= 2), column 2t + i % 2.
template <typename T>
__global__ void mma_tile(const T* a, const T* b, const float* c, float* d) {
  constexpr int K = std::is_same_v<T, float> ? 8 : 16;
  const int lane = int(threadIdx.x), group = lane / 4, in_group = lane % 4;
  uint32_t ra[4], rb[2];
  float acc[4];
  for (int r = 0; r < 4; ++r) {
    const int row = group + 8 * (r % 2);
    if constexpr (K == 8) {
      ra[r] = ext::cuda::ptx::to_tf32(std::bit_cast<uint32_t>(a[row * K + in_group + 4 * (r / 2)]));
    } else {
      const int col = 2 * in_group + 8 * (r / 2);
      ra[r] = pack(a[row * K + col], a[row * K + col + 1]);
    }
  }
  for (int r = 0; r < 2; ++r) {
    if constexpr (K == 8) {
      rb[r] = ext::cuda::ptx::to_tf32(std::bit_cast<uint32_t>(b[(in_group + 4 * r) * 8 + group]));
    } else {
      const int k = 2 * in_group + 8 * r;
      rb[r] = pack(b[k * 8 + group], b[(k + 1) * 8 + group]);
    }
  }
  for (int i = 0; i < 4; ++i) acc[i] = c[(group + 8 * (i / 2)) * 8 + 2 * in_group + i % 2];
  ext::cuda::ptx::mma<T>(acc, ra, rb);
  for (int i = 0; i < 4; ++i) d[(group + 8 * (i / 2)) * 8 + 2 * in_group + i % 2] = acc[i];
}

// Four 8 x 8 matrices of 16-bit values (matrices[m][r][c], 256 in all) copied to shared memory,
// then ldmatrix.x4 (.trans) with lane l pointing at row l % 8 of matrix l / 8 (each row padded to
// 24 elements, so the rows are not simply consecutive). out[lane][register], as read.
template <bool kTransposed>
__global__ void ldmatrix_rows(const uint16_t* matrices, uint32_t* out) {
  constexpr int kRowStride = 24;
  EXT_SHARED_MEMORY(shared);
  auto* rows = reinterpret_cast<uint16_t*>(shared);
  const int lane = int(threadIdx.x);
  for (int i = lane; i < 256; i += 32) rows[(i / 8) * kRowStride + i % 8] = matrices[i];
  __syncthreads();
  uint32_t r[4];
  const uint16_t* row = rows + lane * kRowStride;  // matrix lane / 8, row lane % 8
  if constexpr (kTransposed) {
    ext::cuda::ptx::ldmatrix_x4_trans(r, row);
  } else {
    ext::cuda::ptx::ldmatrix_x4(r, row);
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// Each lane copies 3 groups of 16 bytes (group g: the first (lane + 5 g) % 17 bytes of its
// source) into shared memory, committing each, and records its destinations at three moments:
// right after the commits, after wait_group 1, and after wait_group 0. out[moment][lane][group][16].
__global__ void cp_async_groups(const unsigned char* src, unsigned char* out) {
  constexpr int kGroups = 3;
  EXT_SHARED_MEMORY(shared);
  const int lane = int(threadIdx.x);
  unsigned char* mine = shared + lane * kGroups * 16;
  for (int g = 0; g < kGroups; ++g) {
    ext::cuda::ptx::cp_async_16(mine + g * 16, src + (g * 32 + lane) * 16, (lane + 5 * g) % 17);
    ext::cuda::ptx::cp_async_commit();
  }
  const auto record = [&](int moment) {
    for (int i = 0; i < kGroups * 16; ++i) out[(moment * 32 + lane) * kGroups * 16 + i] = mine[i];
  };
  record(0);
  ext::cuda::ptx::cp_async_wait<1>();
  record(1);
  ext::cuda::ptx::cp_async_wait<0>();
  record(2);
}

// Lane l offers 1000 + l; out[l] = {idx from lane 7, xor 5, down 3, idx 3 within 8-lane segments}.
__global__ void shuffles(int* out) {
  const int lane = int(threadIdx.x);
  const int mine = 1000 + lane;
  out[lane * 4 + 0] = __shfl_sync(0xffffffffu, mine, 7);
  out[lane * 4 + 1] = __shfl_xor_sync(0xffffffffu, mine, 5);
  out[lane * 4 + 2] = __shfl_down_sync(0xffffffffu, mine, 3u);
  out[lane * 4 + 3] = __shfl_sync(0xffffffffu, mine, 3, 8);
}

// Warp-wide instructions used against their rules, so the tests see the harness's errors:
// kDiverge, lanes 0-15 shuffle while lanes 16-31 ldmatrix; kSkip, lane 31 skips the shuffle.
enum class Misuse { kDiverge, kSkip };

template <Misuse kMisuse>
__global__ void misused_warp(int* out) {
  const int lane = int(threadIdx.x);
  if (kMisuse == Misuse::kSkip && lane == 31) return;
  if (kMisuse == Misuse::kDiverge && lane >= 16) {
    EXT_SHARED_MEMORY(shared);
    uint32_t r[4];
    ext::cuda::ptx::ldmatrix_x4(r, shared);
    out[lane] = int(r[0]);
    return;
  }
  out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);
}

}  // namespace warp_tests
