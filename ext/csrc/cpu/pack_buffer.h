// A per-thread scratch buffer, 64-byte aligned, grown on demand and reused across calls, so a
// warm kernel allocates nothing: the GEMM's packed panels (gemm.cpp) and the convolution's im2col
// and output buffers (conv.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace ext::cpu {

class PackBuffer {
 public:
  PackBuffer() = default;
  PackBuffer(const PackBuffer&) = delete;
  PackBuffer& operator=(const PackBuffer&) = delete;
  ~PackBuffer() { std::free(data_); }
  template <typename T>
  T* get(int64_t count) {
    const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
    if (bytes > capacity_) {
      std::free(data_);
      capacity_ = 0;  // until the allocation below succeeds
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

}  // namespace ext::cpu
