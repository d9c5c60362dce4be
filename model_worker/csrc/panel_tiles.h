// How the linear kernels that keep a weight in blocks of output channels (linear_panels'
// bfloat16 panels, int8_vnni_linear's blocks) share a call among threads.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/Parallel.h>

namespace radixserve {

// Calls f(panel, first tile, end tile) over a thread's share of every (panel, tile of rows):
// one run of them in panel order, at most ceil(units / threads) long (at::parallel_for's
// chunks). By whole panels, a layer of 9 panels (576 channels of 64) kept one of two threads
// idle for a ninth of the call wherever it had several tiles of rows (7 rows on); a run splits
// at most two of its panels with a neighbour, whose weight both then read. Within a panel the
// tiles come in order, so a thread's tiles of a panel read its weight from the cache.
template <typename F>
void for_panel_tiles(int64_t panels, int64_t tiles, const F& f) {
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end;) {
      const int64_t panel = unit / tiles, first = unit % tiles;
      const int64_t last = std::min(tiles, first + (end - unit));
      f(panel, first, last);
      unit += last - first;
    }
  });
}

}  // namespace radixserve
