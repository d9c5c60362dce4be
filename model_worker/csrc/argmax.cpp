// The greedy pick over a vocabulary: each row's argmax in one vectorised pass. torch.argmax
// walks a row one element at a time, tracking an index with every compare; over 151,936 logits
// x 64 rows that costs more than reading them. Here each block's max is taken with SIMD, and
// only the block that holds the winner is scanned for its index.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

constexpr int64_t kBlock = 16 * kLanes;

// The max of x[0, n), NaN if any element is NaN (at::vec::maximum propagates NaN).
template <typename T>
float block_max(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kLanes) {
    Vec acc = load_float(x);
    for (i = kLanes; i + kLanes <= n; i += kLanes) acc = at::vec::maximum(acc, load_float(x + i));
    m = at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i) {
    const float v = x[i];
    m = (std::isnan(v) || v > m) ? v : m;
    if (std::isnan(m)) break;
  }
  return m;
}

// torch.argmax's answer: the first index of the largest value, where NaN counts as the largest.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = 0.f;
  int64_t best_block = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float m = block_max(x + b, std::min(kBlock, n - b));
    if (std::isnan(m)) {  // the first NaN wins: it lies in this block
      best = m;
      best_block = b;
      break;
    }
    if (b == 0 || m > best) {  // strictly larger: on a tie the earlier block holds the first
      best = m;
      best_block = b;
    }
  }
  const bool nan = std::isnan(best);
  const int64_t end = std::min(best_block + kBlock, n);
  for (int64_t i = best_block; i < end; ++i) {
    const float v = x[i];
    if (nan ? std::isnan(v) : v == best) return i;
  }
  return best_block;  // unreachable: the block's max is one of its elements
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: a 2-D tensor with contiguous, non-empty rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  RADIXSERVE_DISPATCH_FLOAT(x, "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
    });
  });
  return out;
}

}  // namespace radixserve
