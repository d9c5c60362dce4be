// The small ops between the matmuls, each one pass over its rows instead of several eager ops:
// RMSNorm (with the residual add fused in), neox RoPE on q and k in place, SiLU-and-multiply.
// float32 or bfloat16 tensors; the arithmetic in float32, each result rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec_utils.h"

namespace radixserve {
namespace {

void check_rows(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.stride(-1) == 1 && x.scalar_type() == like.scalar_type(), name,
              ": tensors of one dtype with contiguous rows only");
}

// out = x / sqrt(mean(x^2) + eps) * w, over one row of n
template <typename T>
void norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec xv = load_float(x + i);
    acc = at::vec::fmadd(xv, xv, acc);
  }
  float sumsq = hsum(acc);
  for (; i < n; ++i) sumsq += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(n) + eps);
  const Vec vinv(inv);
  for (i = 0; i + kLanes <= n; i += kLanes) {
    store_float(load_float(x + i) * vinv * load_float(w + i), out + i);
  }
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]) * inv * static_cast<float>(w[i]);
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

template <typename T>
void rotate_row(T* x1, T* x2, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const Vec a = load_float(x1 + i), b = load_float(x2 + i);
    const Vec cv = load_float(c + i), sv = load_float(s + i);
    store_float(a * cv - b * sv, x1 + i);
    store_float(b * cv + a * sv, x2 + i);
  }
  for (; i < half; ++i) {
    const float a = x1[i], b = x2[i], ci = c[i], si = s[i];
    x1[i] = a * ci - b * si;
    x2[i] = b * ci + a * si;
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.numel() == x.size(-1),
              "rms_norm: weight must be contiguous [", x.size(-1), "]");
  const Rows rows = rows_of(x);
  const int64_t D = x.size(-1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  RADIXSERVE_DISPATCH_FLOAT(x, "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(op + r * D, xp + rows.offset(r), wp, D, static_cast<float>(eps));
      }
    });
  });
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.dim() == 2,
              "fused_add_rms_norm: x and residual must be contiguous [tokens, hidden]");
  check_rows(x, weight, "fused_add_rms_norm");
  check_rows(residual, weight, "fused_add_rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1),
              "fused_add_rms_norm: weight must be contiguous [hidden]");
  const int64_t N = x.size(0), D = x.size(1);
  RADIXSERVE_DISPATCH_FLOAT(x, "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * D;
        scalar_t* rr = rp + r * D;
        int64_t i = 0;
        for (; i + kLanes <= D; i += kLanes) {
          store_float(load_float(rr + i) + load_float(xr + i), rr + i);
        }
        for (; i < D; ++i) rr[i] = static_cast<float>(rr[i]) + static_cast<float>(xr[i]);
        norm_row(xr, rr, wp, D, static_cast<float>(eps));
      }
    });
  });
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(q, cos, "rotary_embedding");
  check_rows(k, cos, "rotary_embedding");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "rotary_embedding: q and k are [tokens, heads, dim] of the same tokens and dim");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  sin.scalar_type() == cos.scalar_type() && sin.sizes() == cos.sizes() &&
                  cos.size(0) == q.size(0) && cos.size(1) * 2 == q.size(2),
              "rotary_embedding: cos and sin are [tokens, head_dim / 2] in q's dtype");
  const int64_t T = q.size(0), half = cos.size(1);
  RADIXSERVE_DISPATCH_FLOAT(q, "rotary_embedding", [&] {
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    auto rotate = [&](at::Tensor& x, int64_t t) {
      scalar_t* base = x.data_ptr<scalar_t>() + t * x.stride(0);
      for (int64_t h = 0; h < x.size(1); ++h) {
        scalar_t* x1 = base + h * x.stride(1);
        rotate_row(x1, x1 + half, cp + t * half, sp + t * half, half);
      }
    };
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(q, t);
        rotate(k, t);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x is contiguous [tokens, 2 * intermediate]");
  const int64_t N = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({N, I}, x.options());
  RADIXSERVE_DISPATCH_FLOAT(x, "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * I;
        const scalar_t* up = gate + I;
        scalar_t* o = op + r * I;
        int64_t i = 0;
        for (; i + kLanes <= I; i += kLanes) {
          store_float(silu_mul(load_float(gate + i), load_float(up + i)), o + i);
        }
        for (; i < I; ++i) {
          const float g = gate[i];
          o[i] = g / (1.f + std::exp(-g)) * static_cast<float>(up[i]);
        }
      }
    });
  });
  return out;
}

}  // namespace radixserve
