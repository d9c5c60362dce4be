// How the linear kernels that keep a weight in blocks of output channels (linear_panels'
// bfloat16 panels, int8_vnni_linear's blocks) share a call among threads, and fetch a thread's
// next panel while it computes one.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/Parallel.h>

#include "cache_size.h"

namespace radixserve {

// Calls f(panel, first tile, end tile, more) over a thread's share of every (panel, tile of rows):
// one run of them in panel order, at most ceil(units / threads) long (at::parallel_for's
// chunks). By whole panels, a layer of 9 panels (576 channels of 64) kept one of two threads
// idle for a ninth of the call wherever it had several tiles of rows (7 rows on); a run splits
// at most two of its panels with a neighbour, whose weight both then read. Within a panel the
// tiles come in order, so a thread's tiles of a panel read its weight from the cache; `more`:
// the run goes on to the next panel, whose weight the thread can fetch meanwhile.
template <typename F>
void for_panel_tiles(int64_t panels, int64_t tiles, const F& f) {
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end;) {
      const int64_t panel = unit / tiles, first = unit % tiles;
      const int64_t last = std::min(tiles, first + (end - unit));
      unit += last - first;
      f(panel, first, last, unit < end);
    }
  });
}

// The largest panel whose next a linear fetches: two of them in 4/5 of the L2, the rest for the
// rows (on a Zen 4 core's 1 MB: an 8B's int8 blocks of 256 KB and the 0.5B's down_proj block of
// 311 KB, not an 8B's bfloat16 panels of 512 KB or its int8 down_proj blocks of 768 KB).
inline int64_t fetched_panel_bytes() { return l2_cache_bytes() * 2 / 5; }

// A tile's share of a NextPanelFetch: a line an iteration of its k loop, while it lasts.
struct FetchLines {
  const char* start = nullptr;  // line i at start + 64 i
  int64_t lines = 0;

  void fetch_at(int64_t i) const {
    if (i < lines) __builtin_prefetch(start + i * 64, 0, 2);  // locality 2: prefetcht1 on x86
  }
};

// A thread's next panel fetched into L2 while its tiles of the panel in hand compute. A panel's
// first tile reads the weight from memory, faster than the memory gives it (the tile's k loop
// wants ~10 bytes a cycle), and the tiles after it from the cache: that first tile ran at the
// memory's speed, a bfloat16 layer at 64 rows taking 1.11-1.23x its time with the weight in
// cache. Fetched in step with the tiles, at most a line an iteration of their k loops, so that
// the fetches never queue up on the memory (as attention.cpp's NextUnitRows's did): with 2 or 3
// tiles of a panel that is half or three quarters of the next one. Nothing is fetched where the
// thread has one tile of this panel (a few rows: the weight streams through once at the memory's
// speed anyway), or where a panel is larger than `max_bytes` (the two panels, the rows and the
// outputs share the L2: an 8B's down_proj block of 768 KB would evict the one in hand).
class NextPanelFetch {
 public:
  // next: the next panel's `bytes` (a multiple of 64), or nullptr; `tiles` tiles of this panel
  // to come, of `iterations` iterations each.
  NextPanelFetch(const void* next, int64_t bytes, int64_t tiles, int64_t iterations,
                 int64_t max_bytes)
      : next_(static_cast<const char*>(next)),
        lines_(next != nullptr && tiles > 1 && bytes <= max_bytes ? bytes / 64 : 0),
        iterations_(tiles * iterations) {}

  // The lines due for the next tile, of `iterations` iterations of k.
  FetchLines for_tile(int64_t iterations) {
    if (lines_ == 0) return {};
    done_ = std::min(iterations_, done_ + iterations);
    const FetchLines due{next_ + fetched_ * 64,
                         std::min(lines_ * done_ / iterations_ - fetched_, iterations)};
    fetched_ += due.lines;
    return due;
  }

 private:
  const char* next_;
  int64_t lines_, iterations_, fetched_ = 0, done_ = 0;  // iterations: of all the tiles
};

}  // namespace radixserve
