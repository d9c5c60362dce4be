"""Linear weights (float32 or bfloat16) kept in oneDNN's blocked layout only, for the matmuls of
every row count (bfloat16 runs on AMX where the CPU has it).

BLAS (MKL's sgemm behind F.linear) re-blocks the weight on every call. oneDNN's matmul on a weight
reordered once at load runs 1.0-1.5x faster for a layer's projections from 8 to 2048 rows here,
and 2x for the 49152-row LM head at 64 rows (benchmarks/bench_linear.py). The plain weight is not
kept: an 8B model's two copies would not fit in 24 GiB. One or two float32 rows ran faster in the
extension's linear_small_m on the plain weight (see fused_ops.PACKED_MIN_ROWS), a loss measured
in benchmarks/RESULTS.md that memory pays for; bfloat16 ran on oneDNN at every row count already.
"""

from __future__ import annotations

import torch


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


# The row count oneDNN picks its layout for; measured the same from 64 to 2048 rows.
_PACK_ROWS_HINT = 64


class PackedWeight:
    """A linear layer's weight [N, K], reordered for oneDNN; the plain tensor is not kept."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> x W^T + bias [M, N], in the weight's dtype."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds in memory."""
        return (self.packed,)
