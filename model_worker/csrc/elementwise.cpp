// The small ops between the matmuls, each one pass over its rows instead of several eager ops:
// RMSNorm (with the residual add fused in), neox RoPE on q and k in place, SiLU-and-multiply.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(-1) == 1,
              name, ": float32 tensors with contiguous rows only");
}

// out = x / sqrt(mean(x^2) + eps) * w, over one row of n
void norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec xv = Vec::loadu(x + i);
    acc = at::vec::fmadd(xv, xv, acc);
  }
  float sumsq = hsum(acc);
  for (; i < n; ++i) sumsq += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(n) + eps);
  const Vec vinv(inv);
  for (i = 0; i + kLanes <= n; i += kLanes) {
    (Vec::loadu(x + i) * vinv * Vec::loadu(w + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// x [rows, heads, D] (a 2-D x is one head per row) as a flat list of rows of D
struct Rows {
  int64_t count, heads, stride0, stride1;
  int64_t offset(int64_t r) const { return (r / heads) * stride0 + (r % heads) * stride1; }
};

Rows rows_of(const at::Tensor& x) {
  if (x.dim() == 2) return {x.size(0), 1, x.stride(0), 0};
  TORCH_CHECK(x.dim() == 3, "expected a 2-D or 3-D tensor");
  return {x.size(0) * x.size(1), x.size(1), x.stride(0), x.stride(1)};
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "rms_norm: weight shape");
  const Rows rows = rows_of(x);
  const int64_t D = x.size(-1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows.count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(op + r * D, xp + rows.offset(r), wp, D, static_cast<float>(eps));
    }
  });
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.dim() == 2,
              "fused_add_rms_norm: x and residual must be contiguous [tokens, hidden]");
  check_float_rows(x, "fused_add_rms_norm");
  check_float_rows(residual, "fused_add_rms_norm");
  const int64_t N = x.size(0), D = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * D;
      float* rr = rp + r * D;
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) (Vec::loadu(rr + i) + Vec::loadu(xr + i)).store(rr + i);
      for (; i < D; ++i) rr[i] += xr[i];
      norm_row(xr, rr, wp, D, static_cast<float>(eps));
    }
  });
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_rows(q, "rotary_embedding");
  check_float_rows(k, "rotary_embedding");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotary_embedding: q and k are [tokens, heads, dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  cos.size(0) == q.size(0) && cos.size(1) * 2 == q.size(2),
              "rotary_embedding: cos and sin are float32 [tokens, head_dim / 2]");
  const int64_t T = q.size(0), half = cos.size(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](at::Tensor& x, int64_t t) {
    float* base = x.data_ptr<float>() + t * x.stride(0);
    const float* c = cp + t * half;
    const float* s = sp + t * half;
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* x1 = base + h * x.stride(1);
      float* x2 = x1 + half;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const Vec a = Vec::loadu(x1 + i), b = Vec::loadu(x2 + i);
        const Vec cv = Vec::loadu(c + i), sv = Vec::loadu(s + i);
        (a * cv - b * sv).store(x1 + i);
        (b * cv + a * sv).store(x2 + i);
      }
      for (; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  };
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, t);
      rotate(k, t);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) % 2 == 0,
              "silu_and_mul: x is contiguous float32 [tokens, 2 * intermediate]");
  const int64_t N = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({N, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * I;
      const float* up = gate + I;
      float* o = op + r * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec g = Vec::loadu(gate + i);
        (g / (one + g.neg().exp()) * Vec::loadu(up + i)).store(o + i);
      }
      for (; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace radixserve
