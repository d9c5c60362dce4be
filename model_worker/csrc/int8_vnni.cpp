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
// SwiGLU on the tiles' outputs takes ATen's 16-lane float vectors (vec_utils.h's Vec), which a
// build for another capability than AVX-512 does not have: there the op runs the two passes.
#if defined(RADIXSERVE_INT8_VNNI) && defined(CPU_CAPABILITY_AVX512)
#define RADIXSERVE_VNNI_SWIGLU 1
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include <c10/util/BFloat16.h>

#include "ops.h"
#include "panel_tiles.h"
#include "quantize_row.h"
#include "vec_utils.h"

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
// Outputs of gate's blocks, and as many of up's, that a thread of int8_vnni_linear_silu_and_mul
// keeps at a time, at most: 256 KB each, in the L2 cache beside the blocks being read.
constexpr int64_t kRunFloats = 64 * 1024;
// Rows up to which int8_vnni_linear_silu_and_mul splits the weight's blocks as int8_vnni_linear
// does (a tile's rows, so that each block is read once).
constexpr int64_t kFewRows = kRows;
#if defined(RADIXSERVE_VNNI_SWIGLU)
static_assert(kLanes == kVec, "the outputs' float vectors are the sums' int32 vectors");
#endif

struct Tile {
  const int8_t* x;       // the tile's first token, quantized; rows k_pad apart
  const float* x_scale;  // its tokens' scales
  const int32_t* x_sum;  // 128 * sum_k x, per token
  const uint8_t* w;      // the tile's block
  const float* w_scale;  // the block's first channel
  const float* bias;     // likewise, or nullptr
  int64_t k_pad, channels;  // channels: to emit, at most kBlock
  FetchLines fetch;         // the thread's next block, a share of it (panel_tiles.h)
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

// The tile's outputs, each as int8.cpp's rescale() computes it, fma(float(sum), x_scale *
// w_scale, bias), handed to emit(row, first channel, mask, 16 outputs). The loops over r and v
// are unrolled (GCC otherwise keeps acc on the stack, a load and a store around every
// vpdpbusd); never inlined, since two tiles inlined into one function (silu_and_mul's) spilled
// the sums to the stack again, at 2.3x the time.
template <int R, typename Emit>
__attribute__((noinline)) void vnni_tile(const Tile& t, const Emit& emit) {
  constexpr int V = kVecs;
  __m512i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t k = 0, i = 0; k < t.k_pad; k += kGroup, ++i) {
    t.fetch.fetch_at(i);
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
        emit(r, c, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, b));
      }
    }
  }
}

// Runs f<R>() for a tile of min(rows, 6) rows.
template <typename F>
inline void with_tile_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// x's rows quantized for the tiles, each on its own scale as quantize_rows_int8 does, k_pad
// apart (the padding zeros), with 128 * their sum: the flipped weight's extra term.
struct QuantizedRows {
  at::Tensor q_tensor, scale_tensor, sum_tensor;  // own what the pointers point into
  int8_t* q;
  float* scale;
  int32_t* sum;
};

QuantizedRows quantize_for_tiles(const at::Tensor& x, int64_t k_pad, const char* op) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows rows{at::empty({M, k_pad}, x.options().dtype(at::kChar)),
                     at::empty({M}, x.options().dtype(at::kFloat)),
                     at::empty({M}, x.options().dtype(at::kInt))};
  rows.q = rows.q_tensor.data_ptr<int8_t>();
  rows.scale = rows.scale_tensor.data_ptr<float>();
  rows.sum = rows.sum_tensor.data_ptr<int32_t>();
  int8_t* qp = rows.q;
  float* xs = rows.scale;
  int32_t* sums = rows.sum;
  RADIXSERVE_DISPATCH_FLOAT(x, op, [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        int8_t* q = qp + m * k_pad;
        xs[m] = quantize_row(xp + m * x.stride(0), K, q);
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += q[k];
        for (int64_t k = K; k < k_pad; ++k) q[k] = 0;
        sums[m] = 128 * sum;
      }
    });
  });
  return rows;
}

// The tile of rows [m, m + kRows) against block `block` (channels from n0 = block * kBlock).
inline Tile tile_of(const QuantizedRows& xq, const uint8_t* w, const float* w_scale,
                    const float* bias, int64_t k_pad, int64_t n, int64_t m, int64_t block) {
  const int64_t n0 = block * kBlock;
  return Tile{xq.q + m * k_pad,
              xq.scale + m,
              xq.sum + m,
              w + block * k_pad * kBlock,
              w_scale + n0,
              bias == nullptr ? nullptr : bias + n0,
              k_pad,
              std::min(kBlock, n - n0)};
}
#endif

// The checks both ops make; returns the bias as float32 data, or nullptr.
const float* check_vnni_args(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == kGroup,
              op, ": contiguous uint8 packed [blocks, k_pad / 4, 64, 4]");
  const int64_t K = x.size(1), N = w_scale.numel();
  const int64_t k_pad = packed.size(1) * kGroup, blocks = packed.size(0);
  TORCH_CHECK((K + kGroup - 1) / kGroup * kGroup == k_pad && (N + kBlock - 1) / kBlock == blocks,
              op, ": x of ", K, " columns and ", N, " scales for a layout of ", blocks,
              " blocks by ", k_pad);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(), op,
              ": weight scales must be contiguous float32 [N]");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              op, ": bias must be contiguous float32 [N]");
  return bias->data_ptr<float>();
}

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
  const float* bp = check_vnni_args(x, packed, w_scale, bias, "int8_vnni_linear");
  const int64_t M = x.size(0), N = w_scale.numel();
  const int64_t k_pad = packed.size(1) * kGroup, blocks = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(RADIXSERVE_INT8_VNNI)
  const QuantizedRows xq = quantize_for_tiles(x, k_pad, "int8_vnni_linear");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* ws = w_scale.data_ptr<float>();
  RADIXSERVE_DISPATCH_FLOAT(y, "int8_vnni_linear", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // Threads take even runs of (block of output channels, tile of rows): each reads its part
    // of the weight once.
    for_panel_tiles(blocks, (M + kRows - 1) / kRows, [&](int64_t block, int64_t first_tile,
                                                          int64_t end_tile, bool more) {
      const int64_t m_end = std::min(M, end_tile * kRows);
      const uint8_t* next = more ? wp + (block + 1) * k_pad * kBlock : nullptr;
      NextPanelFetch fetch(next, k_pad * kBlock, end_tile - first_tile, k_pad / kGroup,
                           fetched_panel_bytes());
      for (int64_t m = first_tile * kRows; m < m_end; m += kRows) {
        Tile tile = tile_of(xq, wp, ws, bp, k_pad, N, m, block);
        tile.fetch = fetch.for_tile(k_pad / kGroup);
        scalar_t* out = yp + m * N + block * kBlock;
        with_tile_rows(M - m, [&](auto rows) {
          vnni_tile<decltype(rows)::value>(tile, [out, N](int r, int64_t c, __mmask16 mask,
                                                          __m512 v) {
            store_outputs(out + r * N + c, mask, v);
          });
        });
      }
    });
  });
#else
  TORCH_CHECK(false, "int8_vnni_linear: this build has no AVX512-VNNI (int8_vnni_available)");
#endif
  return y;
}

at::Tensor int8_vnni_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                         const at::Tensor& w_scale,
                                         const c10::optional<at::Tensor>& bias_in) {
  const int64_t N = w_scale.numel(), I = N / 2;
  TORCH_CHECK(N % 2 == 0, "int8_vnni_linear_silu_and_mul: ", N, " outputs are not [gate | up]");
#if defined(RADIXSERVE_VNNI_SWIGLU)
  const bool pairs = I % kBlock == 0;
#else
  const bool pairs = false;
#endif
  // Checked first, under this op's own name, whichever way it runs (on an AVX2 build too).
  const c10::optional<at::Tensor> bias = bias_as_float(bias_in);
  const float* bp = check_vnni_args(x, packed, w_scale, bias, "int8_vnni_linear_silu_and_mul");
  if (!pairs) {  // gate's and up's blocks do not pair (or no 16-lane Vec): the two passes
    return silu_and_mul(int8_vnni_linear(x, packed, w_scale, bias_in));
  }
  const int64_t M = x.size(0), k_pad = packed.size(1) * kGroup;
  at::Tensor y = at::empty({M, I}, x.options());
  if (M == 0 || I == 0) return y;
#if defined(RADIXSERVE_VNNI_SWIGLU)
  const QuantizedRows xq = quantize_for_tiles(x, k_pad, "int8_vnni_linear_silu_and_mul");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* ws = w_scale.data_ptr<float>();
  const int64_t up_blocks = I / kBlock;  // gate block b pairs with up block b + up_blocks
  RADIXSERVE_DISPATCH_FLOAT(y, "int8_vnni_linear_silu_and_mul", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    if (M <= kFewRows) {
      // A few rows: the weight's read from memory is the whole cost, and the threads read it as
      // int8_vnni_linear does, gate's blocks and up's apart (a thread taking each its gate's and
      // up's blocks was 1.14-1.17x slower at one row on two threads, at the 8B's 4,096 x 24,576),
      // into float32 outputs; then silu(gate) * up, rounded once: the bits of the paths below.
      const std::unique_ptr<float[]> both(new float[M * N]);
      float* bp_out = both.get();
      at::parallel_for(0, 2 * up_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t block = begin; block < end; ++block) {
          float* dst = bp_out + block * kBlock;
          with_tile_rows(M, [&](auto rows) {
            vnni_tile<decltype(rows)::value>(
                tile_of(xq, wp, ws, bp, k_pad, N, 0, block),
                [dst, N](int r, int64_t c, __mmask16, __m512 v) {
                  _mm512_storeu_ps(dst + r * N + c, v);
                });
          });
        }
      });
      at::parallel_for(0, up_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = 0; r < M; ++r) {
          for (int64_t c = begin * kBlock; c < end * kBlock; c += kVec) {
            const Vec out = silu_mul(Vec::loadu(bp_out + r * N + c),
                                     Vec::loadu(bp_out + r * N + I + c));
            store_outputs(yp + r * I + c, 0xFFFF, __m512(out));
          }
        }
      });
      return;
    }
    // A thread takes a range of gate's blocks and up's of the same channels. Their outputs wait
    // in float32 in the cache (not a [rows, 2 x intermediate] tensor in the activations' dtype,
    // written out and read back), then silu(gate) * up is rounded once. The order of the tiles
    // changes no output's bits.
    at::parallel_for(0, up_blocks, 1, [&](int64_t begin, int64_t end) {
      const int64_t chunk = kRunFloats / (M * kBlock);  // pairs whose outputs fit
      if (chunk >= 2) {
        // A chunk's gate blocks in a row, then its up blocks: the weight comes as the plain
        // kernel reads it, one stream at a time (gate's block and then up's, pair by pair,
        // restarted a stream every block, 57 KB at K = 896: 10-18% slower at 1 to 6 rows).
        // The buffers are left uninitialised, since every float is written before it is read:
        // zeroing them took ~5% of a one-row call.
        const int64_t floats = M * std::min(chunk, end - begin) * kBlock;
        const std::unique_ptr<float[]> gate(new float[floats]), up(new float[floats]);
        for (int64_t first = begin; first < end; first += chunk) {
          const int64_t last = std::min(end, first + chunk);
          const int64_t stride = (last - first) * kBlock;  // row r's outputs at [r * stride]
          for (const auto& [offset, outputs] : {std::pair{int64_t{0}, gate.get()},
                                                std::pair{up_blocks, up.get()}}) {
            for (int64_t block = first; block < last; ++block) {
              // The thread's next block: this half's next, up's first, the next chunk's first.
              const int64_t next = block + 1 < last ? block + 1 + offset
                                   : offset == 0    ? first + up_blocks
                                   : last < end     ? last
                                                    : -1;
              // Up to 512 KB of outputs wait in L2 as well (kRunFloats): blocks up to an
              // eighth of it fetched.
              NextPanelFetch fetch(next < 0 ? nullptr : wp + next * k_pad * kBlock,
                                   k_pad * kBlock, (M + kRows - 1) / kRows, k_pad / kGroup,
                                   l2_cache_bytes() / 8);
              for (int64_t m = 0; m < M; m += kRows) {
                float* dst = outputs + m * stride + (block - first) * kBlock;
                Tile tile = tile_of(xq, wp, ws, bp, k_pad, N, m, block + offset);
                tile.fetch = fetch.for_tile(k_pad / kGroup);
                with_tile_rows(M - m, [&](auto rows) {
                  vnni_tile<decltype(rows)::value>(
                      tile, [dst, stride](int r, int64_t c, __mmask16, __m512 v) {
                        _mm512_storeu_ps(dst + r * stride + c, v);
                      });
                });
              }
            }
          }
          // SwiGLU apart from the tiles: in an up tile's epilogue it stalled the weight's
          // stream, where a few rows' tiles wait on memory (1.02-1.08x the time at 4-12 rows).
          for (int64_t r = 0; r < M; ++r) {
            scalar_t* out = yp + r * I + first * kBlock;
            for (int64_t c = 0; c < stride; c += kVec) {
              const Vec both = silu_mul(Vec::loadu(gate.get() + r * stride + c),
                                        Vec::loadu(up.get() + r * stride + c));
              store_outputs(out + c, 0xFFFF, __m512(both));
            }
          }
        }
        return;
      }
      // Many rows: each tile of rows through gate's block and then up's, gate's outputs waiting
      // in L1; both blocks stay in the L2 cache across the rows' tiles.
      alignas(64) float gate[kRows][kBlock];
      const auto emit_gate = [&gate](int r, int64_t c, __mmask16, __m512 v) {
        _mm512_store_ps(gate[r] + c, v);
      };
      for (int64_t block = begin; block < end; ++block) {
        for (int64_t m = 0; m < M; m += kRows) {
          scalar_t* out = yp + m * I + block * kBlock;
          const auto emit_out = [&gate, out, I](int r, int64_t c, __mmask16 mask, __m512 v) {
            store_outputs(out + r * I + c, mask, __m512(silu_mul(Vec::loadu(gate[r] + c), Vec(v))));
          };
          with_tile_rows(M - m, [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            vnni_tile<R>(tile_of(xq, wp, ws, bp, k_pad, N, m, block), emit_gate);
            vnni_tile<R>(tile_of(xq, wp, ws, bp, k_pad, N, m, block + up_blocks), emit_out);
          });
        }
      }
    });
  });
#else
  TORCH_CHECK(false, "int8_vnni_linear_silu_and_mul: unreachable without RADIXSERVE_VNNI_SWIGLU");
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
