// Small helpers both native backends (trec/, floor_backend.cpp) use.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>

#include "triton_api.h"

namespace trec_backend {

// Steady-clock nanoseconds (what Triton's statistics take).
inline uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Frees an error nobody answers with (null is fine).
inline void drop(TRITONSERVER_Error* e) {
  if (e != nullptr) TRITONSERVER_ErrorDelete(e);
}

// Copies a (possibly split) input into `dst`: exactly `bytes` bytes from CPU memory, or
// false (an unreadable buffer, one in GPU memory, or buffers of another total size).
inline bool read_cpu(TRITONBACKEND_Input* input, uint32_t buffers, uint64_t bytes, char* dst) {
  uint64_t done = 0;
  for (uint32_t b = 0; b < buffers; ++b) {
    const void* src = nullptr;
    uint64_t size = 0;
    TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
    int64_t mt_id = 0;
    if (auto* e = TRITONBACKEND_InputBuffer(input, b, &src, &size, &mt, &mt_id)) {
      drop(e);
      return false;
    }
    if (mt == TRITONSERVER_MEMORY_GPU || done + size > bytes) return false;
    std::memcpy(dst + done, src, size);
    done += size;
  }
  return done == bytes;
}

}  // namespace trec_backend
