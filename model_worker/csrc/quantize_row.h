// One row of float activations as int8 on its own scale: shared by the int8 kernels
// (int8.cpp, int8_vnni.cpp), so that every path quantizes a token the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_utils.h"

namespace radixserve {

// Row `row` (K floats) as int8 on its own max |x|, into `out`; returns its scale.
inline float quantize_row(const float* row, int64_t K, int8_t* out) {
  Vec vmax(0.f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) vmax = at::vec::maximum(vmax, Vec::loadu(row + k).abs());
  float absmax = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; k < K; ++k) absmax = std::max(absmax, std::abs(row[k]));
  // An all-zero row keeps scale 0 and quantizes to zeros.
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  const Vec vinv(inv);
  float rounded[kLanes];  // to nearest, ties to even, as torch.round
  for (k = 0; k + kLanes <= K; k += kLanes) {
    (Vec::loadu(row + k) * vinv).round().store(rounded);
    for (int64_t i = 0; i < kLanes; ++i) out[k + i] = static_cast<int8_t>(rounded[i]);
  }
  for (; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
  return absmax / 127.f;
}

}  // namespace radixserve
