// w8a8 int8 linear layers: activations quantized per token (symmetric, 8 bits), int8 weights per
// output channel, exact int32 dot products: either in int8_linear here (float rows in, each
// weight byte read once per block of 8 rows), or in int8_gemm: oneDNN's int8 matmul
// (at::_int_mm) on a block of outputs at a time, each block rescaled while its int32 products
// are still in cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops.h"
#include "quantize_row.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

// int8_gemm's int32 products per block of outputs: a block's stay in the L3 cache until
// rescaled; blocks of at least kInt8GemmMinCols outputs keep oneDNN's matmul efficient.
constexpr int64_t kInt8GemmBlockBytes = 16 << 20;
constexpr int64_t kInt8GemmMinCols = 256;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc[m] = x_m . w over the first multiple of 64 of K; returns how far it went. 64 pairs a
// step: x made unsigned (x + 128, by flipping its sign bit) times w, less 128 * sum(w), which one
// more dpbusd against ones gives; every sum stays far inside int32.
template <int M>
int64_t dot_rows_simd(const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i a[M];
  for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_si512();
  __m512i w_sum = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i wv = _mm512_loadu_si512(w + k);
    w_sum = _mm512_dpbusd_epi32(w_sum, ones, wv);
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(x + m * K + k), flip);
      a[m] = _mm512_dpbusd_epi32(a[m], xv, wv);
    }
  }
  const int32_t shift = 128 * _mm512_reduce_add_epi32(w_sum);
  for (int m = 0; m < M; ++m) acc[m] = _mm512_reduce_add_epi32(a[m]) - shift;
  return k;
}
#elif defined(__AVX2__)
// sum_k x_k * w_k over 32 int8 pairs, added to acc's int32 lanes. |w| goes in as unsigned (a
// weight of -128, as pre-quantized checkpoints have, is 128 there) and its sign moves onto x,
// which quantize_rows_int8 keeps in [-127, 127] so that negating it cannot overflow. Each pair
// of products is at most 2 * 128 * 127 < 2^15: AVX2's saturating u8 x s8 pair sums never
// saturate, and AVX-VNNI (where present) sums the same way.
inline __m256i dot_accumulate(__m256i acc, __m256i x, __m256i w) {
  const __m256i a_abs = _mm256_sign_epi8(w, w);
  const __m256i b_signed = _mm256_sign_epi8(x, w);
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a_abs, b_signed);
#else
  const __m256i pairs = _mm256_maddubs_epi16(a_abs, b_signed);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// acc[m] = x_m . w over the first multiple of 32 of K; returns how far it went.
template <int M>
int64_t dot_rows_simd(const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  __m256i a[M];
  for (int m = 0; m < M; ++m) a[m] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k));
      a[m] = dot_accumulate(a[m], xv, wv);
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = hsum_epi32(a[m]);
  return k;
}
#else
template <int M>
int64_t dot_rows_simd(const int8_t*, const int8_t*, int64_t, int32_t* acc) {
  for (int m = 0; m < M; ++m) acc[m] = 0;
  return 0;
}
#endif

// acc[m] = x_m . w over K int8 values, for M rows of x (row stride K).
template <int M>
void dot_rows(const int8_t* x, const int8_t* w, int64_t K, int32_t* acc) {
  for (int64_t k = dot_rows_simd<M>(x, w, K, acc); k < K; ++k) {
    for (int m = 0; m < M; ++m) acc[m] += int32_t{x[m * K + k]} * int32_t{w[k]};
  }
}

// One output of x W^T + b from its exact int32 dot product; every path (int8_linear, int8_gemm,
// torch._int_mm + dequantize_rows) rounds it the same way, so a row's result does not depend on
// the batch it came in.
inline float rescale(int32_t acc, float x_scale, float w_scale, float bias) {
  return std::fma(static_cast<float>(acc), x_scale * w_scale, bias);
}

// Rows [begin, end) of y (row stride y_stride) from their int32 products acc (row stride
// acc_stride), `cols` outputs a row: each as `rescale` computes it (one multiply, one fused
// multiply-add), kLanes at a time, stored in T (float, or bfloat16 rounded once). w_scale and
// bias start at the block's first column.
template <typename T>
void rescale_rows(const int32_t* acc, int64_t acc_stride, const float* x_scale,
                  const float* w_scale, const float* bias, T* y, int64_t y_stride,
                  int64_t cols, int64_t begin, int64_t end) {
  using IVec = at::vec::Vectorized<int32_t>;
  static_assert(IVec::size() == kLanes, "int32 and float vectors of one width");
  const Vec zero(0.f);
  for (int64_t m = begin; m < end; ++m) {
    const int32_t* a = acc + m * acc_stride;
    T* out = y + m * y_stride;
    const float xs = x_scale[m];
    const Vec vxs(xs);
    int64_t n = 0;
    for (; n + kLanes <= cols; n += kLanes) {
      const Vec products = at::vec::convert_to_fp_of_same_size<float>(IVec::loadu(a + n));
      const Vec b = bias == nullptr ? zero : Vec::loadu(bias + n);
      store_float(at::vec::fmadd(products, vxs * Vec::loadu(w_scale + n), b), out + n);
    }
    for (; n < cols; ++n) out[n] = rescale(a[n], xs, w_scale[n], bias == nullptr ? 0.f : bias[n]);
  }
}

template <int M, typename T>
void int8_linear_m(const int8_t* x, const float* x_scale, const int8_t* w, const float* w_scale,
                   const float* bias, T* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int32_t acc[M];
    for (int64_t n = begin; n < end; ++n) {
      dot_rows<M>(x, w + n * K, K, acc);
      const float b = bias == nullptr ? 0.f : bias[n];
      for (int m = 0; m < M; ++m) y[m * N + n] = rescale(acc[m], x_scale[m], w_scale[n], b);
    }
  });
}

const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              op, ": bias must be contiguous float32 [N]");
  return bias->data_ptr<float>();
}

void check_scales(const at::Tensor& x_scale, int64_t M, const at::Tensor& w_scale, int64_t N,
                  const char* op) {
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.is_contiguous() &&
                  x_scale.numel() == M && w_scale.scalar_type() == at::kFloat &&
                  w_scale.is_contiguous() && w_scale.numel() == N,
              op, ": scales must be contiguous float32 [M] and [N]");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "quantize_rows_int8: x [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(x, "quantize_rows_int8", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        sp[m] = quantize_row(xp + m * x.stride(0), K, qp + m * K);
      }
    });
  });
  return {q, scale};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias_in) {
  const c10::optional<at::Tensor> bias = bias_as_float(bias_in);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kChar &&
                  weight.is_contiguous() && x.size(1) == weight.size(1),
              "int8_linear: x [M, K] and contiguous int8 weight [N, K]");
  TORCH_CHECK(w_scale.numel() == weight.size(0), "int8_linear: one weight scale per output");
  // Quantized here rather than by a separate op: at one row the call itself is what costs.
  const auto [xq, x_scale] = quantize_rows_int8(x);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_scales(x_scale, M, w_scale, N, "int8_linear");
  const float* bp = bias_data(bias, N, "int8_linear");
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype: each output rounded once
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* ws = w_scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(y, "int8_linear", [&] {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxSmallM) {
      const int8_t* xp = xq.data_ptr<int8_t>() + m0 * K;
      const float* xs = x_scale.data_ptr<float>() + m0;
      scalar_t* yp = y.data_ptr<scalar_t>() + m0 * N;
      switch (std::min(kMaxSmallM, M - m0)) {
        case 1: int8_linear_m<1>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 2: int8_linear_m<2>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 3: int8_linear_m<3>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 4: int8_linear_m<4>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 5: int8_linear_m<5>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 6: int8_linear_m<6>(xp, xs, wp, ws, bp, yp, K, N); break;
        case 7: int8_linear_m<7>(xp, xs, wp, ws, bp, yp, K, N); break;
        default: int8_linear_m<8>(xp, xs, wp, ws, bp, yp, K, N); break;
      }
    }
  });
  return y;
}

at::Tensor dequantize_rows(const at::Tensor& acc, const at::Tensor& x_scale,
                           const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "dequantize_rows: contiguous int32 acc [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  check_scales(x_scale, M, w_scale, N, "dequantize_rows");
  const float* bp = bias_data(bias, N, "dequantize_rows");
  at::Tensor y = at::empty({M, N}, x_scale.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    rescale_rows(ap, N, xs, ws, bp, yp, N, N, begin, end);
  });
  return y;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                     const c10::optional<at::Tensor>& bias_in) {
  const c10::optional<at::Tensor> bias = bias_as_float(bias_in);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  weight.dim() == 2 && weight.scalar_type() == at::kChar &&
                  weight.is_contiguous() && x.size(1) == weight.size(1),
              "int8_gemm: x [M, K] with contiguous rows and contiguous int8 weight [N, K]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == weight.size(0),
              "int8_gemm: weight scales must be contiguous float32 [N]");
  const int64_t M = x.size(0), N = weight.size(0);
  const float* bp = bias_data(bias, N, "int8_gemm");
  at::Tensor y = at::empty({M, N}, x.options());  // x's dtype: each output rounded once
  if (M == 0) return y;
  // The int32 products of a whole prefill chunk (2048 rows x the 0.5B's 9728 gate_up outputs:
  // 80 MB, page-faulted in on every call) went out to memory and back for the rescale: a fifth
  // of an int8 prefill. A block of the weight's rows (the output's columns) at a time keeps
  // them in cache, and reads each weight byte once: blocks of rows would read a 150k-row LM
  // head once per block.
  const auto [xq, x_scale] = quantize_rows_int8(x);
  const int64_t cols = std::min(N, std::max(kInt8GemmMinCols, kInt8GemmBlockBytes / (4 * M)));
  at::Tensor acc = at::empty({M * cols}, x.options().dtype(at::kInt));
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(y, "int8_gemm", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    for (int64_t n0 = 0; n0 < N; n0 += cols) {
      const int64_t width = std::min(cols, N - n0);
      at::Tensor products = acc.narrow(0, 0, M * width).view({M, width});
      at::_int_mm_out(products, xq, weight.narrow(0, n0, width).t());
      const int32_t* ap = products.data_ptr<int32_t>();
      const float* bias_cols = bp == nullptr ? nullptr : bp + n0;
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        rescale_rows(ap, width, xs, ws + n0, bias_cols, yp + n0, N, width, begin, end);
      });
    }
  });
  return y;
}

}  // namespace radixserve
