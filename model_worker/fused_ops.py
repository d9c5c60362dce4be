"""The small ops between the matmuls, and the matmuls themselves, in two implementations.

`TorchOps` is eager torch, runs on every device and dtype, and is the reference. `CpuKernelOps`
calls the CPU extension (`cpu_kernels.py`): one pass per op instead of several eager ops (a decode
step of one sequence runs ~600 fewer ops), a linear layer for a few rows that reads the weights at
memory speed (in bfloat16 also for the rows of a decode step of many), and oneDNN on weights
reordered once (`packed_linear.py`). The model runner picks one for the whole model, and the linear
layers keep their weights in the format its ops ask for (`weight_format.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model_worker.int8_weight import Int8Weight, int8_small_rows
from radixserve.model_worker.packed_linear import PackedWeight, onednn_packing_available
from radixserve.model_worker.weight_format import PreparedWeight, WeightFormat

# Rows up to which linear_small_m beats BLAS here (the extension's kMaxSmallM).
SMALL_M = 8
# Rows up to which linear_panels beats oneDNN on the same float32 weight (benchmarks/RESULTS.md,
# "An 8B model in 24 GiB: memory"); at most the extension's kMaxPanelRows.
PANEL_ROWS = 4
# In bfloat16 on AVX512-BF16 without AMX, linear_panels' kernel for more rows (tiles of 6 rows
# against a panel, the sums in oneDNN's order) took 0.74-0.88x oneDNN's time at 16 rows,
# 0.87-0.95x at 64 and 0.93-0.99x at 128 and 256, but 1.02x at 512 and 1.07x at 2,048 (two
# threads, the weights from memory, SmolLM2-135M's and a 0.5B Qwen2's shapes:
# benchmarks/bench_panels.py): up to here. With AMX oneDNN multiplies in tiles.
BF16_PANEL_ROWS = 256
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The variance is taken in float32 whatever the model dtype, as the reference models do.
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return normed.mul_(weight)  # a fresh tensor in every dtype: no second temporary

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x, in place; returns rms_norm(residual)."""
        residual += x
        return self.rms_norm(residual, weight, eps)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox RoPE: q [T, heads, D] and k [T, kv_heads, D] rotated by cos, sin [T, D / 2]."""
        return _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [T, 2 * I] = [gate | up] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return weight.matmul(x, bias)

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """silu_and_mul of a [gate | up] linear layer's outputs."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, int64 [N]: the greedy tokens of logits [N, V]."""
        return logits.argmax(dim=-1)

    def weight_format(self) -> WeightFormat:
        """How the float linear weights are best kept for these ops, once loaded."""
        return WeightFormat.PLAIN


class CpuKernelOps(TorchOps):
    """float32 or bfloat16 on the CPU only; kernel_selection checks that before choosing it."""

    name = "cpu_kernels"

    def __init__(self) -> None:
        ops = torch.ops.radixserve
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.fused_add_rms_norm.default
        self._rotary = ops.rotary_embedding.default
        self._silu_and_mul = ops.silu_and_mul.default
        self._linear_small_m = ops.linear_small_m.default
        self._linear_panels = ops.linear_panels.default
        self._argmax_rows = ops.argmax_rows.default
        self._int8_vnni_linear_silu_and_mul = ops.int8_vnni_linear_silu_and_mul.default

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        self._add_rms_norm(x, residual, weight, eps)  # x becomes the normed sum
        return x

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rotary(q, k, cos, sin)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        small = x.shape[0] < small_kernel_rows(weight) and x.is_contiguous()
        if isinstance(weight, PackedWeight):
            if small:
                assert weight.panels is not None
                n, _ = weight.shape
                p = weight.panels
                return self._linear_panels(x, weight.packed, n, p.k_pad, p.block, p.k_block, bias)
            return weight.matmul(x, bias)
        if not isinstance(weight, torch.Tensor):
            return weight.matmul(x, bias)
        return self._linear_small_m(x, weight, bias) if small else F.linear(x, weight, bias)

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # On the VNNI layout in one op: gate's and up's outputs stay float32, not rounded to x's
        # dtype (a 2,048-token chunk's gate_up wrote 40 MB a layer in bfloat16, read back).
        if isinstance(weight, Int8Weight) and weight.vnni:
            return self._int8_vnni_linear_silu_and_mul(x, weight.q, weight.scale, bias)
        return super().linear_silu_and_mul(x, weight, bias)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # torch.argmax goes element by element; this takes a block's max with SIMD and scans
        # only the winning block (the same index, ties and NaN included).
        if logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype in _KERNEL_DTYPES:
            return self._argmax_rows(logits)
        return logits.argmax(dim=-1)

    def weight_format(self) -> WeightFormat:
        return WeightFormat.ONEDNN if onednn_packing_available() else WeightFormat.PLAIN


def small_kernel_rows(weight: torch.Tensor | PreparedWeight) -> int:
    """Rows below which CpuKernelOps.linear runs the extension's own kernel on `weight`
    (linear_small_m, linear_panels, int8_linear); from there on F.linear or oneDNN. The fused
    decoder layers (fused_layers.py) take the same choice from here."""
    if isinstance(weight, Int8Weight):
        return int8_small_rows()
    if isinstance(weight, PackedWeight):
        # In oneDNN's panels (float32; bfloat16 on AVX512-BF16 without AMX) linear_panels reads
        # them for a few rows (bfloat16: up to BF16_PANEL_ROWS, a decode step of many or a short
        # prompt). Otherwise (a layout it does not read) oneDNN at every row count: the plain weight
        # that linear_small_m reads is not kept (packed_linear.py). In bfloat16 it sums in oneDNN's
        # order for many rows (Panels.k_block), so a row's result is the same to the bit in a decode
        # as in a prefill, and a prompt answered from the prefix cache gets the greedy tokens it got
        # computed whole.
        if weight.panels is None:
            return 0
        return (BF16_PANEL_ROWS if weight.dtype == torch.bfloat16 else PANEL_ROWS) + 1
    return SMALL_M + 1


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
