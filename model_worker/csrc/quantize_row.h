// One row of float32 or bfloat16 values as int8 on its own scale: each token's activations (the
// int8 kernels) and each output channel's weights (quantize_rows_int8 as the loader reads them)
// alike, so that every path quantizes a row the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/ATen.h>
#include <c10/util/bit_cast.h>

#include "vec_utils.h"

namespace radixserve {

// kLanes values, each a whole number in [-127, 127], as int8 into out[0, kLanes): one vector
// conversion and narrowing (a store and a scalar conversion each had made the quantizer cost
// about twice what the SIMD arithmetic around it does).
inline void store_int8(const Vec& v, int8_t* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i words = _mm256_cvtps_epi32(v);
  const __m128i halves =
      _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(halves, halves));
#else
  float values[kLanes];
  v.store(values);
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<int8_t>(values[i]);
#endif
}

// max |x| over a row of K; NaN if any is NaN.
template <typename T>
inline float row_absmax(const T* row, int64_t K) {
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
  return absmax;
}

#if defined(CPU_CAPABILITY_AVX512)
// bfloat16 rows (a bfloat16 model's activations): the max of the values' bit patterns with the
// sign cleared, 32 at a time, no conversions: those of numbers are ordered as their magnitudes,
// and any above infinity's is a NaN's, which it returns.
inline float row_absmax(const at::BFloat16* row, int64_t K) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i vmax = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    vmax = _mm512_max_epu16(vmax, _mm512_and_si512(_mm512_loadu_si512(row + k), magnitude));
  }
  if (k < K) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    vmax = _mm512_max_epu16(vmax, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail, row + k),
                                                   magnitude));
  }
  const __m512i halves = _mm512_max_epu32(_mm512_and_si512(vmax, _mm512_set1_epi32(0xffff)),
                                          _mm512_srli_epi32(vmax, 16));
  const uint32_t bits = _mm512_reduce_max_epu32(halves);
  if (bits > 0x7f80) return std::numeric_limits<float>::quiet_NaN();
  return c10::bit_cast<float>(bits << 16);
}
#endif

// Row `row` (K values) into `out`; returns its scale, max |x| / 127. Each value is rounded to
// nearest, ties to even (as torch.round), and kept in [-127, 127]: the kernels negate values,
// which -128 cannot survive. A row whose scale is zero or subnormal (1 / scale would be
// infinite) is zeros with scale 0: its values are below any float32 normal number. A row with a
// NaN or an infinity has no scale: zeros with scale NaN, so that its outputs are NaN, as a float
// matmul's would be, rather than the bias alone (an infinity times 1 / scale = 0 is NaN, which
// no int8 holds).
template <typename T>
inline float quantize_row(const T* row, int64_t K, int8_t* out) {
  const float absmax = row_absmax(row, K);
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
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    store_int8(at::vec::clamp((load_float(row + k) * vinv).round(), lo, hi), out + k);
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
