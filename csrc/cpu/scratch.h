// Per-thread float buffers of the CPU kernels (drivers and tiles), grown on
// demand and kept across calls, so no call allocates.
//
// Aligned to 64 bytes, a cache line and an AVX-512 register: with a
// std::vector's 16-byte alignment, whether every full-width load and store of
// the tiles' Q^T / O^T / S^T panels straddled two cache lines depended on the
// heap's state in that process.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace chunkattn::cpu {

template <int kSlots>
class ScratchBuffers {
 public:
  // At least n floats in buffer `slot`; growing it discards its contents.
  float* get(int slot, size_t n) {
    Buffer& b = buffers_[slot];
    if (b.capacity < n) {
      constexpr size_t kAlign = 64;
      const size_t bytes = (n * sizeof(float) + kAlign - 1) / kAlign * kAlign;
      b.data.reset(static_cast<float*>(std::aligned_alloc(kAlign, bytes)));
      TORCH_CHECK(b.data != nullptr, "chunkattn: cannot allocate ", bytes, " bytes of kernel scratch");
      b.capacity = n;
    }
    return b.data.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<float, Free> data;
    size_t capacity = 0;
  };
  Buffer buffers_[kSlots];
};

}  // namespace chunkattn::cpu
