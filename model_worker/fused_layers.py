"""Every decoder layer in one call of the CPU extension (`csrc/decoder.cpp`).

A decode step of one sequence runs ~15 ops a layer, and the Python and dispatch between them took
about a third of the step (benchmarks/RESULTS.md). `DecoderLayers` runs the same ops in the same
order on the same kernels as the modules do with `CpuKernelOps` (the tests hold the two equal to
the bit), with nothing in between. It serves `--kernels cpu_extension` on one rank: with TP the
all-reduces between a layer's matmuls stay with the modules. `--disable-fused-layers` keeps the
modules everywhere.
"""

from __future__ import annotations

import torch

from radixserve.model_worker.cpu_kernels import require_cpu_kernels
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.fused_ops import small_kernel_rows
from radixserve.model_worker.int8_weight import Int8Weight
from radixserve.model_worker.packed_linear import PackedWeight, Panels
from radixserve.model_worker.weight_format import PreparedWeight


def linear_kernel(
    weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None
) -> torch.ScriptObject:
    """A linear layer as the extension's `Linear`: its weights, and the row count below which it
    runs the extension's own kernel, as CpuKernelOps.linear chooses."""
    require_cpu_kernels("a fused linear layer")
    linear = torch.classes.radixserve.Linear
    small_rows = small_kernel_rows(weight)
    if isinstance(weight, Int8Weight):
        # The int8 kernels rescale in float32: a bfloat16 bias converted here once, not per call.
        bias = None if bias is None else bias.float()
        if weight.vnni:  # one kernel for every row count
            return linear("int8_vnni", weight.q, weight.scale, bias, 0, 0, 0, 0)
        return linear("int8", weight.q, weight.scale, bias, small_rows, 0, 0, 0)
    if isinstance(weight, PackedWeight):
        p = weight.panels or Panels(0, 0)
        return linear("packed", weight.packed, None, bias, small_rows, p.block, p.k_pad, p.k_block)
    return linear("dense", weight, None, bias, small_rows, 0, 0, 0)


class FusedDecoderLayers:
    """One model's layers, added in order by the model."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float):
        require_cpu_kernels("fused decoder layers")
        self._layers = torch.classes.radixserve.DecoderLayers(
            num_heads, num_kv_heads, head_dim, eps, scale
        )

    def add_layer(
        self,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        qk_norms: tuple[torch.Tensor, torch.Tensor] | None,
        qkv: torch.ScriptObject,
        o_proj: torch.ScriptObject,
        o_bias: torch.Tensor | None,
        gate_up: torch.ScriptObject,
        down: torch.ScriptObject,
        down_bias: torch.Tensor | None,
    ) -> None:
        """The linears as `linear_kernel` makes them. o_proj's and down's biases come apart:
        they are added after the matmul, as RowParallelLinear adds them after its all-reduce."""
        q_norm, k_norm = (None, None) if qk_norms is None else qk_norms
        self._layers.add_layer(
            input_norm, post_norm, q_norm, k_norm, qkv, o_proj, o_bias, gate_up, down, down_bias
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """As LlamaModel's loop over its layers: `hidden` the embedding, `residual` zeros (the
        running sum, updated in place); returns the last layer's output, not yet added."""
        kv_slots = fb.attn_metadata  # CpuAttnBackend.init_forward_metadata checked them
        assert isinstance(kv_slots, torch.Tensor), "init_forward_metadata was not called"
        pool = fb.kv_pool
        return self._layers.forward(
            hidden,
            residual,
            cos,
            sin,
            pool.k_buffers,
            pool.v_buffers,
            fb.out_cache_loc,
            kv_slots,
            fb.prefix_lens,
            fb.extend_lens,
        )
