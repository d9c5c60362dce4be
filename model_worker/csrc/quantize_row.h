// One row of float32 or bfloat16 values as int8 on its own scale: each token's activations (the
// int8 kernels) and each output channel's weights (quantize_rows_int8 as the loader reads them)
// alike, so that every path quantizes a row the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/ATen.h>

#include "vec_utils.h"

namespace radixserve {

// Row `row` (K values) into `out`; returns its scale, max |x| / 127. Each value is rounded to
// nearest, ties to even (as torch.round), and kept in [-127, 127]: the kernels negate values,
// which -128 cannot survive. A row whose scale is zero or subnormal (1 / scale would be
// infinite) is zeros with scale 0: its values are below any float32 normal number. A row with a
// NaN or an infinity has no scale: zeros with scale NaN, so that its outputs are NaN, as a float
// matmul's would be, rather than the bias alone (an infinity times 1 / scale = 0 is NaN, which
// no int8 holds).
template <typename T>
inline float quantize_row(const T* row, int64_t K, int8_t* out) {
  Vec vmax(0.f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) vmax = at::vec::maximum(vmax, load_float(row + k).abs());
  float absmax = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  // NaN propagates here as at::vec::maximum propagates it above (std::max would drop it).
  for (; k < K; ++k) {
    const float a = std::abs(static_cast<float>(row[k]));
    absmax = std::isnan(a) ? a : std::max(absmax, a);
  }
  if (!std::isfinite(absmax)) {
    std::fill(out, out + K, int8_t{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = absmax / 127.f;
  if (!(scale >= std::numeric_limits<float>::min())) {
    std::fill(out, out + K, int8_t{0});
    return 0.f;
  }
  const float inverse = 1.f / scale;
  const Vec vinv(inverse), lo(-127.f), hi(127.f);
  float rounded[kLanes];
  for (k = 0; k + kLanes <= K; k += kLanes) {
    at::vec::clamp((load_float(row + k) * vinv).round(), lo, hi).store(rounded);
    for (int64_t i = 0; i < kLanes; ++i) out[k + i] = static_cast<int8_t>(rounded[i]);
  }
  for (; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(row[k]) * inverse);
    out[k] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
  }
  return scale;
}

// The int8 kernels rescale in float32: a bfloat16 model's bias as float32 (the few q/k/v biases).
inline c10::optional<at::Tensor> bias_as_float(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || bias->scalar_type() == at::kFloat) return bias;
  return bias->to(at::kFloat);
}

}  // namespace radixserve
