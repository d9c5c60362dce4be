// The operators of the radixserve CPU extension, registered as torch.ops.radixserve.*.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace radixserve {

constexpr int64_t kMaxSmallM = 8;  // rows linear_small_m takes; int8_linear's row blocks
constexpr int64_t kMaxPanelRows = 4;  // rows linear_panels takes in float32 (bfloat16: any)

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& out_cache_loc, const at::Tensor& kv_slots,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                           double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias);
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_pad,
                         int64_t block, int64_t k_block, const c10::optional<at::Tensor>& bias);
// A oneDNN tensor's buffer, looked up once: torch answers where it starts only through its
// dispatcher (two boxed calls), which linear_panels asks on every call and the fused layers'
// Linear once at load. Valid while the tensor lives.
struct PanelWeight {
  const void* data;
  int64_t nbytes;
  at::ScalarType dtype;
  int64_t n, k;
};
PanelWeight panel_weight(const at::Tensor& packed);
// Whether `packed` holds `weight` as linear_panels reads it: panels of `block` channels of
// [k_pad / group][block][group] (group: 1 for float32, 2 for bfloat16), zeros past K.
bool panels_hold(const at::Tensor& packed, const at::Tensor& weight, int64_t block, int64_t k_pad);
at::Tensor linear_panels_on(const at::Tensor& x, const PanelWeight& weight, int64_t k_pad,
                            int64_t block, int64_t k_block, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                     const c10::optional<at::Tensor>& bias);
at::Tensor dequantize_rows(const at::Tensor& acc, const at::Tensor& x_scale,
                           const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias);
void int8_vnni_pack(at::Tensor& packed, int64_t start, const at::Tensor& rows);
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias);
// silu(gate) * up of int8_vnni_linear's [gate | up] outputs, in one pass where gate's and up's
// blocks pair (the intermediate size a multiple of 64): [M, N / 2].
at::Tensor int8_vnni_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                         const at::Tensor& w_scale,
                                         const c10::optional<at::Tensor>& bias);
bool int8_vnni_available();
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace radixserve
