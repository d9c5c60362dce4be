// y = x W^T + b for a few rows of x (a decode step at low concurrency): every weight byte is read
// once and used for all rows, at memory speed. BLAS sgemm runs this shape at ~half the bandwidth.
// float32 or bfloat16 (accumulated in float32, rounded once). bfloat16 on oneDNN's own copy of the
// weight takes many rows too, compute-bound (rows_times_bf16_panels): oneDNN's sums to the
// bit, faster than oneDNN at a decode step's rows here (fused_ops.BF16_PANEL_ROWS).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "panel_tiles.h"
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

// Rows of x times a weight kept as oneDNN reorders float32 for its matmul (packed_linear.py):
// panels of `Block` output channels, each [k_pad][Block] (K padded, with zeros), one after the
// other. A panel's `Block` outputs are accumulated over k in registers, as rows_times_weight
// does over a weight row. An FMA's result is ready 4 cycles on and two start per cycle: fewer
// than 8 accumulators (one row on AVX-512) wait on their own sums, so those take even and odd k
// apart and add the two at the end.
template <int M, int Block>
void rows_times_panels(const float* x, const float* panels, const float* bias, float* y,
                       int64_t K, int64_t k_pad, int64_t N, int64_t p_begin, int64_t p_end) {
  constexpr int kVecs = Block / kLanes;
  constexpr int kChains = M * kVecs >= 8 ? 1 : 2;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* panel = panels + p * k_pad * Block;
    Vec acc[kChains][M][kVecs];
    for (int c = 0; c < kChains; ++c) {
      for (int m = 0; m < M; ++m) {
        for (int v = 0; v < kVecs; ++v) acc[c][m][v] = Vec(0.f);
      }
    }
    auto step = [&](int c, int64_t k) {
      const float* wk = panel + k * Block;
      for (int v = 0; v < kVecs; ++v) {
        const Vec wv = Vec::loadu(wk + v * kLanes);
        for (int m = 0; m < M; ++m) {
          acc[c][m][v] = at::vec::fmadd(Vec(x[m * K + k]), wv, acc[c][m][v]);
        }
      }
    };
    int64_t k = 0;
    for (; k + kChains <= K; k += kChains) {
      for (int c = 0; c < kChains; ++c) step(c, k + c);
    }
    for (; k < K; ++k) step(0, k);
    const int64_t n0 = p * Block;
    for (int m = 0; m < M; ++m) {
      for (int v = 0; v < kVecs; ++v) {
        Vec out = acc[0][m][v];
        for (int c = 1; c < kChains; ++c) out = out + acc[c][m][v];
        if (bias != nullptr) out = out + Vec::loadu(bias + n0 + v * kLanes);
        out.store(y + m * N + n0 + v * kLanes);
      }
    }
  }
}

template <int M, int Block>
void linear_panels_m(const float* x, const float* panels, const float* bias, float* y, int64_t K,
                     int64_t k_pad, int64_t N) {
  at::parallel_for(0, N / Block, 1, [&](int64_t begin, int64_t end) {
    rows_times_panels<M, Block>(x, panels, bias, y, K, k_pad, N, begin, end);
  });
}

template <int Block>
void linear_panels_block(const float* x, const float* panels, const float* bias, float* y,
                         int64_t M, int64_t K, int64_t k_pad, int64_t N) {
  switch (M) {
    case 1: linear_panels_m<1, Block>(x, panels, bias, y, K, k_pad, N); break;
    case 2: linear_panels_m<2, Block>(x, panels, bias, y, K, k_pad, N); break;
    case 3: linear_panels_m<3, Block>(x, panels, bias, y, K, k_pad, N); break;
    default: linear_panels_m<4, Block>(x, panels, bias, y, K, k_pad, N); break;
  }
}

#if defined(__AVX512BF16__)
// Pair i of x's pairs of k, as the 32-bit lane vdpbf16ps broadcasts (x's own storage, where its
// rows are pairs already, is bfloat16: read as bytes).
inline int32_t pair_at(const uint32_t* pairs, int64_t i) {
  int32_t v;
  std::memcpy(&v, pairs + i, sizeof v);
  return v;
}

// 16 outputs' float32 sums plus their bias (16 bfloat16 values, or none), rounded to bfloat16
// once, into y.
inline void store_with_bias(__m512 sums, const at::BFloat16* bias, at::BFloat16* y) {
  if (bias != nullptr) {  // bfloat16 is float32's upper half
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16);
    sums = _mm512_add_ps(sums, _mm512_castsi512_ps(widened));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(sums));
}

// The same for bfloat16, which oneDNN lays out for vdpbf16ps: a panel is [k_pad / 2][Block][2],
// each 32-bit lane a pair of consecutive k of one output channel. x comes as pairs as well
// ([M][k_pad / 2], zero past K), one broadcast to every lane; each vdpbf16ps adds both products
// of a pair to a lane's float32 sum. The sums run over k in order, in blocks of `block_pairs`
// pairs, each block's sum from zero and then added to the total: the order oneDNN's own kernel
// sums many rows in, for the block size PackedWeight found it to use on this shape
// (packed_linear.py), so that a row's result is oneDNN's to the bit whatever the batch (0: one
// block). Each output is rounded to bfloat16 once, after the bias.
//
// A panel at a time, and in it a block of k at a time, every tile of up to kTileRows rows
// against that block, which stays in the cache across them (one tile: a decode of a few rows,
// at memory speed); threads take even runs of (panel, tile) (panel_tiles.h), so each reads its
// part of the weight once. A row's result depends on neither the rows that came with it nor the
// threads. A tile's block sums stay in registers; the totals of a thread's rows of a panel in a
// buffer.
constexpr int kTileRows = 6;

template <int R, int Block>
void tile_times_bf16_panel_block(const uint32_t* x_pairs, int64_t x_stride,
                                 const at::BFloat16* panel, int64_t k0, int64_t k1, bool first,
                                 float* total, FetchLines fetch) {
  constexpr int kVecs = Block / 16;
  __m512 acc[R][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t kp = k0; kp < k1; ++kp) {
    fetch.fetch_at(kp - k0);
    const at::BFloat16* wk = panel + kp * 2 * Block;
    __m512bh wv[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wk + v * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair_at(x_pairs, r * x_stride + kp));
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      float* t = total + r * Block + v * 16;
      _mm512_storeu_ps(t, first ? acc[r][v] : _mm512_add_ps(_mm512_loadu_ps(t), acc[r][v]));
    }
  }
}

template <int Block>
void rows_times_bf16_panels(const uint32_t* x_pairs, const at::BFloat16* panels,
                            const at::BFloat16* bias, at::BFloat16* y, int64_t M, int64_t k_pairs,
                            int64_t block_pairs, int64_t N) {
  using TileFn = void (*)(const uint32_t*, int64_t, const at::BFloat16*, int64_t, int64_t, bool,
                          float*, FetchLines);
  static constexpr TileFn kTiles[kTileRows] = {
      &tile_times_bf16_panel_block<1, Block>, &tile_times_bf16_panel_block<2, Block>,
      &tile_times_bf16_panel_block<3, Block>, &tile_times_bf16_panel_block<4, Block>,
      &tile_times_bf16_panel_block<5, Block>, &tile_times_bf16_panel_block<6, Block>};
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t panel_elems = k_pairs * 2 * Block;
  for_panel_tiles(N / Block, tiles, [&](int64_t p, int64_t first_tile, int64_t end_tile,
                                        bool more) {
    const int64_t m_begin = first_tile * kTileRows, m_end = std::min(M, end_tile * kTileRows);
    // Written by each tile's first block of k (k_pairs >= 1: linear_panels_on checks K) before
    // it is read: left uninitialised.
    const std::unique_ptr<float[]> total(new float[(m_end - m_begin) * Block]);
    const at::BFloat16* panel = panels + p * panel_elems;
    NextPanelFetch fetch(more ? panel + panel_elems : nullptr,
                         panel_elems * static_cast<int64_t>(sizeof(at::BFloat16)),
                         end_tile - first_tile, k_pairs, fetched_panel_bytes());
    for (int64_t k0 = 0; k0 < k_pairs; k0 += block_pairs) {
      const int64_t k1 = std::min(k_pairs, k0 + block_pairs);
      for (int64_t m = m_begin; m < m_end; m += kTileRows) {
        kTiles[std::min<int64_t>(kTileRows, m_end - m) - 1](
            x_pairs + m * k_pairs, k_pairs, panel, k0, k1, k0 == 0,
            total.get() + (m - m_begin) * Block, fetch.for_tile(k1 - k0));
      }
    }
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int v = 0; v < Block / 16; ++v) {
        store_with_bias(_mm512_loadu_ps(total.get() + (m - m_begin) * Block + v * 16),
                        bias == nullptr ? nullptr : bias + p * Block + v * 16,
                        y + m * N + p * Block + v * 16);
      }
    }
  });
}

#endif

// torch's op `name` (mkldnn::data_ptr, mkldnn::_nbytes) on a oneDNN tensor: where its data
// starts, how many bytes it takes (no ATen accessor reaches an opaque tensor's data).
int64_t mkldnn_query(const c10::OperatorHandle& op, const at::Tensor& t) {
  std::vector<c10::IValue> stack{t};
  op.callBoxed(&stack);
  return stack[0].toInt();
}

c10::OperatorHandle mkldnn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

PanelWeight panel_weight(const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2,
              "linear_panels: a weight [N, K] reordered by oneDNN");
  static const c10::OperatorHandle nbytes = mkldnn_op("mkldnn::_nbytes");
  static const c10::OperatorHandle data_ptr = mkldnn_op("mkldnn::data_ptr");
  return {reinterpret_cast<const void*>(mkldnn_query(data_ptr, packed)),
          mkldnn_query(nbytes, packed), packed.scalar_type(), packed.size(0), packed.size(1)};
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_pad,
                         int64_t block, int64_t k_block, const c10::optional<at::Tensor>& bias) {
  const PanelWeight weight = panel_weight(packed);
  TORCH_CHECK(weight.n == n, "linear_panels: the weight has ", weight.n, " outputs, not ", n);
  return linear_panels_on(x, weight, k_pad, block, k_block, bias);
}

at::Tensor linear_panels_on(const at::Tensor& x, const PanelWeight& weight, int64_t k_pad,
                            int64_t block, int64_t k_block, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = weight.dtype;
  const int64_t n = weight.n;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16) && x.size(1) == weight.k,
              "linear_panels: contiguous x [M, K] of the weight's K and dtype, float32 or "
              "bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && K >= 1, "linear_panels: at least one row and one column");
  TORCH_CHECK(M <= kMaxPanelRows || dtype == at::kBFloat16, "linear_panels: 1 to ",
              kMaxPanelRows, " rows in float32");
  // bfloat16 panels hold k in pairs: k_pad even
  TORCH_CHECK((block == 16 || block == 32 || block == 64) && block % kLanes == 0 &&
                  n % block == 0 && k_pad >= K && (dtype == at::kFloat || k_pad % 2 == 0),
              "linear_panels: panels of ", block, " channels, N ", n, ", K ", K, " of ", k_pad);
  // float32 sums k in its own order (one block); bfloat16 in blocks of pairs
  TORCH_CHECK(k_block >= 0 && (dtype == at::kFloat ? k_block == 0 : k_block % 2 == 0),
              "linear_panels: k_block ", k_block, " for ", dtype);
  TORCH_CHECK(n * k_pad * static_cast<int64_t>(c10::elementSize(dtype)) <= weight.nbytes,
              "linear_panels: the packed weight is smaller than its panels");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == dtype,
                "linear_panels: bias shape or dtype");
  }
  at::Tensor y = at::empty({M, n}, x.options());
  const void* wp = weight.data;
  if (dtype == at::kBFloat16) {
#if defined(__AVX512BF16__)
    // x in pairs of k as 32-bit lanes, zero past K (the weight's padding is zero too)
    const int64_t k_pairs = k_pad / 2;
    const int64_t block_pairs = k_block == 0 ? k_pairs : k_block / 2;
    const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
    const auto* panels = static_cast<const at::BFloat16*>(wp);
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    std::vector<uint32_t> x_pairs;
    const uint32_t* xs = nullptr;
    if (k_pad == K && reinterpret_cast<uintptr_t>(x.data_ptr()) % alignof(uint32_t) == 0) {
      // x's rows are pairs already (contiguous, K even)
      xs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
    } else {
      x_pairs.assign(M * k_pairs, 0);
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(x_pairs.data() + m * k_pairs, x.data_ptr<at::BFloat16>() + m * K,
                    K * sizeof(at::BFloat16));
      }
      xs = x_pairs.data();
    }
    const auto run = [&](auto width) {
      rows_times_bf16_panels<decltype(width)::value>(xs, panels, bp, yp, M, k_pairs, block_pairs,
                                                     n);
    };
    switch (block) {
      case 16: run(std::integral_constant<int, 16>{}); break;
      case 32: run(std::integral_constant<int, 32>{}); break;
      default: run(std::integral_constant<int, 64>{}); break;
    }
    return y;
#else
    TORCH_CHECK(false, "linear_panels: bfloat16 needs AVX512-BF16, which this build lacks");
#endif
  }
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const auto* fp = static_cast<const float*>(wp);
  float* yp = y.data_ptr<float>();
  switch (block) {
    case 16: linear_panels_block<16>(xp, fp, bp, yp, M, K, k_pad, n); break;
    case 32: linear_panels_block<32>(xp, fp, bp, yp, M, K, k_pad, n); break;
    default: linear_panels_block<64>(xp, fp, bp, yp, M, K, k_pad, n); break;
  }
  return y;
}

bool panels_hold(const at::Tensor& packed, const at::Tensor& weight, int64_t block,
                 int64_t k_pad) {
  const PanelWeight panels = panel_weight(packed);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == panels.dtype &&
                  weight.size(0) == panels.n && weight.size(1) == panels.k,
              "panels_hold: a contiguous weight [N, K] of the packed one's shape and dtype");
  const int64_t n = panels.n, k = panels.k, size = weight.element_size();
  TORCH_CHECK(size == 2 || size == 4, "panels_hold: 16- or 32-bit elements");
  const int64_t group = 4 / size;
  if (block <= 0 || n % block != 0 || k_pad < k || k_pad % group != 0 ||
      n * k_pad * size > panels.nbytes) {
    return false;
  }
  // Lane l of channel j of panel p holds weight[p * block + j][l * group, l * group + group),
  // zeros past k. Compared bit for bit a 32-bit lane at a time, 16 lanes (a cache line of a
  // weight row) by a panel's channels at a time: rows K apart share cache sets, so a row's line
  // is read whole at once, not a lane at a time across all the panel's lanes.
  const auto* bytes = static_cast<const char*>(panels.data);
  const auto* plain = static_cast<const char*>(weight.data_ptr());
  const int64_t full = k / group, lanes = k_pad / group;  // lanes of k values only; all lanes
  const auto word = [](const char* at) {
    uint32_t w;
    std::memcpy(&w, at, sizeof(w));  // a weight row of odd K in bfloat16 is 2-byte aligned
    return w;
  };
  std::atomic<bool> same{true};
  at::parallel_for(0, n / block, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end && same.load(std::memory_order_relaxed); ++p) {
      const char* panel = bytes + p * lanes * block * 4;
      const char* rows = plain + p * block * k * size;
      uint32_t diff = 0;
      for (int64_t l0 = 0; l0 < full; l0 += 16) {
        const int64_t l1 = std::min(full, l0 + 16);
        for (int64_t j = 0; j < block; ++j) {
          // a panel's rows are more streams than the hardware prefetcher follows: the next
          // tile's line of each, by hand (a hint: past the row's end it fetches nothing wrong)
          __builtin_prefetch(rows + (j * k + (l0 + 32) * group) * size);
          for (int64_t l = l0; l < l1; ++l) {
            diff |= word(panel + (l * block + j) * 4) ^ word(rows + (j * k + l * group) * size);
          }
        }
      }
      if (full < lanes && k % group != 0) {  // bfloat16, K odd: k - 1 and a zero
        for (int64_t j = 0; j < block; ++j) {
          uint16_t value;
          std::memcpy(&value, rows + (j * k + k - 1) * size, sizeof(value));
          diff |= word(panel + (full * block + j) * 4) ^ value;  // little-endian: low half
        }
      }
      for (int64_t l = full + (k % group != 0 ? 1 : 0); l < lanes; ++l) {
        for (int64_t j = 0; j < block; ++j) diff |= word(panel + (l * block + j) * 4);
      }
      if (diff != 0) same = false;
    }
  });
  return same.load();
}

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
