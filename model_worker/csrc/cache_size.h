// The CPU's cache sizes, as the C library reports them: what the kernels size their fetches ahead
// by, on whichever CPU they run (a Zen 4 core's L2 is 1 MB, a Zen 2's 512 KB, a Xeon's 2 MB).
#pragma once

#include <unistd.h>

#include <cstdint>

namespace radixserve {

// A core's L2 cache in bytes (1 MB where the C library does not say).
inline int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
    long reported = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return reported > 0 ? static_cast<int64_t>(reported) : int64_t{1} << 20;
  }();
  return bytes;
}

}  // namespace radixserve
