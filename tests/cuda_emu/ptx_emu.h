// The warp-level instructions of ext/csrc/cuda/ptx.cuh, and the warp shuffles, emulated on
// the CPU from the PTX ISA's definitions (included by cuda_emu.h; see there for the model).
//
// - mma.sync m16n8k16 (float16, bfloat16) and m16n8k8 (.tf32): the lanes' fragments are
//   gathered into A, B and C by the ISA's fragment layouts, and D = C + A·B is computed with a
//   float32 accumulator in k order, d = c, then d += a_k * b_k (16-bit and TF32 products are
//   exact in float32). A .tf32 operand's low 13 mantissa bits are ignored, as the ISA says. A
//   tensor core rounds inside an mma differently; the exact-input tests do not depend on it,
//   and the precision tests hold the GPU to an error bound instead.
// - cvt.rna.tf32.f32: round to nearest, ties away from zero, into the top 19 bits.
// - ldmatrix .x4 (.trans): each lane reads the 16-byte row at its own address (which must be
//   16-byte aligned and inside the block's shared memory), then the rows are dealt out as the
//   ISA says: lane l gets, of each matrix, elements 2(l%4) and 2(l%4)+1 of row l/4 (of
//   column l/4 with .trans).
// - cp.async: a copy is only recorded when issued; it happens when a cp.async.wait_group
//   that covers its group runs, in the issuing thread: as late as the rules allow, so a
//   missing or too-weak wait reads the shared memory's poison, and a missing barrier after
//   the wait is a data race ThreadSanitizer reports. Addresses must be aligned to the copy's
//   size (16 or 4 bytes), the destination inside shared memory.
// - Shuffles: full-warp masks only (0xffffffff), as every kernel here uses.
#pragma once

#include <deque>

#define EXT_PTX_EMULATED 1

namespace emu {

// The warp of the calling thread, and the calling thread's lane in it.
inline Warp& this_warp() { return running_block->warp_of(linear_thread_index()); }
inline unsigned this_lane() { return linear_thread_index() % Warp::kLanes; }

inline uint16_t low_half(uint32_t word) { return uint16_t(word & 0xffffu); }
inline uint16_t high_half(uint32_t word) { return uint16_t(word >> 16); }
inline uint32_t pack_halves(uint16_t low, uint16_t high) { return uint32_t(low) | (uint32_t(high) << 16); }

inline void check_shared_row(const char* instruction, const void* address, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(address) % 16 != 0) {
    fail(std::string(instruction) + ": lane " + std::to_string(this_lane()) + "'s address is not 16-byte aligned");
  }
  if (!running_block->in_shared_memory(address, bytes)) {
    fail(std::string(instruction) + ": lane " + std::to_string(this_lane()) +
         "'s address is outside the block's shared memory");
  }
}

// ---- cp.async: recorded on issue, performed by the wait that covers it ----

struct AsyncCopy {
  void* dst;
  const void* src;
  int size;  // bytes written: src_bytes copied, the rest zero-filled
  int src_bytes;
};

inline thread_local std::vector<AsyncCopy> uncommitted_copies;
inline thread_local std::deque<std::vector<AsyncCopy>> copy_groups_in_flight;

inline void thread_exit_hook() {
  uncommitted_copies.clear();
  copy_groups_in_flight.clear();
}

}  // namespace emu

namespace ext::cuda::ptx {

template <typename T>
inline float element_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__half{bits});
  } else {
    return __bfloat162float(__nv_bfloat16{bits});
  }
}

inline uint32_t float_bits(float x) { return std::bit_cast<uint32_t>(x); }

inline uint32_t to_tf32(uint32_t bits) {
  if ((bits & 0x7f800000u) == 0x7f800000u) return bits;  // infinities and NaNs as they are
  return (bits + 0x1000u) & ~0x1fffu;  // half of the dropped 13 bits' unit: ties go away from zero
}

// D += A·B for one tile, the layouts the ISA's for .row.col with float32 C/D:
//   A (16 x K): register r holds row group + 8 (r % 2), columns from t + (K/2)(r / 2), where t
//     is 2 threadID_in_group (two 16-bit values, low half first) or threadID_in_group (TF32);
//   B (K x 8): register r holds column group, rows from t + (K/2) r;
//   C, D: element i is row group + 8 (i / 2), column 2 threadID_in_group + i % 2.
template <typename T>
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float>);
  constexpr bool kTf32 = std::is_same_v<T, float>;
  constexpr int K = kTf32 ? 8 : 16;
  constexpr int kPerRegister = kTf32 ? 1 : 2;
  emu::Warp::Words mine{};
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  for (int i = 0; i < 4; ++i) mine[6 + i] = std::bit_cast<uint32_t>(d[i]);
  const auto value = [](uint32_t word, int half) {
    if constexpr (kTf32) {
      return std::bit_cast<float>(word & ~0x1fffu);  // the low 13 bits are ignored
    } else {
      return element_to_float<T>(half == 0 ? emu::low_half(word) : emu::high_half(word));
    }
  };
  const auto result = emu::this_warp().exchange(
      kTf32 ? "mma.sync.m16n8k8.tf32" : "mma.sync.m16n8k16", emu::this_lane(), mine,
      [&](const emu::Warp::Lanes& in, emu::Warp::Lanes& out) {
        float A[16][K], B[K][8], C[16][8];
        for (int lane = 0; lane < 32; ++lane) {
          const int group = lane >> 2, in_group = lane % 4;
          for (int r = 0; r < 4; ++r) {
            for (int h = 0; h < kPerRegister; ++h) {
              A[group + 8 * (r % 2)][kPerRegister * in_group + h + (K / 2) * (r / 2)] = value(in[lane][r], h);
            }
          }
          for (int r = 0; r < 2; ++r) {
            for (int h = 0; h < kPerRegister; ++h) {
              B[kPerRegister * in_group + h + (K / 2) * r][group] = value(in[lane][4 + r], h);
            }
          }
          for (int i = 0; i < 4; ++i) {
            C[group + 8 * (i / 2)][2 * in_group + i % 2] = std::bit_cast<float>(in[lane][6 + i]);
          }
        }
        for (int lane = 0; lane < 32; ++lane) {
          const int group = lane >> 2, in_group = lane % 4;
          for (int i = 0; i < 4; ++i) {
            const int row = group + 8 * (i / 2), col = 2 * in_group + i % 2;
            float sum = C[row][col];
            for (int k = 0; k < K; ++k) sum += A[row][k] * B[k][col];
            out[lane][i] = std::bit_cast<uint32_t>(sum);
          }
        }
      });
  for (int i = 0; i < 4; ++i) d[i] = std::bit_cast<float>(result[i]);
}

inline void ldmatrix_x4_impl(const char* instruction, bool transposed, uint32_t (&r)[4], const void* row) {
  emu::check_shared_row(instruction, row, 16);
  emu::Warp::Words mine{};
  std::memcpy(mine.data(), row, 16);  // this lane's row: 8 elements, two to a word
  const auto result = emu::this_warp().exchange(
      instruction, emu::this_lane(), mine, [transposed](const emu::Warp::Lanes& in, emu::Warp::Lanes& out) {
        // element (r, c) of matrix m is element c of the row lane 8m + r brought
        const auto element = [&](int m, int r, int c) {
          const uint32_t word = in[8 * m + r][c / 2];
          return c % 2 == 0 ? emu::low_half(word) : emu::high_half(word);
        };
        for (int lane = 0; lane < 32; ++lane) {
          for (int m = 0; m < 4; ++m) {
            const int first = 2 * (lane % 4), fixed = lane / 4;
            out[lane][m] = transposed
                               ? emu::pack_halves(element(m, first, fixed), element(m, first + 1, fixed))
                               : emu::pack_halves(element(m, fixed, first), element(m, fixed, first + 1));
          }
        }
      });
  for (int i = 0; i < 4; ++i) r[i] = result[i];
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4_impl("ldmatrix.x4", false, r, row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  ldmatrix_x4_impl("ldmatrix.x4.trans", true, r, row);
}

inline void cp_async(int size, void* dst, const void* src, int src_bytes) {
  const std::string name = "cp.async (" + std::to_string(size) + " bytes)";
  if (reinterpret_cast<uintptr_t>(dst) % size != 0) {
    emu::fail(name + ": a destination address is not " + std::to_string(size) + "-byte aligned");
  }
  if (!emu::running_block->in_shared_memory(dst, size_t(size))) {
    emu::fail(name + ": a destination is outside the block's shared memory");
  }
  if (reinterpret_cast<uintptr_t>(src) % size != 0) {
    emu::fail("cp.async: a source address is not " + std::to_string(size) + "-byte aligned");
  }
  if (src_bytes < 0 || src_bytes > size) emu::fail(name + ": src-size must be 0 to " + std::to_string(size) + " bytes");
  emu::uncommitted_copies.push_back({dst, src, size, src_bytes});
}

inline void cp_async_16(void* dst, const void* src, int src_bytes) { cp_async(16, dst, src, src_bytes); }
inline void cp_async_4(void* dst, const void* src, int src_bytes) { cp_async(4, dst, src, src_bytes); }

inline void cp_async_commit() {
  emu::copy_groups_in_flight.push_back(std::move(emu::uncommitted_copies));
  emu::uncommitted_copies.clear();
}

template <int kInFlight>
inline void cp_async_wait() {
  while (emu::copy_groups_in_flight.size() > size_t(kInFlight)) {
    for (const emu::AsyncCopy& copy : emu::copy_groups_in_flight.front()) {
      std::memcpy(copy.dst, copy.src, size_t(copy.src_bytes));
      std::memset(static_cast<unsigned char*>(copy.dst) + copy.src_bytes, 0, size_t(copy.size - copy.src_bytes));
    }
    emu::copy_groups_in_flight.pop_front();
  }
}

}  // namespace ext::cuda::ptx

// ---- warp shuffles (CUDA's intrinsics), for values of up to 8 bytes ----

namespace emu {

// Every lane offers `value`; lane l receives the value of lane source(l), or its own if that
// is outside l's segment of `width` lanes.
template <typename V, typename Source>
V shuffle(const char* instruction, unsigned mask, V value, int width, Source source) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable_v<V>);
  if (mask != 0xffffffffu) fail(std::string(instruction) + ": the emulation supports full-warp masks only");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
    fail(std::string(instruction) + ": width must be a power of 2 up to 32");
  }
  Warp::Words mine{};
  std::memcpy(mine.data(), &value, sizeof(V));
  const auto deal = [&](const Warp::Lanes& in, Warp::Lanes& out) {
    for (int lane = 0; lane < 32; ++lane) {
      const int segment = lane & ~(width - 1);
      const int from = source(lane);
      out[lane] = from >= segment && from < segment + width ? in[from] : in[lane];
    }
  };
  const auto result = this_warp().exchange(instruction, this_lane(), mine, deal);
  V received;
  std::memcpy(&received, result.data(), sizeof(V));
  return received;
}

}  // namespace emu

template <typename V>
V __shfl_sync(unsigned mask, V value, int src_lane, int width = 32) {
  return emu::shuffle("shfl.sync.idx", mask, value, width,
                      [=](int lane) { return (lane & ~(width - 1)) + (src_lane % width); });
}

template <typename V>
V __shfl_xor_sync(unsigned mask, V value, int lane_mask, int width = 32) {
  return emu::shuffle("shfl.sync.bfly", mask, value, width, [=](int lane) { return lane ^ lane_mask; });
}

template <typename V>
V __shfl_down_sync(unsigned mask, V value, unsigned delta, int width = 32) {
  return emu::shuffle("shfl.sync.down", mask, value, width, [=](int lane) { return lane + int(delta); });
}
