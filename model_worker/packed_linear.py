"""Linear weights (float32 or bfloat16) kept in oneDNN's blocked layout only, for the matmuls of
every row count (bfloat16 runs on AMX where the CPU has it).

BLAS (MKL's sgemm behind F.linear) re-blocks the weight on every call. oneDNN's matmul on a weight
reordered once at load runs 1.0-1.5x faster for a layer's projections from 8 to 2048 rows here,
and 2x for the 49152-row LM head at 64 rows (benchmarks/bench_linear.py). The plain weight is not
kept: an 8B model's two copies would not fit in 24 GiB.

For one or two rows oneDNN's fixed cost per call outweighs a small layer's matmul: float32 ran
~2x faster there in the extension's linear_small_m on a plain copy. oneDNN lays float32 out in
panels of output channels ([N / block][K padded][block]); where it did that, `panels` says so and
the extension's linear_panels reads the same copy for a few rows (fused_ops.PANEL_ROWS).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


# The row count oneDNN picks its layout for; measured the same from 64 to 2048 rows.
_PACK_ROWS_HINT = 64


# Output channels per panel that linear_panels reads (the widths its kernel is compiled for).
_PANEL_BLOCKS = (64, 32, 16)
_CHECK_ELEMENTS = 1 << 22  # compared at a time: the comparison's temporaries stay small


@dataclass(frozen=True)
class Panels:
    """A float32 weight [N, K] laid out as N / block panels of [k_pad][block], back to back."""

    block: int
    k_pad: int


class PackedWeight:
    """A linear layer's weight [N, K], reordered for oneDNN; the plain tensor is not kept."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.panels = find_panels(weight, self.packed) if weight.dtype == torch.float32 else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> x W^T + bias [M, N], in the weight's dtype."""
        return onednn_linear(x, self.packed, bias)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds in memory."""
        return (self.packed,)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> x W^T + bias [M, N] on oneDNN's matmul; `weight` [N, K] reordered by
    PackedWeight, or a plain tensor."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def find_panels(weight: torch.Tensor, packed: torch.Tensor) -> Panels | None:
    """The panels `packed` holds `weight` [N, K] in, if it does (oneDNN's choice depends on the
    CPU and the shape): checked against the weight's every value, so linear_panels reads only a
    layout proven to be this one."""
    n, k = weight.shape
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    if nbytes % weight.element_size():
        return None
    buffer = (ctypes.c_char * nbytes).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    data = torch.frombuffer(buffer, dtype=torch.float32)
    for block in _PANEL_BLOCKS:
        k_pad, rest = divmod(data.numel(), n)
        if n % block or rest or k_pad < k:
            continue
        # panel p, row kk, lane j holds weight[p * block + j, kk]
        panels = data.view(n // block, k_pad, block)[:, :k]
        expected = weight.reshape(n // block, block, k).transpose(1, 2)
        step = max(1, _CHECK_ELEMENTS // (block * k))  # panels compared at a time
        if all(
            torch.equal(panels[p : p + step], expected[p : p + step])
            for p in range(0, n // block, step)
        ):
            return Panels(block, k_pad)
    return None
