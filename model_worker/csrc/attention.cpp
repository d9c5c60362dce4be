// Attention that reads the paged KV pool in place: no gathered copy of any context, no padding
// to the longest sequence. One call serves a mixed batch (decodes, prefill chunks, prefix hits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

constexpr int64_t kBlockKeys = 64;   // keys scored per step of the online softmax
constexpr int64_t kQueryRows = 64;   // query rows (tokens x heads of one KV head) per work item

struct Item {
  int64_t seq, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence's new tokens
  int64_t work;                 // ~ rows x keys, to hand out the largest items first
};

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& out_cache_loc) {
  const int64_t T = k.size(0), heads = k.size(1), D = k.size(2);
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (loc[t] * heads + h) * D;
        std::memcpy(kc + dst, kp + t * k.stride(0) + h * k.stride(1), D * sizeof(float));
        std::memcpy(vc + dst, vp + t * v.stride(0) + h * v.stride(1), D * sizeof(float));
      }
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& out_cache_loc, const at::Tensor& kv_slots,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                           double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1,
                "paged_attention: q, k, v and the caches must be float32 [n, heads, head_dim] "
                "with contiguous rows");
  }
  for (const at::Tensor* t : {&out_cache_loc, &kv_slots, &prefix_lens, &extend_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), B = extend_lens.size(0), L = kv_slots.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(2) == D && k.size(1) == Hkv && k.size(0) == T,
              "paged_attention: head shapes disagree");
  write_kv(k, v, k_cache, v_cache, out_cache_loc);

  const int64_t G = H / Hkv;  // query heads per KV head
  const int64_t q_block = std::max<int64_t>(1, kQueryRows / G);
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  std::vector<int64_t> first_token(B);
  std::vector<Item> items;
  for (int64_t b = 0, start = 0; b < B; start += extend[b], ++b) {
    first_token[b] = start;
    TORCH_CHECK(prefix[b] + extend[b] <= L, "paged_attention: kv_slots row too short");
    for (int64_t q0 = 0; q0 < extend[b]; q0 += q_block) {
      const int64_t q1 = std::min(extend[b], q0 + q_block);
      items.push_back({b, q0, q1, (q1 - q0) * (prefix[b] + q1)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.work > b.work; });

  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* slots_all = kv_slots.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t num_work = static_cast<int64_t>(items.size()) * Hkv;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Dynamic scheduling: a causal prefill's later blocks cost more than its first ones.
#pragma omp parallel if (num_work > 1 && !omp_in_parallel())
  {
    const int64_t rows_max = q_block * G;
    std::vector<float> qbuf(rows_max * D), acc(rows_max * D), scores(rows_max * kBlockKeys);
    std::vector<float> row_max(rows_max), row_sum(rows_max);
    std::vector<int64_t> row_keys(rows_max);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_work; ++w) {
      const Item& it = items[w / Hkv];
      const int64_t h = w % Hkv;
      const int64_t R = (it.q_end - it.q_begin) * G;  // row r: token q_begin + r / G, head h*G + r % G
      const int64_t tok0 = first_token[it.seq] + it.q_begin;
      const int64_t* slots = slots_all + it.seq * L;
      for (int64_t r = 0; r < R; ++r) {
        const float* src = qp + (tok0 + r / G) * q.stride(0) + (h * G + r % G) * q.stride(1);
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * static_cast<float>(scale);
        // Causal: the row's token at position prefix + i sees keys 0..prefix + i.
        row_keys[r] = prefix[it.seq] + it.q_begin + r / G + 1;
        row_max[r] = neg_inf;
        row_sum[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + R * D, 0.f);
      const int64_t kv_end = prefix[it.seq] + it.q_end;
      for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockKeys) {
        const int64_t n = std::min(kBlockKeys, kv_end - j0);
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = kc + (slots[j0 + j] * Hkv + h) * D;
          for (int64_t r = 0; r < R; ++r) scores[r * kBlockKeys + j] = dot(qbuf.data() + r * D, kr, D);
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t cnt = std::min(n, row_keys[r] - j0);
          if (cnt <= 0) continue;
          float* s = scores.data() + r * kBlockKeys;
          const float new_max = std::max(row_max[r], *std::max_element(s, s + cnt));
          const float rescale = std::exp(row_max[r] - new_max);
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
          row_sum[r] = row_sum[r] * rescale + sum;
          row_max[r] = new_max;
          if (rescale != 1.f) scale_inplace(acc.data() + r * D, rescale, D);
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* vr = vc + (slots[j0 + j] * Hkv + h) * D;
          for (int64_t r = 0; r < R; ++r) {
            if (j0 + j < row_keys[r]) axpy(acc.data() + r * D, scores[r * kBlockKeys + j], vr, D);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* dst = op + ((tok0 + r / G) * H + h * G + r % G) * D;
        const float inv = 1.f / row_sum[r];
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
      }
    }
  }
  return out;
}

}  // namespace radixserve
