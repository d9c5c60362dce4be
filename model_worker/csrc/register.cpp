// Schemas and CPU implementations of torch.ops.radixserve.*; (a!) marks what an op writes.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor out_cache_loc, Tensor kv_slots, Tensor prefix_lens, Tensor extend_lens, "
      "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "linear_panels(Tensor x, Tensor packed, int n, int k_pad, int block, int k_block, "
      "Tensor? bias) -> Tensor");
  m.def("panels_hold(Tensor packed, Tensor weight, int block, int k_pad) -> bool");
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("dequantize_rows(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("int8_vnni_pack(Tensor(a!) packed, int start, Tensor rows) -> ()");
  m.def("int8_vnni_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def(
      "int8_vnni_linear_silu_and_mul(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias) -> "
      "Tensor");
  // No tensor to dispatch on: one kernel for every key.
  m.def("int8_vnni_available() -> bool", &radixserve::int8_vnni_available);
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("paged_attention", &radixserve::paged_attention);
  m.impl("rms_norm", &radixserve::rms_norm);
  m.impl("fused_add_rms_norm", &radixserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &radixserve::rotary_embedding);
  m.impl("silu_and_mul", &radixserve::silu_and_mul);
  m.impl("linear_small_m", &radixserve::linear_small_m);
  m.impl("quantize_rows_int8", &radixserve::quantize_rows_int8);
  m.impl("int8_linear", &radixserve::int8_linear);
  m.impl("int8_gemm", &radixserve::int8_gemm);
  m.impl("dequantize_rows", &radixserve::dequantize_rows);
  m.impl("int8_vnni_pack", &radixserve::int8_vnni_pack);
  m.impl("int8_vnni_linear", &radixserve::int8_vnni_linear);
  m.impl("int8_vnni_linear_silu_and_mul", &radixserve::int8_vnni_linear_silu_and_mul);
  m.impl("argmax_rows", &radixserve::argmax_rows);
}

// linear_panels reads a oneDNN tensor, which sends the call to this key.
TORCH_LIBRARY_IMPL(radixserve, MkldnnCPU, m) {
  m.impl("linear_panels", &radixserve::linear_panels);
  m.impl("panels_hold", &radixserve::panels_hold);
}
