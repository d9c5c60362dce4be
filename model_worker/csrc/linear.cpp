// y = x W^T + b for a few rows of x (a decode step at low concurrency): every weight byte is read
// once and used for all rows, at memory speed. BLAS sgemm runs this shape at ~half the bandwidth.
// float32 or bfloat16 (accumulated in float32, rounded once).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

template <int M, typename T>
void rows_times_weight(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N,
                       int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const T* wr = w + n * K;
    Vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = Vec(0.f);
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const Vec wv = load_float(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = at::vec::fmadd(load_float(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc[m]);
      for (int64_t kk = k; kk < K; ++kk) {
        sum += static_cast<float>(x[m * K + kk]) * static_cast<float>(wr[kk]);
      }
      y[m * N + n] = bias == nullptr ? sum : sum + static_cast<float>(bias[n]);
    }
  }
}

template <int M, typename T>
void linear_m(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    rows_times_weight<M>(x, w, bias, y, K, N, begin, end);
  });
}

}  // namespace

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  x.scalar_type() == weight.scalar_type() && x.size(1) == weight.size(1),
              "linear_small_m: contiguous x [M, K] and weight [N, K] of one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxSmallM, "linear_small_m: 1 to ", kMaxSmallM, " rows");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N &&
                    bias->scalar_type() == x.scalar_type(),
                "linear_small_m: bias shape or dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  RADIXSERVE_DISPATCH_FLOAT(x, "linear_small_m", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    switch (M) {
      case 1: linear_m<1>(xp, wp, bp, yp, K, N); break;
      case 2: linear_m<2>(xp, wp, bp, yp, K, N); break;
      case 3: linear_m<3>(xp, wp, bp, yp, K, N); break;
      case 4: linear_m<4>(xp, wp, bp, yp, K, N); break;
      case 5: linear_m<5>(xp, wp, bp, yp, K, N); break;
      case 6: linear_m<6>(xp, wp, bp, yp, K, N); break;
      case 7: linear_m<7>(xp, wp, bp, yp, K, N); break;
      default: linear_m<8>(xp, wp, bp, yp, K, N); break;
    }
  });
  return y;
}

}  // namespace radixserve
