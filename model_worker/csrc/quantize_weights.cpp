// --quantization int8's weights, quantized as the loader reads them: each row (output channel)
// on its own scale (quantize_row.h), in one pass of the checkpoint's float32 or bfloat16 rows,
// without the float32 temporaries a chain of torch ops makes (an 8B model's 8.2 billion weights
// went through six of them, most of an int8 start).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <tuple>

#include "ops.h"
#include "quantize_row.h"
#include "vec_utils.h"

namespace radixserve {

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
      for (int64_t r = begin; r < end; ++r) sp[r] = quantize_row(xp + r * K, K, qp + r * K);
    });
  });
  return {q, scale};
}

}  // namespace radixserve
