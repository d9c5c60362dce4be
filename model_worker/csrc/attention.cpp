// Attention that reads the paged KV pool in place: no gathered copy of any context, no padding
// to the longest sequence. One call serves a mixed batch (decodes, prefill chunks, prefix hits).
// float32 or bfloat16 q, k, v and pool (a bfloat16 pool halves the bytes a decode step reads);
// scores, softmax and sums in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

constexpr int64_t kBlockKeys = 64;    // keys scored per step of the online softmax
constexpr int64_t kQueryRows = 64;    // query rows (tokens x heads of one KV head) per work item
constexpr int64_t kPrefetchKeys = 8;  // keys ahead whose K and V rows are prefetched
constexpr int kRowGroup = 4;          // query rows that share each load of a K or V row

// A head's K or V row sits at a slot of the pool that no pattern predicts (a decode step's
// tokens are interleaved with other sequences'): fetch it ahead, or every key waits for memory.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(T)) __builtin_prefetch(row + d);
}

// scores[i][j] = q_i . k_j for RN query rows and the block's n keys: each K row loaded once.
// With the head size known at compile time (kD), the query rows stay in registers across keys.
template <int RN, int kD, typename T>
void score_rows(const float* q, const T* const* slot_rows, int64_t head_offset, int64_t n,
                int64_t D, float* scores) {
  if constexpr (kD > 0 && kD % kLanes == 0) {
    constexpr int64_t kVecs = kD / kLanes;
    Vec qv[RN][kVecs];
    for (int i = 0; i < RN; ++i) {
      for (int64_t c = 0; c < kVecs; ++c) qv[i][c] = Vec::loadu(q + i * kD + c * kLanes);
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = slot_rows[j] + head_offset;
      Vec a[RN];
      for (int i = 0; i < RN; ++i) a[i] = Vec(0.f);
      for (int64_t c = 0; c < kVecs; ++c) {
        const Vec kv = load_float(kr + c * kLanes);
        for (int i = 0; i < RN; ++i) a[i] = at::vec::fmadd(qv[i][c], kv, a[i]);
      }
      for (int i = 0; i < RN; ++i) scores[i * kBlockKeys + j] = hsum(a[i]);
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = slot_rows[j] + head_offset;
    Vec a[RN];
    for (int i = 0; i < RN; ++i) a[i] = Vec(0.f);
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const Vec kv = load_float(kr + d);
      for (int i = 0; i < RN; ++i) a[i] = at::vec::fmadd(Vec::loadu(q + i * D + d), kv, a[i]);
    }
    for (int i = 0; i < RN; ++i) {
      float sum = hsum(a[i]);
      for (int64_t dd = d; dd < D; ++dd) sum += q[i * D + dd] * static_cast<float>(kr[dd]);
      scores[i * kBlockKeys + j] = sum;
    }
  }
}

// acc[i] += sum_j p[i][j] v_j for RN query rows: each V row loaded once, acc held in registers.
template <int RN, typename T>
void accumulate_rows(const float* p, const T* const* slot_rows, int64_t head_offset, int64_t n,
                     int64_t D, float* acc) {
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    Vec a[RN];
    for (int i = 0; i < RN; ++i) a[i] = Vec::loadu(acc + i * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const Vec vv = load_float(slot_rows[j] + head_offset + d);
      for (int i = 0; i < RN; ++i) a[i] = at::vec::fmadd(Vec(p[i * kBlockKeys + j]), vv, a[i]);
    }
    for (int i = 0; i < RN; ++i) a[i].store(acc + i * D + d);
  }
  for (; d < D; ++d) {
    for (int64_t j = 0; j < n; ++j) {
      for (int i = 0; i < RN; ++i) {
        acc[i * D + d] += p[i * kBlockKeys + j] * static_cast<float>(slot_rows[j][head_offset + d]);
      }
    }
  }
}

// Runs f<RN>(first row) over rows [0, R) in groups of up to kRowGroup.
template <typename F>
void for_row_groups(int64_t R, F&& f) {
  for (int64_t r0 = 0; r0 < R; r0 += kRowGroup) {
    switch (std::min<int64_t>(kRowGroup, R - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      default: f(std::integral_constant<int, 4>{}, r0); break;
    }
  }
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

// kD: the head size where it is a common one (compiled for it), else 0.
template <typename T, int kD>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_cache_loc,
                  const at::Tensor& kv_slots, const at::Tensor& prefix_lens,
                  const at::Tensor& extend_lens, double scale) {
  const int64_t num_tokens = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), B = extend_lens.size(0), L = kv_slots.size(1);
  write_kv<T>(k, v, k_cache, v_cache, out_cache_loc);

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
  // A work unit takes every KV head of its item, reading each slot's K and V rows whole (one
  // contiguous run of memory per slot), unless there are too few items to keep every thread busy.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t heads_per_unit = num_items >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t units_per_item = Hkv / heads_per_unit;
  const int64_t num_work = num_items * units_per_item;

  // Dynamic scheduling: a causal prefill's later blocks cost more than its first ones.
#pragma omp parallel if (num_work > 1 && !omp_in_parallel())
  {
    // Row r of head h (h counted from the unit's first head) is at [h * R + r].
    const int64_t rows_max = q_block * G * heads_per_unit;
    std::vector<float> qbuf(rows_max * D), acc(rows_max * D), scores(q_block * G * kBlockKeys);
    std::vector<float> row_max(rows_max), row_sum(rows_max);
    std::vector<int64_t> row_keys(q_block * G);
    std::vector<const T*> krows(kBlockKeys), vrows(kBlockKeys);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_work; ++w) {
      const Item& it = items[w / units_per_item];
      const int64_t h_begin = (w % units_per_item) * heads_per_unit;
      const int64_t R = (it.q_end - it.q_begin) * G;  // row r: token q_begin + r / G, head r % G
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
          float* dst = qbuf.data() + (hh * R + r) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * static_cast<float>(scale);
          row_max[hh * R + r] = neg_inf;
          row_sum[hh * R + r] = 0.f;
        }
      }
      std::fill(acc.begin(), acc.begin() + heads_per_unit * R * D, 0.f);
      const int64_t row_floats = heads_per_unit * D;  // what this unit reads of a slot's row
      const int64_t kv_end = prefix[it.seq] + it.q_end;
      for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockKeys) {
        const int64_t n = std::min(kBlockKeys, kv_end - j0);
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
          const float* qh = qbuf.data() + hh * R * D;
          float* acch = acc.data() + hh * R * D;
          for_row_groups(R, [&](auto rn, int64_t r0) {
            score_rows<rn, kD>(qh + r0 * D, krows.data(), hh * D, n, D,
                               scores.data() + r0 * kBlockKeys);
          });
          for (int64_t r = 0; r < R; ++r) {
            const int64_t cnt = std::max<int64_t>(0, std::min(n, row_keys[r] - j0));
            float* s = scores.data() + r * kBlockKeys;
            std::fill(s + cnt, s + n, 0.f);  // keys past the row's causal end weigh nothing
            if (cnt == 0) continue;
            float& m = row_max[hh * R + r];
            const float new_max = std::max(m, *std::max_element(s, s + cnt));
            const float rescale = std::exp(m - new_max);
            const Vec vmax(new_max);
            Vec vsum(0.f);
            int64_t j = 0;
            for (; j + kLanes <= cnt; j += kLanes) {
              const Vec p = (Vec::loadu(s + j) - vmax).exp();
              p.store(s + j);
              vsum = vsum + p;
            }
            float sum = hsum(vsum);
            for (; j < cnt; ++j) {
              s[j] = std::exp(s[j] - new_max);
              sum += s[j];
            }
            row_sum[hh * R + r] = row_sum[hh * R + r] * rescale + sum;
            m = new_max;
            if (rescale != 1.f) scale_inplace(acch + r * D, rescale, D);
          }
          for_row_groups(R, [&](auto rn, int64_t r0) {
            accumulate_rows<rn>(scores.data() + r0 * kBlockKeys, vrows.data(), hh * D, n, D,
                                acch + r0 * D);
          });
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
    }
  }
  return out;
}

// Every shape and length relation the kernel relies on, in O(batch) (and the new tokens' slots,
// which it writes): a caller's mistake is an error, never a read or write out of bounds.
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
      return attend<scalar_t, decltype(head_size)::value>(
          q, k, v, k_cache, v_cache, out_cache_loc, kv_slots, prefix_lens, extend_lens, scale);
    };
    switch (q.size(2)) {
      case 64: return run(std::integral_constant<int, 64>{});
      case 128: return run(std::integral_constant<int, 128>{});
      default: return run(std::integral_constant<int, 0>{});
    }
  });
}

}  // namespace radixserve
