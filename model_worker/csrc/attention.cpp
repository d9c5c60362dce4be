// Attention that reads the paged KV pool in place: no gathered copy of any context, no padding
// to the longest sequence. One call serves a mixed batch (decodes, prefill chunks, prefix hits).
// float32 or bfloat16 q, k, v and pool (a bfloat16 pool halves the bytes a decode step reads);
// scores, softmax and sums in float32.
//
// A work unit's query rows (its tokens x the query heads of one KV head) meet a block of keys as
// two small matrix products, FlashAttention-2's tiles on a CPU. Scores: the block's K rows are
// transposed once into a small buffer, keys along the vector lanes, so that a query row's scores
// for kLanes keys are one vector of fused multiply-adds over the head size (the query element
// broadcast), with no horizontal sum per (row, key); in bfloat16 on CPUs with AVX512-BF16 the
// buffer holds bfloat16 pairs and vdpbf16ps takes two elements a lane (the scale applied to the
// sums). P x V: each V row is a vector, widened to float32 once per row group (once per block,
// into a buffer, where the rows span several groups), each probability a broadcast, the rows'
// sums in registers; where the scores take vdpbf16ps, so does P x V, on the probabilities
// rounded to bfloat16 (as FlashAttention's P x V; the softmax's sums stay float32) and two keys'
// V rows interleaved into pairs: half the multiply-adds. Softmax's exp is ATen's exp_u20 on
// vectors of a row's scores (within 20 ulp, as ATen's flash attention), the last one masked;
// the rescale of its sums takes std::exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#include <immintrin.h>
#define RADIXSERVE_ATTN_AVX512 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_size.h"
#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

constexpr int64_t kBlockKeys = 64;    // keys a step of the online softmax scores, at most
constexpr int64_t kChunks = kBlockKeys / kLanes;  // key vectors (of kLanes keys) in a block
constexpr int64_t kQueryRows = 64;    // query rows (tokens x heads of one KV head) per work item
constexpr int64_t kPrefetchKeys = 8;  // keys ahead whose K and V rows are prefetched
constexpr int kRowGroup = 8;          // query rows whose sums stay in registers together

// A head's K or V row sits at a slot of the pool that no pattern predicts (a decode step's
// tokens are interleaved with other sequences'): fetch it ahead, or every key waits for memory.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(T)) __builtin_prefetch(row + d);
}

// A work unit's K and V rows (elements [offset, offset + row_elems) of each of its keys' slots)
// fetched toward L2 while the thread computes the unit before it, in step with that unit's work:
// a decode's rows come from memory (a step's K and V outgrow L3), and the unit's own
// 8-keys-ahead fetches into L1 then find them in L2 instead of waiting on memory in a burst.
// Only the unit's first next_unit_bytes(): with the fetch in step, the L2 holds about a unit's
// rows at a time (the rest of the one in hand, the start of the next), so half of it (512 KB on
// a Zen 4 core).
inline int64_t next_unit_bytes() { return l2_cache_bytes() / 2; }

template <typename T>
struct NextUnitRows {
  const T* k = nullptr;
  const T* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t heads = 0, offset = 0, row_elems = 0, head_size = 0;
  int64_t keys = 0, fetched = 0;  // the keys to fetch (none: no next unit), those fetched

  NextUnitRows(const T* k_pool, const T* v_pool) : k(k_pool), v(v_pool) {}
  NextUnitRows(const T* k_pool, const T* v_pool, const int64_t* unit_slots, int64_t unit_keys,
               int64_t pool_heads, int64_t pool_head_size, int64_t first_elem, int64_t elems)
      : k(k_pool), v(v_pool), slots(unit_slots), heads(pool_heads), offset(first_elem),
        row_elems(elems), head_size(pool_head_size),
        keys(std::min(unit_keys,
                      next_unit_bytes() / (2 * elems * static_cast<int64_t>(sizeof(T))))) {}

  // `done` of the unit in hand's `total` (any measure of its work, total > 0) done: the same
  // share of these rows fetched. Called often, in small steps: a (block, head)'s share fetched
  // at once queued its prefetches up on the memory, which stalled the thread (a decode of
  // 64 x 200 from memory ran ~1.3x slower).
  void fetch_due(int64_t done, int64_t total) {
    if (fetched == keys) return;
    const int64_t end = keys * std::min(done, total) / total;
    for (; fetched < end; ++fetched) {
      const int64_t at = (slots[fetched] * heads) * head_size + offset;
      for (int64_t e = 0; e < row_elems; e += 64 / sizeof(T)) {
        __builtin_prefetch(k + at + e, 0, 2);  // locality 2: prefetcht1 on x86
        __builtin_prefetch(v + at + e, 0, 2);
      }
      __builtin_prefetch(k + at + row_elems - 1, 0, 2);  // the row's last line, where it starts
      __builtin_prefetch(v + at + row_elems - 1, 0, 2);  // past a line's first byte
    }
  }
};

// How a block's K rows are packed, as 32-bit elements: float32 values (Float), bfloat16 pairs
// for vdpbf16ps (Pairs), or bfloat16 values widened to float32 (Widened: bfloat16 with an odd
// head size, or on a build without AVX512-BF16, which kernel_selection keeps off cpu_extension
// but which must work).
enum class KeyPack { Float, Pairs, Widened };

template <KeyPack P, typename T>
inline uint32_t key_element(const T* row, int64_t e) {
  uint32_t bits;
  if constexpr (P == KeyPack::Widened) {
    uint16_t half;
    std::memcpy(&half, row + e, sizeof(half));
    bits = static_cast<uint32_t>(half) << 16;  // bfloat16 is float32's upper half
  } else {
    std::memcpy(&bits, reinterpret_cast<const char*>(row) + e * 4, sizeof(bits));
  }
  return bits;
}

#if defined(RADIXSERVE_ATTN_AVX512)
template <KeyPack P, typename T>
inline __m512i load_key_elements(const T* row, int64_t e) {
  if constexpr (P == KeyPack::Widened) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + e));
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
  } else {
    return _mm512_loadu_si512(reinterpret_cast<const char*>(row) + e * 4);
  }
}

// r[i] lane j <- r[j] lane i, for 16 vectors of 16 32-bit lanes: 64 shuffles, in-register.
inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {  // 128-bit lanes: [r2k[i], r2k+1[i], ...] pairs of rows
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // u[4m + p], 128-bit lane L: element 4L + p of rows 4m..4m+3
    r[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
    r[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
    r[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
    r[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int p = 0; p < 4; ++p) {  // gather 128-bit lane L of u[p], u[4 + p], ... into 4L + p
    const __m512i w_lo = _mm512_shuffle_i32x4(r[p], r[4 + p], 0x44);
    const __m512i w_hi = _mm512_shuffle_i32x4(r[p], r[4 + p], 0xEE);
    const __m512i x_lo = _mm512_shuffle_i32x4(r[8 + p], r[12 + p], 0x44);
    const __m512i x_hi = _mm512_shuffle_i32x4(r[8 + p], r[12 + p], 0xEE);
    t[p] = _mm512_shuffle_i32x4(w_lo, x_lo, 0x88);
    t[4 + p] = _mm512_shuffle_i32x4(w_lo, x_lo, 0xDD);
    t[8 + p] = _mm512_shuffle_i32x4(w_hi, x_hi, 0x88);
    t[12 + p] = _mm512_shuffle_i32x4(w_hi, x_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// chunk[e][l] = element e (of E) of key l's row (of `keys`, at most kLanes), from `offset` on;
// zero past the keys, so that every key vector is whole.
template <KeyPack P, typename T>
void pack_key_chunk(const T* const* rows, int64_t offset, int64_t keys, int64_t E,
                    uint32_t* chunk) {
  int64_t e = 0;
#if defined(RADIXSERVE_ATTN_AVX512)
  for (; e + 16 <= E; e += 16) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j) {
      r[j] = j < keys ? load_key_elements<P>(rows[j] + offset, e) : _mm512_setzero_si512();
    }
    transpose_16x16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(chunk + (e + i) * kLanes, r[i]);
  }
#endif
  for (; e < E; ++e) {
    for (int64_t j = 0; j < kLanes; ++j) {
      chunk[e * kLanes + j] = j < keys ? key_element<P>(rows[j] + offset, e) : 0u;
    }
  }
}

// s[i][c * kLanes + l] = q_i . k_(c * kLanes + l) for RN query rows (row stride E elements) and
// NC key vectors from c0: per element, NC loads of the packed keys and RN x NC multiply-adds.
// kE: E when known at compile time, else 0.
template <int RN, int NC, int kE>
void score_keys(const float* q, int64_t E, const uint32_t* kt, int64_t c0, float* s) {
  const int64_t n_elems = kE > 0 ? kE : E;
  Vec a[RN][NC];
  for (int i = 0; i < RN; ++i) {
    for (int c = 0; c < NC; ++c) a[i][c] = Vec(0.f);
  }
  const float* k = reinterpret_cast<const float*>(kt) + c0 * n_elems * kLanes;
  for (int64_t e = 0; e < n_elems; ++e) {
    Vec kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = Vec::loadu(k + (c * n_elems + e) * kLanes);
    for (int i = 0; i < RN; ++i) {
      const Vec qv(q[i * n_elems + e]);
      for (int c = 0; c < NC; ++c) a[i][c] = at::vec::fmadd(qv, kv[c], a[i][c]);
    }
  }
  for (int i = 0; i < RN; ++i) {
    for (int c = 0; c < NC; ++c) a[i][c].store(s + i * kBlockKeys + (c0 + c) * kLanes);
  }
}

#if defined(__AVX512BF16__) && defined(RADIXSERVE_ATTN_AVX512)
// The same on bfloat16 pairs (q: [RN][E] pairs, unscaled), two products a lane per vdpbf16ps,
// each exact in float32; the sums are scaled once at the end.
template <int RN, int NC, int kE>
void score_key_pairs(const uint32_t* q, int64_t E, const uint32_t* kt, int64_t c0, float scale,
                     float* s) {
  const int64_t n_pairs = kE > 0 ? kE : E;
  __m512 a[RN][NC];
  for (int i = 0; i < RN; ++i) {
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_setzero_ps();
  }
  const uint32_t* k = kt + c0 * n_pairs * 16;
  for (int64_t e = 0; e < n_pairs; ++e) {
    __m512bh kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + (c * n_pairs + e) * 16);
    for (int i = 0; i < RN; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(q[i * n_pairs + e]);
      for (int c = 0; c < NC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], qv, kv[c]);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < RN; ++i) {
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(s + i * kBlockKeys + (c0 + c) * 16, _mm512_mul_ps(a[i][c], vscale));
    }
  }
}
#endif

// acc[i] += sum_j p[i][j] v_j for RN query rows over the V rows from `offset` on (elements d0..D
// of a row of D): each V vector loaded (and widened to float32) once for all RN rows, two vectors
// of each row's sums in registers.
template <int RN, typename V>
void accumulate_rows(const float* p, const V* const* v_rows, int64_t offset, int64_t n,
                     int64_t D, float* acc, int64_t d0 = 0) {
  int64_t d = d0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    Vec a[RN][2];
    for (int i = 0; i < RN; ++i) {
      a[i][0] = Vec::loadu(acc + i * D + d);
      a[i][1] = Vec::loadu(acc + i * D + d + kLanes);
    }
    for (int64_t j = 0; j < n; ++j) {
      const V* vr = v_rows[j] + offset + d;
      const Vec v0 = load_float(vr), v1 = load_float(vr + kLanes);
      for (int i = 0; i < RN; ++i) {
        const Vec pv(p[i * kBlockKeys + j]);
        a[i][0] = at::vec::fmadd(pv, v0, a[i][0]);
        a[i][1] = at::vec::fmadd(pv, v1, a[i][1]);
      }
    }
    for (int i = 0; i < RN; ++i) {
      a[i][0].store(acc + i * D + d);
      a[i][1].store(acc + i * D + d + kLanes);
    }
  }
  for (; d + kLanes <= D; d += kLanes) {
    Vec a[RN];
    for (int i = 0; i < RN; ++i) a[i] = Vec::loadu(acc + i * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const Vec vv = load_float(v_rows[j] + offset + d);
      for (int i = 0; i < RN; ++i) a[i] = at::vec::fmadd(Vec(p[i * kBlockKeys + j]), vv, a[i]);
    }
    for (int i = 0; i < RN; ++i) a[i].store(acc + i * D + d);
  }
  for (; d < D; ++d) {
    for (int64_t j = 0; j < n; ++j) {
      const float vd = static_cast<float>(v_rows[j][offset + d]);
      for (int i = 0; i < RN; ++i) acc[i * D + d] += p[i * kBlockKeys + j] * vd;
    }
  }
}

#if defined(__AVX512BF16__) && defined(RADIXSERVE_ATTN_AVX512)
// A row's probabilities rounded to bfloat16, in place (s, as float32 values) and as the pairs
// vdpbf16ps reads (pairs[m] = keys 2m and 2m + 1), for the first n keys (at most kBlockKeys;
// those past n up to the next 32 are rounded too, and never read); an odd n's last pair is
// completed with a zero.
inline void round_probabilities(float* s, int64_t n, uint32_t* pairs) {
  if (n % 2 == 1) s[n] = 0.f;  // n < kBlockKeys, which is even; a stale NaN times 0 is NaN
  for (int64_t j = 0; j < n; j += 2 * kLanes) {
    const __m512 lo = _mm512_loadu_ps(s + j), hi = _mm512_loadu_ps(s + j + kLanes);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 first
    _mm512_storeu_si512(pairs + j / 2, both);
    // bfloat16 is float32's upper half: the rounded values, widened back.
    _mm512_storeu_si512(s + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                   _mm512_castsi512_si256(both)), 16));
    _mm512_storeu_si512(s + j + kLanes, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm512_extracti64x4_epi64(both, 1)), 16));
  }
}

// acc[i] += sum_j p[i][j] v_j for RN query rows, as accumulate_rows, on bfloat16 probabilities
// and V rows: per 32 elements of a head, two keys' V rows interleaved once (unpacklo/hi: each
// 32-bit lane a (key 2m, key 2m + 1) pair of one element), then one vdpbf16ps per row and half,
// half the multiply-adds of float32's. The unpacks leave the lanes in the order below; a row's
// sums are brought to it and back once a block. Elements past the last 32 take float32's loop
// on the same rounded probabilities (s): every element sums the same products, whatever the
// rows' group.
static_assert(kLanes == 16, "accumulate_pairs: AVX-512's 16 float lanes");

template <int RN>
void accumulate_pairs(const uint32_t* pairs, const float* s, const at::BFloat16* const* v_rows,
                      int64_t offset, int64_t n, int64_t D, float* acc) {
  // Lane k of the low half holds element 8 (k / 4) + k % 4 of 32, of the high half 4 more.
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_add_epi32(to_lo, _mm512_set1_epi32(4));
  const __m512i back_0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back_1 = _mm512_add_epi32(back_0, _mm512_set1_epi32(8));
  const int64_t whole = n / 2;
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    __m512 lo[RN], hi[RN];
    for (int i = 0; i < RN; ++i) {
      const __m512 a0 = _mm512_loadu_ps(acc + i * D + d);
      const __m512 a1 = _mm512_loadu_ps(acc + i * D + d + 16);
      lo[i] = _mm512_permutex2var_ps(a0, to_lo, a1);
      hi[i] = _mm512_permutex2var_ps(a0, to_hi, a1);
    }
    const auto add_pair = [&](int64_t m, __m512i v0, __m512i v1) {
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
      const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      for (int i = 0; i < RN; ++i) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pairs[i * (kBlockKeys / 2) + m]);
        lo[i] = _mm512_dpbf16_ps(lo[i], pv, vlo);
        hi[i] = _mm512_dpbf16_ps(hi[i], pv, vhi);
      }
    };
    for (int64_t m = 0; m < whole; ++m) {
      add_pair(m, _mm512_loadu_si512(v_rows[2 * m] + offset + d),
               _mm512_loadu_si512(v_rows[2 * m + 1] + offset + d));
    }
    if (n % 2 == 1) {  // the last key alone, with a zero row (and probability) beside it
      add_pair(whole, _mm512_loadu_si512(v_rows[n - 1] + offset + d), _mm512_setzero_si512());
    }
    for (int i = 0; i < RN; ++i) {
      _mm512_storeu_ps(acc + i * D + d, _mm512_permutex2var_ps(lo[i], back_0, hi[i]));
      _mm512_storeu_ps(acc + i * D + d + 16, _mm512_permutex2var_ps(lo[i], back_1, hi[i]));
    }
  }
  if (d < D) accumulate_rows<RN>(s, v_rows, offset, n, D, acc, d);
}
#endif

// Runs f<RN>(first row) over rows [0, R) in groups of up to kRowGroup.
template <typename F>
void for_row_groups(int64_t R, F&& f) {
  for (int64_t r0 = 0; r0 < R; r0 += kRowGroup) {
    switch (std::min<int64_t>(kRowGroup, R - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 5: f(std::integral_constant<int, 5>{}, r0); break;
      case 6: f(std::integral_constant<int, 6>{}, r0); break;
      case 7: f(std::integral_constant<int, 7>{}, r0); break;
      default: f(std::integral_constant<int, 8>{}, r0); break;
    }
  }
}

// Key vectors scored together per row group: the RN x NC sums fill the registers, and enough
// independent sums are in flight to hide the multiply-add's latency.
template <int RN>
constexpr int chunks_per_pass() {
  return RN <= 2 ? 4 : RN <= 4 ? 2 : 1;
}

// Runs f<NC>(first key vector) over a block's nchunks key vectors, chunks_per_pass<RN> at once.
template <int RN, typename F>
void for_key_chunks(int64_t nchunks, F&& f) {
  constexpr int kPass = chunks_per_pass<RN>();
  int64_t c = 0;
  for (; c + kPass <= nchunks; c += kPass) f(std::integral_constant<int, kPass>{}, c);
  for (; c < nchunks; ++c) f(std::integral_constant<int, 1>{}, c);
}

// The largest score of a row's first cnt keys (at least one).
inline float row_max_of(const float* s, int64_t cnt) {
  const Vec none(-std::numeric_limits<float>::infinity());
  Vec vm = none;
  int64_t j = 0;
  for (; j + kLanes <= cnt; j += kLanes) vm = at::vec::maximum(vm, Vec::loadu(s + j));
  if (j < cnt) vm = at::vec::maximum(vm, Vec::set(none, Vec::loadu(s + j, cnt - j), cnt - j));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
}

struct Item {
  int64_t seq, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence's new tokens
  int64_t work;                 // ~ rows x keys, to hand out the largest items first
};

template <typename T>
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& out_cache_loc) {
  const int64_t num_tokens = k.size(0), heads = k.size(1), D = k.size(2);
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (loc[t] * heads + h) * D;
        std::memcpy(kc + dst, kp + t * k.stride(0) + h * k.stride(1), D * sizeof(T));
        std::memcpy(vc + dst, vp + t * v.stride(0) + h * v.stride(1), D * sizeof(T));
      }
    }
  });
}

// kD: the head size where it is a common one (compiled for it), else 0. P: how K is packed
// (KeyPack::Pairs only for bfloat16 with an even head size, on CPUs with AVX512-BF16).
template <typename T, int kD, KeyPack P>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_cache_loc,
                  const at::Tensor& kv_slots, const at::Tensor& prefix_lens,
                  const at::Tensor& extend_lens, double scale) {
  const int64_t num_tokens = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), B = extend_lens.size(0), L = kv_slots.size(1);
  write_kv<T>(k, v, k_cache, v_cache, out_cache_loc);

  constexpr bool kPairs = P == KeyPack::Pairs;
  const int64_t E = kPairs ? D / 2 : D;  // 32-bit elements of a packed key
  constexpr int kE = kD > 0 ? (kPairs ? kD / 2 : kD) : 0;
  const int64_t G = H / Hkv;  // query heads per KV head
  const int64_t q_block = std::max<int64_t>(1, kQueryRows / G);
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  std::vector<int64_t> first_token(B);
  std::vector<Item> items;
  for (int64_t b = 0, start = 0; b < B; start += extend[b], ++b) {
    first_token[b] = start;
    for (int64_t q0 = 0; q0 < extend[b]; q0 += q_block) {
      const int64_t q1 = std::min(extend[b], q0 + q_block);
      items.push_back({b, q0, q1, (q1 - q0) * (prefix[b] + q1)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.work > b.work; });

  at::Tensor out =
      at::empty({num_tokens, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* slots_all = kv_slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float fscale = static_cast<float>(scale);
  // A work unit takes every KV head of its item, reading each slot's K and V rows whole (one
  // contiguous run of memory per slot), unless there are too few items to keep every thread busy.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t heads_per_unit = num_items >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t units_per_item = Hkv / heads_per_unit;
  const int64_t num_work = num_items * units_per_item;

  // Dynamic scheduling: a causal prefill's later blocks cost more than its first ones. With many
  // units a thread takes its next unit as it starts one, so that it can fetch the next one's rows
  // meanwhile (with few, that would leave a thread without work).
  std::atomic<int64_t> next_work{0};
  const bool lookahead = num_work >= 4 * at::get_num_threads();
#pragma omp parallel if (num_work > 1 && !omp_in_parallel())
  {
    // Row r of head h (h counted from the unit's first head) is at [h * R + r]. The query rows
    // as float32, pre-scaled, or (kPairs) as the bfloat16 pairs vdpbf16ps reads, unscaled.
    const int64_t rows_max = q_block * G * heads_per_unit;
    std::vector<float> qbuf(kPairs ? 0 : rows_max * D), acc(rows_max * D);
    std::vector<uint32_t> qpairs(kPairs ? rows_max * E : 0);
    std::vector<float> scores(q_block * G * kBlockKeys), row_max(rows_max), row_sum(rows_max);
    // (kPairs) the rows' probabilities as bfloat16 pairs, for P x V.
    std::vector<uint32_t> prob_pairs(kPairs ? q_block * G * kBlockKeys / 2 : 0);
    std::vector<uint32_t> ktile(kChunks * E * kLanes);
    // A bfloat16 block's V rows widened once for all row groups, where there are several.
    std::vector<float> vtile(std::is_same_v<T, float> || kPairs ? 0 : kBlockKeys * D);
    std::vector<const float*> vtile_rows(kBlockKeys);
    for (int64_t j = 0; j < static_cast<int64_t>(vtile.size()) / D; ++j) {
      vtile_rows[j] = vtile.data() + j * D;
    }
    std::vector<int64_t> row_keys(q_block * G);
    std::vector<const T*> krows(kBlockKeys), vrows(kBlockKeys);
    int64_t w = next_work.fetch_add(1);
    while (w < num_work) {
      const int64_t w_next = lookahead ? next_work.fetch_add(1) : num_work;
      const Item& it = items[w / units_per_item];
      const int64_t h_begin = (w % units_per_item) * heads_per_unit;
      const Item* nx = w_next < num_work ? &items[w_next / units_per_item] : nullptr;
      NextUnitRows<T> next =
          nx == nullptr
              ? NextUnitRows<T>(kc, vc)
              : NextUnitRows<T>(kc, vc, slots_all + nx->seq * L, prefix[nx->seq] + nx->q_end,
                                Hkv, D, (w_next % units_per_item) * heads_per_unit * D,
                                heads_per_unit * D);
      const int64_t R = (it.q_end - it.q_begin) * G;  // row r: token q_begin + r / G, head r % G
      // Past 64 elements a head, half the keys a block: a head's K and V rows of 64 keys and its
      // packed keys outgrew L1 (a decode step of 64 at 32/8 x 128, slots in a row, ran ~20%
      // slower at 64 keys than at 32). By the head size alone, never by the rows: the blocks
      // fix the order of the softmax's sums, so a row's result would otherwise depend on
      // whether it came as a decode or in a prefill chunk.
      const int64_t block_keys = D > 64 ? kBlockKeys / 2 : kBlockKeys;
      const int64_t tok0 = first_token[it.seq] + it.q_begin;
      const int64_t* slots = slots_all + it.seq * L;
      for (int64_t r = 0; r < R; ++r) {
        // Causal: the row's token at position prefix + i sees keys 0..prefix + i.
        row_keys[r] = prefix[it.seq] + it.q_begin + r / G + 1;
      }
      for (int64_t hh = 0; hh < heads_per_unit; ++hh) {
        const int64_t h = h_begin + hh;
        for (int64_t r = 0; r < R; ++r) {
          const T* src = qp + (tok0 + r / G) * q.stride(0) + (h * G + r % G) * q.stride(1);
          if constexpr (kPairs) {
            std::memcpy(qpairs.data() + (hh * R + r) * E, src, D * sizeof(T));
          } else {
            float* dst = qbuf.data() + (hh * R + r) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
          }
          row_max[hh * R + r] = neg_inf;
          row_sum[hh * R + r] = 0.f;
        }
      }
      std::fill(acc.begin(), acc.begin() + heads_per_unit * R * D, 0.f);
      const int64_t row_floats = heads_per_unit * D;  // what this unit reads of a slot's row
      const int64_t kv_end = prefix[it.seq] + it.q_end;
      const int64_t unit_work = kv_end * heads_per_unit;  // keys x heads, for next.fetch_due
      for (int64_t j0 = 0; j0 < kv_end; j0 += block_keys) {
        const int64_t n = std::min(block_keys, kv_end - j0);
        const int64_t nchunks = (n + kLanes - 1) / kLanes;
        for (int64_t j = 0; j < n; ++j) {
          krows[j] = kc + (slots[j0 + j] * Hkv + h_begin) * D;
          vrows[j] = vc + (slots[j0 + j] * Hkv + h_begin) * D;
          if (j0 + j + kPrefetchKeys < kv_end) {
            const int64_t ahead = (slots[j0 + j + kPrefetchKeys] * Hkv + h_begin) * D;
            prefetch_row(kc + ahead, row_floats);
            prefetch_row(vc + ahead, row_floats);
          }
        }
        for (int64_t hh = 0; hh < heads_per_unit; ++hh) {
          float* acch = acc.data() + hh * R * D;
          // The next unit's fetch, in step with this head-block's four steps (packing chunk by
          // chunk, scores, softmax, P x V), each counted as a quarter: `part` of `parts` done.
          const int64_t work_before = j0 * heads_per_unit + hh * n;
          const auto fetch_at = [&](int64_t part, int64_t parts) {
            next.fetch_due(work_before + n * part / parts, unit_work);
          };
          for (int64_t c = 0; c < nchunks; ++c) {
            pack_key_chunk<P>(krows.data() + c * kLanes, hh * D,
                              std::min<int64_t>(kLanes, n - c * kLanes), E,
                              ktile.data() + c * E * kLanes);
            fetch_at(c + 1, 4 * nchunks);
          }
          const bool widen_v = !std::is_same_v<T, float> && !kPairs && R > kRowGroup;
          for (int64_t j = 0; widen_v && j < n; ++j) {
            const T* src = vrows[j] + hh * D;
            float* dst = vtile.data() + j * D;
            int64_t d = 0;
            for (; d + kLanes <= D; d += kLanes) load_float(src + d).store(dst + d);
            for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
          }
          for_row_groups(R, [&](auto rn, int64_t r0) {
            constexpr int RN = decltype(rn)::value;
            float* s = scores.data() + r0 * kBlockKeys;
            for_key_chunks<RN>(nchunks, [&](auto nc, int64_t c) {
              constexpr int NC = decltype(nc)::value;
#if defined(__AVX512BF16__) && defined(RADIXSERVE_ATTN_AVX512)
              if constexpr (kPairs) {
                score_key_pairs<RN, NC, kE>(qpairs.data() + (hh * R + r0) * E, E, ktile.data(),
                                            c, fscale, s);
                return;
              }
#endif
              if constexpr (!kPairs) {
                score_keys<RN, NC, kE>(qbuf.data() + (hh * R + r0) * E, E, ktile.data(), c, s);
              }
            });
          });
          fetch_at(2, 4);
          for (int64_t r = 0; r < R; ++r) {
            const int64_t cnt = std::max<int64_t>(0, std::min(n, row_keys[r] - j0));
            float* s = scores.data() + r * kBlockKeys;
            std::fill(s + cnt, s + n, 0.f);  // keys past the row's causal end weigh nothing
            if (cnt == 0) continue;
            float& m = row_max[hh * R + r];
            const float new_max = std::max(m, row_max_of(s, cnt));
            const float rescale = std::exp(m - new_max);
            const Vec vmax(new_max);
            Vec vsum(0.f);
            int64_t j = 0;
            for (; j + kLanes <= cnt; j += kLanes) {
              const Vec p = (Vec::loadu(s + j) - vmax).exp_u20();
              p.store(s + j);
              vsum = vsum + p;
            }
            if (j < cnt) {  // the last keys in one vector, the lanes past them zero
              const int64_t rest = cnt - j;
              const Vec p = Vec::set(Vec(0.f), (Vec::loadu(s + j, rest) - vmax).exp_u20(), rest);
              p.store(s + j);  // whole: j < cnt <= kBlockKeys, and j a multiple of kLanes
              vsum = vsum + p;
            }
            row_sum[hh * R + r] = row_sum[hh * R + r] * rescale + hsum(vsum);
            m = new_max;
            if (rescale != 1.f) scale_inplace(acch + r * D, rescale, D);
          }
          fetch_at(3, 4);
          for_row_groups(R, [&](auto rn, int64_t r0) {
            constexpr int RN = decltype(rn)::value;
            float* p = scores.data() + r0 * kBlockKeys;
            if constexpr (kPairs) {
#if defined(__AVX512BF16__) && defined(RADIXSERVE_ATTN_AVX512)
              uint32_t* pairs = prob_pairs.data() + r0 * (kBlockKeys / 2);
              for (int i = 0; i < RN; ++i) {
                round_probabilities(p + i * kBlockKeys, n, pairs + i * (kBlockKeys / 2));
              }
              accumulate_pairs<RN>(pairs, p, vrows.data(), hh * D, n, D, acch + r0 * D);
#endif
            } else if (widen_v) {
              accumulate_rows<RN>(p, vtile_rows.data(), 0, n, D, acch + r0 * D);
            } else {
              accumulate_rows<RN>(p, vrows.data(), hh * D, n, D, acch + r0 * D);
            }
          });
          fetch_at(4, 4);
        }
      }
      for (int64_t hh = 0; hh < heads_per_unit; ++hh) {
        const int64_t h = h_begin + hh;
        for (int64_t r = 0; r < R; ++r) {
          T* dst = op + ((tok0 + r / G) * H + h * G + r % G) * D;
          const float* src = acc.data() + (hh * R + r) * D;
          const float inv = 1.f / row_sum[hh * R + r];
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
        }
      }
      w = lookahead ? w_next : next_work.fetch_add(1);
    }
  }
  return out;
}

// Every shape and length relation the kernel relies on, in O(batch) (and the new tokens' slots,
// which it writes): a caller's mistake is an error, never a read or write out of bounds. The
// slots it reads (kv_slots) it trusts: checking them is O(batch x context) a layer, so
// CpuAttnBackend checks them once a forward (cpu_attention.py).
void check_lengths(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& out_cache_loc, const at::Tensor& kv_slots,
                   const at::Tensor& prefix_lens, const at::Tensor& extend_lens) {
  const int64_t num_tokens = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H > 0 && Hkv > 0 && D > 0, "paged_attention: ", H, " query heads, ", Hkv,
              " KV heads of size ", D, ": each must be at least 1");
  TORCH_CHECK(H % Hkv == 0, "paged_attention: ", H, " query heads are not a multiple of ", Hkv,
              " KV heads");
  TORCH_CHECK(k.size(0) == num_tokens && k.size(1) == Hkv && k.size(2) == D &&
                  k_cache.size(2) == D,
              "paged_attention: k ", k.sizes(), " and k_cache ", k_cache.sizes(),
              " disagree with q ", q.sizes());
  TORCH_CHECK(v.sizes() == k.sizes() && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: v and v_cache must have k's and k_cache's shapes");
  TORCH_CHECK(out_cache_loc.dim() == 1 && out_cache_loc.size(0) == num_tokens,
              "paged_attention: out_cache_loc must hold one slot per new token (", num_tokens,
              "), not ", out_cache_loc.sizes());
  const int64_t B = extend_lens.numel();
  TORCH_CHECK(extend_lens.dim() == 1 && prefix_lens.dim() == 1 && prefix_lens.size(0) == B &&
                  kv_slots.dim() == 2 && kv_slots.size(0) == B,
              "paged_attention: one prefix length, extend length and kv_slots row per sequence");
  const int64_t L = kv_slots.size(1), pool = k_cache.size(0);
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(prefix[b] >= 0 && extend[b] >= 0 && prefix[b] + extend[b] <= L,
                "paged_attention: sequence ", b, " has prefix ", prefix[b], " and extend ",
                extend[b], ": negative, or past its kv_slots row of ", L);
    total += extend[b];
  }
  TORCH_CHECK(total == num_tokens, "paged_attention: the extend lengths sum to ", total,
              ", not the ", num_tokens, " new tokens");
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(loc[t] >= 0 && loc[t] < pool, "paged_attention: out_cache_loc holds ", loc[t],
                ", outside the pool of ", pool, " slots");
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& out_cache_loc, const at::Tensor& kv_slots,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                           double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->dim() == 3 && t->stride(2) == 1,
                "paged_attention: q, k, v and the caches must be [n, heads, head_dim] of one "
                "dtype with contiguous rows");
  }
  for (const at::Tensor* t : {&out_cache_loc, &kv_slots, &prefix_lens, &extend_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  check_lengths(q, k, v, k_cache, v_cache, out_cache_loc, kv_slots, prefix_lens, extend_lens);
  return RADIXSERVE_DISPATCH_FLOAT(q, "paged_attention", [&] {
    const auto run = [&](auto head_size) {
      constexpr int kD = decltype(head_size)::value;
      const auto with = [&](auto pack) {
        return attend<scalar_t, kD, decltype(pack)::value>(
            q, k, v, k_cache, v_cache, out_cache_loc, kv_slots, prefix_lens, extend_lens, scale);
      };
      if constexpr (std::is_same_v<scalar_t, float>) {
        return with(std::integral_constant<KeyPack, KeyPack::Float>{});
      } else {
#if defined(__AVX512BF16__) && defined(RADIXSERVE_ATTN_AVX512)
        if (q.size(2) % 2 == 0) return with(std::integral_constant<KeyPack, KeyPack::Pairs>{});
#endif
        return with(std::integral_constant<KeyPack, KeyPack::Widened>{});
      }
    };
    switch (q.size(2)) {
      case 64: return run(std::integral_constant<int, 64>{});
      case 128: return run(std::integral_constant<int, 128>{});
      default: return run(std::integral_constant<int, 0>{});
    }
  });
}

}  // namespace radixserve
