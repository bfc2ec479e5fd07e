// The CPU's cache sizes, for kernels that block their work to fit them.
#pragma once

#include <unistd.h>

#include <cstdint>

namespace lamina {

// Bytes of L2 a core has (512 KB where the OS does not say).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) : int64_t{512} << 10;
  }();
  return bytes;
}

}  // namespace lamina
