"""Linear weights (float32 or bfloat16) kept in oneDNN's blocked layout as well, for matmuls of
many rows (bfloat16 runs on AMX where the CPU has it).

BLAS (MKL's sgemm behind F.linear) re-blocks the weight on every call. oneDNN's matmul on a weight
reordered once at load runs 1.0-1.5x faster for a layer's projections from 8 to 2048 rows here,
and 2x for the 49152-row LM head at 64 rows (benchmarks/bench_linear.py). One or two rows stay
with the extension's linear_small_m on the plain weight, which reads it at memory speed: so both
copies are kept, and the weights take twice their size in memory.
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
    """A linear layer's weight [N, K], plain (`dense`) and reordered for oneDNN."""

    def __init__(self, weight: torch.Tensor):
        self.dense = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense, _PACK_ROWS_HINT)
        self.shape = tuple(weight.shape)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> x W^T + bias [M, N], in the weight's dtype."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
