// Every decoder layer of a Llama-style model in one call (torch.classes.radixserve.DecoderLayers;
// fused_layers.py says why): the same ops, in the same order, on the same kernels as
// models/llama.py's modules run them with fused_ops.CpuKernelOps.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <string>
#include <vector>

#include "ops.h"

namespace radixserve {
namespace {

// oneDNN's matmul on a weight reordered at load (packed_linear.py's PackedWeight), called boxed:
// its C++ signature is torch's own business, its schema is stable.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias, std::string("none"),
                                 c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// One linear layer, y = x W^T + b, and its two kernels: below `small_rows` rows (contiguous x)
// the extension's own (linear_small_m, linear_panels, int8_linear), from there on the BLAS-like
// one (F.linear, oneDNN on the packed weight, oneDNN's int8 matmul). Python picks `small_rows`
// from the constants its own path uses (fused_layers.py), so both pick the same kernel for a row
// count.
class Linear : public torch::CustomClassHolder {
 public:
  // kind "dense": `weight` float; "packed": `weight` reordered for oneDNN (no plain copy is
  // kept), in panels of `panel_block` channels by `panel_k_pad`, summed in blocks of
  // `panel_k_block`, where linear_panels reads it below `small_rows` (packed_linear.Panels; else
  // 0 and oneDNN at every row count); "int8": `weight` int8 and `aux` its per-channel scales;
  // "int8_vnni": likewise, `weight` in int8_vnni.cpp's layout, whose kernel takes every row count.
  Linear(const std::string& kind, at::Tensor weight, c10::optional<at::Tensor> aux,
         c10::optional<at::Tensor> bias, int64_t small_rows, int64_t panel_block,
         int64_t panel_k_pad, int64_t panel_k_block)
      : weight_(std::move(weight)),
        bias_(std::move(bias)),
        small_rows_(small_rows),
        panel_block_(panel_block),
        panel_k_pad_(panel_k_pad),
        panel_k_block_(panel_k_block) {
    if (kind == "dense") {
      kind_ = Kind::kDense;
    } else if (kind == "packed") {
      kind_ = Kind::kPacked;
    } else if (kind == "int8") {
      kind_ = Kind::kInt8;
    } else if (kind == "int8_vnni") {
      kind_ = Kind::kInt8Vnni;
    } else {
      TORCH_CHECK(false, "Linear: unknown kind ", kind);
    }
    const bool int8 = kind_ == Kind::kInt8 || kind_ == Kind::kInt8Vnni;
    TORCH_CHECK(aux.has_value() == int8, "Linear: kind ", kind,
                aux.has_value() ? " takes no aux" : " needs aux");
    if (aux.has_value()) aux_ = *aux;
    TORCH_CHECK(kind_ != Kind::kDense || small_rows_ <= kMaxSmallM + 1,
                "Linear: linear_small_m takes at most ", kMaxSmallM, " rows");
    if (kind_ == Kind::kPacked && small_rows_ > 0) {
      TORCH_CHECK(panel_block_ > 0, "Linear: linear_panels needs panels");
      panels_ = panel_weight(weight_);
      TORCH_CHECK(panels_.dtype == at::kBFloat16 || small_rows_ <= kMaxPanelRows + 1,
                  "Linear: linear_panels takes at most ", kMaxPanelRows, " rows in float32");
    }
  }

  at::Tensor forward(const at::Tensor& x) const {
    // int8_linear takes rows of any stride, linear_small_m contiguous x only.
    const bool small = x.size(0) < small_rows_ && (kind_ == Kind::kInt8 || x.is_contiguous());
    switch (kind_) {
      case Kind::kDense:
        return small ? linear_small_m(x, weight_, bias_) : at::linear(x, weight_, bias_);
      case Kind::kPacked:
        return small ? linear_panels_on(x, panels_, panel_k_pad_, panel_block_, panel_k_block_,
                                        bias_)
                     : onednn_linear(x, weight_, bias_);
      case Kind::kInt8: {
        return small ? int8_linear(x, weight_, aux_, bias_) : int8_gemm(x, weight_, aux_, bias_);
      }
      case Kind::kInt8Vnni:
        return int8_vnni_linear(x, weight_, aux_, bias_);
    }
    TORCH_CHECK(false, "Linear: unknown kind");
  }

  // silu(gate) * up of a [gate | up] layer's outputs: in one pass on the VNNI layout, as
  // CpuKernelOps.linear_silu_and_mul takes it.
  at::Tensor forward_silu_and_mul(const at::Tensor& x) const {
    if (kind_ == Kind::kInt8Vnni) return int8_vnni_linear_silu_and_mul(x, weight_, aux_, bias_);
    return silu_and_mul(forward(x));
  }

 private:
  enum class Kind { kDense, kPacked, kInt8, kInt8Vnni };
  Kind kind_ = Kind::kDense;
  at::Tensor weight_, aux_;
  c10::optional<at::Tensor> bias_;
  int64_t small_rows_, panel_block_, panel_k_pad_, panel_k_block_;
  PanelWeight panels_{};  // weight_'s buffer, where linear_panels reads it
};

class DecoderLayers : public torch::CustomClassHolder {
 public:
  DecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                double scale)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale) {}

  // o_bias and down_bias are added after the matmul, as RowParallelLinear adds them after its
  // all-reduce: the same rounding as the modules.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, c10::intrusive_ptr<Linear> qkv,
                 c10::intrusive_ptr<Linear> o_proj, c10::optional<at::Tensor> o_bias,
                 c10::intrusive_ptr<Linear> gate_up, c10::intrusive_ptr<Linear> down,
                 c10::optional<at::Tensor> down_bias) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm),
                       std::move(k_norm), std::move(qkv), std::move(o_proj), std::move(o_bias),
                       std::move(gate_up), std::move(down), std::move(down_bias)});
  }

  // hidden: the embedding (written over); residual: zeros, the running sum (updated in place).
  // Returns the last layer's output, not yet added to the residual, as LlamaModel's loop does.
  at::Tensor forward(at::Tensor hidden, at::Tensor residual, const at::Tensor& cos,
                     const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, const at::Tensor& out_cache_loc,
                     const at::Tensor& kv_slots, const at::Tensor& prefix_lens,
                     const at::Tensor& extend_lens) const {
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                    static_cast<int64_t>(v_caches.size()) == num_layers,
                "DecoderLayers: one K and one V cache per layer");
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    for (int64_t i = 0; i < num_layers; ++i) {
      const Layer& layer = layers_[i];
      fused_add_rms_norm(hidden, residual, layer.input_norm, eps_);
      const auto qkv = layer.qkv->forward(hidden).split_with_sizes({q_size, kv_size, kv_size}, -1);
      at::Tensor q = qkv[0].view({-1, num_heads_, head_dim_});
      at::Tensor k = qkv[1].view({-1, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv[2].view({-1, num_kv_heads_, head_dim_});
      if (layer.q_norm.has_value()) {
        q = rms_norm(q, *layer.q_norm, eps_);
        k = rms_norm(k, *layer.k_norm, eps_);
      }
      rotary_embedding(q, k, cos, sin);
      at::Tensor attn = paged_attention(q, k, v, k_caches[i], v_caches[i], out_cache_loc,
                                        kv_slots, prefix_lens, extend_lens, scale_);
      at::Tensor o = add_bias(layer.o_proj->forward(attn.reshape({-1, q_size})), layer.o_bias);
      fused_add_rms_norm(o, residual, layer.post_norm, eps_);
      hidden = add_bias(layer.down->forward(layer.gate_up->forward_silu_and_mul(o)),
                        layer.down_bias);
    }
    return hidden;
  }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    c10::optional<at::Tensor> q_norm, k_norm;
    c10::intrusive_ptr<Linear> qkv, o_proj;
    c10::optional<at::Tensor> o_bias;
    c10::intrusive_ptr<Linear> gate_up, down;
    c10::optional<at::Tensor> down_bias;
  };

  static at::Tensor add_bias(const at::Tensor& y, const c10::optional<at::Tensor>& bias) {
    return bias.has_value() ? y + *bias : y;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.class_<Linear>("Linear")
      .def(torch::init<const std::string&, at::Tensor, c10::optional<at::Tensor>,
                       c10::optional<at::Tensor>, int64_t, int64_t, int64_t, int64_t>());
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("forward", &DecoderLayers::forward);
}

}  // namespace radixserve
