// w8a8 int8 linear layers on AVX512-VNNI, every row count in one kernel, on a weight laid out
// once at load for vpdpbusd (int8_vnni_pack) instead of re-blocked on every call (as oneDNN's
// int8 matmul does with a plain weight, which held it near 60% of the VNNI peak).
//
// Layout: blocks of 64 output channels; in a block, k in groups of 4, each group four 64-byte
// vectors [64 channels][4 k]: uint8 [ceil(N / 64)][ceil(K / 4)][64][4], so that a tile of a
// block reads one stream (which kept one row at memory speed; four streams of 16 channels were
// 10% slower on the LM head). The bytes are w + 128
// (w with its sign bit flipped), so that vpdpbusd takes the weight as its unsigned operand and a
// token's 4 activations, broadcast, as its signed one:
//   sum_k (w + 128) x = w . x + 128 * sum_k x,
// the second term one number per token, taken off before the rescale. Any int8 weight (-128
// included) and activation in [-127, 127] give exact int32 sums up to K of ~60,000.
// Padding: k past K are zero activations; channels past N are computed and never stored.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512F__)
#include <immintrin.h>
#define RADIXSERVE_INT8_VNNI 1
#endif

#include <array>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "ops.h"
#include "quantize_row.h"

namespace radixserve {
namespace {

constexpr int64_t kVec = 16;    // output channels per vector of int32 sums
constexpr int64_t kVecs = 4;    // vectors per block
constexpr int64_t kBlock = kVec * kVecs;  // output channels per block of the layout
constexpr int64_t kGroup = 4;   // k per vpdpbusd lane

#if defined(RADIXSERVE_INT8_VNNI)
// Register tile: up to kRows tokens x one block's 64 channels of int32 sums (24 of the 32
// vector registers, 4 more for the weight vectors). Each group of 4 k loads 4 weight vectors and
// kRows broadcasts for kRows * 4 vpdpbusd. A block (K x 64 bytes, 311 KB at K = 4,864) stays in
// the L2 cache across its row tiles; one row reads the weight at memory speed.
constexpr int kRows = 6;

template <typename Out>
struct Tile {
  const int8_t* x;       // the tile's first token, quantized; rows k_pad apart
  const float* x_scale;  // its tokens' scales
  const int32_t* x_sum;  // 128 * sum_k x, per token
  const uint8_t* w;      // the tile's block
  const float* w_scale;  // the block's first channel
  const float* bias;     // likewise, or nullptr
  Out* y;                // [token, first channel]; rows n apart, in the activations' dtype
  int64_t k_pad, n, channels;  // channels: to store, at most kBlock
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Outputs stored in the activations' dtype, bfloat16 rounded to nearest even as torch rounds
// (a NaN stays a NaN): a float32 copy of a 64-row LM head's logits would be 39 MB a step.
inline void store_outputs(float* p, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store_outputs(at::BFloat16* p, __mmask16 mask, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  rounded = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7fc0), rounded);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(rounded));
}

// The loops over r and v are unrolled (GCC otherwise keeps acc on the stack, a load and a
// store around every vpdpbusd).
template <int R, typename Out>
void vnni_tile(const Tile<Out>& t) {
  constexpr int V = kVecs;
  __m512i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t k = 0; k < t.k_pad; k += kGroup) {
    __m512i w[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(t.w + k * kBlock + v * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(load_i32(t.x + r * t.k_pad + k));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], x);
    }
  }
  // Each output as int8.cpp's rescale() computes it: fma(float(sum), x_scale * w_scale, bias).
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t c = v * kVec;
    const int64_t left = t.channels - c;
    if (left > 0) {
      const __mmask16 mask = left >= kVec ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m512 ws = _mm512_maskz_loadu_ps(mask, t.w_scale + c);
      const __m512 b =
          t.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, t.bias + c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i sum = _mm512_sub_epi32(acc[r][v], _mm512_set1_epi32(t.x_sum[r]));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(t.x_scale[r]), ws);
        store_outputs(t.y + r * t.n + c, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, b));
      }
    }
  }
}

template <typename Out>
using TileFn = void (*)(const Tile<Out>&);

// tiles<Out>[rows - 1]
template <typename Out>
constexpr std::array<TileFn<Out>, kRows> kTiles = {
    &vnni_tile<1, Out>, &vnni_tile<2, Out>, &vnni_tile<3, Out>,
    &vnni_tile<4, Out>, &vnni_tile<5, Out>, &vnni_tile<6, Out>};
#endif

}  // namespace

void int8_vnni_pack(at::Tensor& packed, int64_t start, const at::Tensor& rows) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == kGroup,
              "int8_vnni_pack: contiguous uint8 packed [blocks, k_pad / 4, 64, 4]");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kChar && rows.stride(1) == 1,
              "int8_vnni_pack: int8 rows [r, K] with contiguous rows");
  const int64_t r = rows.size(0), K = rows.size(1), groups = packed.size(1);
  TORCH_CHECK((K + kGroup - 1) / kGroup == groups, "int8_vnni_pack: rows of ", K,
              " values for a layout of ", groups * kGroup);
  TORCH_CHECK(start >= 0 && start + r <= packed.size(0) * kBlock, "int8_vnni_pack: rows ", start,
              "..", start + r, " past the layout's ", packed.size(0) * kBlock, " channels");
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int8_t* in = rows.data_ptr<int8_t>();
  at::parallel_for(0, r, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = start + i;
      uint8_t* channel = out + (n / kBlock) * groups * kBlock * kGroup + (n % kBlock) * kGroup;
      const int8_t* row = in + i * rows.stride(0);
      for (int64_t k = 0; k < groups * kGroup; ++k) {
        const int8_t w = k < K ? row[k] : 0;
        channel[(k / kGroup) * kBlock * kGroup + k % kGroup] = static_cast<uint8_t>(w) ^ 0x80;
      }
    }
  });
}

at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias_in) {
  const c10::optional<at::Tensor> bias = bias_as_float(bias_in);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "int8_vnni_linear: x [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == kGroup,
              "int8_vnni_linear: contiguous uint8 packed [blocks, k_pad / 4, 64, 4]");
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel();
  const int64_t k_pad = packed.size(1) * kGroup, blocks = packed.size(0);
  TORCH_CHECK((K + kGroup - 1) / kGroup * kGroup == k_pad && (N + kBlock - 1) / kBlock == blocks,
              "int8_vnni_linear: x of ", K, " columns and ", N, " scales for a layout of ",
              blocks, " blocks by ", k_pad);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "int8_vnni_linear: weight scales must be contiguous float32 [N]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "int8_vnni_linear: bias must be contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(RADIXSERVE_INT8_VNNI)
  // The tokens quantized here, each on its own scale as quantize_rows_int8 does, k_pad apart
  // (the padding zeros), with 128 * their sum: the flipped weight's extra term.
  at::Tensor xq = at::empty({M, k_pad}, x.options().dtype(at::kChar));
  at::Tensor x_scale = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor x_sum = at::empty({M}, x.options().dtype(at::kInt));
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xs = x_scale.data_ptr<float>();
  int32_t* sums = x_sum.data_ptr<int32_t>();
  RADIXSERVE_DISPATCH_FLOAT(x, "int8_vnni_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        int8_t* q = xqp + m * k_pad;
        xs[m] = quantize_row(xp + m * x.stride(0), K, q);
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += q[k];
        for (int64_t k = K; k < k_pad; ++k) q[k] = 0;
        sums[m] = 128 * sum;
      }
    });
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* ws = w_scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(y, "int8_vnni_linear", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Threads take blocks of output channels: each reads its part of the weight once.
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t n0 = block * kBlock;
        for (int64_t m = 0; m < M; m += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, M - m);
          const Tile<scalar_t> tile{xqp + m * k_pad,
                                    xs + m,
                                    sums + m,
                                    wp + block * k_pad * kBlock,
                                    ws + n0,
                                    bp == nullptr ? nullptr : bp + n0,
                                    yp + m * N + n0,
                                    k_pad,
                                    N,
                                    std::min(kBlock, N - n0)};
          kTiles<scalar_t>[rows - 1](tile);
        }
      }
    });
  });
#else
  TORCH_CHECK(false, "int8_vnni_linear: this build has no AVX512-VNNI (int8_vnni_available)");
#endif
  return y;
}

bool int8_vnni_available() {
#if defined(RADIXSERVE_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace radixserve
