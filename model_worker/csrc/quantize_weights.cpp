// --quantization int8's weights, quantized as the loader reads them: each row (output channel)
// symmetrically on its own max |w|, in one pass of the checkpoint's rows, float32 or bfloat16,
// without the float32 temporaries a chain of torch ops makes (an 8B model's 8.2 billion weights
// passed through six of them, most of an int8 start).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

// One row: scale = max|w| / 127 and q = round(w / scale) (to nearest, ties to even, as
// torch.round) in [-127, 127], the kernels negate weights, which -128 cannot survive. A row
// whose scale is zero or subnormal (1/scale would be infinite) stays zero with scale 0: its
// weights are below any float32 normal number, nothing an output could show.
template <typename T>
void quantize_row(const T* row, int64_t K, int8_t* q, float* scale) {
  Vec vmax(0.f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) vmax = at::vec::maximum(vmax, load_float(row + k).abs());
  float absmax = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; k < K; ++k) absmax = std::max(absmax, std::abs(static_cast<float>(row[k])));
  const float s = absmax / 127.f;
  if (!(s >= std::numeric_limits<float>::min())) {
    std::fill(q, q + K, int8_t{0});
    *scale = 0.f;
    return;
  }
  *scale = s;
  const float inverse = 1.f / s;
  const Vec vinv(inverse), lo(-127.f), hi(127.f);
  float rounded[kLanes];
  for (k = 0; k + kLanes <= K; k += kLanes) {
    at::vec::clamp((load_float(row + k) * vinv).round(), lo, hi).store(rounded);
    for (int64_t i = 0; i < kLanes; ++i) q[k + i] = static_cast<int8_t>(rounded[i]);
  }
  for (; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(row[k]) * inverse);
    q[k] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_weight_rows(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(),
              "quantize_weight_rows: contiguous rows [R, K]");
  const int64_t R = rows.size(0), K = rows.size(1);
  at::Tensor q = at::empty({R, K}, rows.options().dtype(at::kChar));
  at::Tensor scale = at::empty({R}, rows.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(rows, "quantize_weight_rows", [&] {
    const scalar_t* xp = rows.data_ptr<scalar_t>();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * K, K, qp + r * K, sp + r);
    });
  });
  return {q, scale};
}

}  // namespace radixserve
