"""Linear weights (float32 or bfloat16) kept in oneDNN's blocked layout only, for the matmuls of
every row count (bfloat16 runs on AMX where the CPU has it).

BLAS (MKL's sgemm behind F.linear) re-blocks the weight on every call. oneDNN's matmul on a weight
reordered once at load runs 1.0-1.5x faster for a layer's projections from 8 to 2048 rows here,
and 2x for the 49152-row LM head at 64 rows (benchmarks/bench_linear.py). The plain weight is not
kept: an 8B model's two copies would not fit in 24 GiB.

For one or two rows oneDNN's fixed cost per call outweighs a small layer's matmul: float32 ran
~2x faster there in the extension's linear_small_m on a plain copy. oneDNN lays float32 out in
panels of output channels ([N / block][K padded][block]; a Xeon with AMX kept K of 71 and 96
as [K][N], which linear_panels does not read), and bfloat16 on AVX512-BF16 in panels of k pairs
([N / block][K padded / 2][block][2], the operand of vdpbf16ps); where it did that, `panels`
says so and the extension's linear_panels reads the same copy for a few rows
(fused_ops.PANEL_ROWS), and in bfloat16 for up to fused_ops.BF16_PANEL_ROWS (a decode step of
many sequences), where it ran faster than oneDNN on the same copy. Not bfloat16 on AMX, where
oneDNN's tiles sum otherwise (_panels_kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixserve.model_worker.cpu_features import has_amx_bf16, has_avx512_bf16
from radixserve.model_worker.cpu_kernels import cpu_kernels_loaded


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


# The row count oneDNN picks its layout for; measured the same from 64 to 2048 rows.
_PACK_ROWS_HINT = 64


# Output channels per panel that linear_panels reads (the widths its kernel is compiled for).
_PANEL_BLOCKS = (64, 32, 16)
# Blocks of k that oneDNN's bfloat16 matmul sums products in, each from zero and then added to the
# total, tried in this order: on the EPYC here (avx512_core_bf16) 512 for K up to 1024 and 1024
# above, for 8 rows and more; 0 is all K in one block.
_K_BLOCKS = (512, 1024, 256, 2048, 0)
_PROBE_OUTPUTS = 1 << 16  # compared by onednn_sum_blocks: a wrong block shows in ~1 in 10^4
_PROBE_ROWS = (8, 64)  # oneDNN sums 8 rows and more in one order (7 at the least)


@dataclass(frozen=True)
class Panels:
    """A weight [N, K] laid out as N / block panels of [k_pad / group][block][group], back to
    back: `group` consecutive k of one output channel side by side (1 in float32, 2 in
    bfloat16: one 32-bit lane). linear_panels sums bfloat16 products over blocks of `k_block`
    k (0: all K in one), as oneDNN does for many rows (`onednn_sum_blocks`)."""

    block: int
    k_pad: int
    group: int = 1
    k_block: int = 0


class PackedWeight:
    """A linear layer's weight [N, K], reordered for oneDNN; the plain tensor is not kept."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        panels = find_panels(weight, self.packed) if _panels_kernel(weight.dtype) else None
        if panels is not None and weight.dtype == torch.bfloat16:
            k_block = onednn_sum_blocks(self.packed, panels)
            panels = None if k_block is None else replace(panels, k_block=k_block)
        self.panels = panels

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


def _panels_kernel(dtype: torch.dtype) -> bool:
    """Whether linear_panels computes this dtype on this CPU (bfloat16: with vdpbf16ps). Not
    bfloat16 on AMX: oneDNN multiplies it in AMX tiles there (every call looked at, 4 to 512
    rows, on a Xeon, 2026-11-27), whose sums vdpbf16ps does not reproduce, so a row's result would
    depend on its batch (the probe below passed on a 192 x 96 weight, by chance: rows of 24 to
    512 then differed)."""
    if dtype == torch.bfloat16:
        return has_avx512_bf16() and not has_amx_bf16()
    return dtype == torch.float32


def find_panels(weight: torch.Tensor, packed: torch.Tensor) -> Panels | None:
    """The panels `packed` holds `weight` [N, K] in, if it does (oneDNN's choice depends on the
    CPU, the shape and the dtype): checked against the weight's every value bit for bit, and the
    padding past K as zeros (the extension's panels_hold, at memory speed), so linear_panels
    reads only a layout proven to be this one. None where the extension, which reads them, is not
    loaded (kernel_selection loads it before a model is built)."""
    if not cpu_kernels_loaded():
        return None
    n, _ = weight.shape
    size = weight.element_size()
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    k_pad, rest = divmod(nbytes // size, n)
    if nbytes % size or rest:
        return None
    weight = weight.contiguous()
    for block in _PANEL_BLOCKS:
        if torch.ops.radixserve.panels_hold(packed, weight, block, k_pad):
            return Panels(block, k_pad, 4 // size)
    return None


def onednn_sum_blocks(packed: torch.Tensor, panels: Panels) -> int | None:
    """The blocks of k (Panels.k_block) in which oneDNN sums a bfloat16 weight's products for
    many rows, found by running both on the same random rows: the one block size whose 4-row
    linear_panels results equal oneDNN's to the bit, so that a row's result does not depend on
    which kernel its batch ran (a prompt answered from the prefix cache gets the greedy tokens it
    got computed whole); None if none does, and oneDNN keeps every row count. The order is that
    of oneDNN's kernel for the shape (and the threads), not of the values: found once a shape."""
    n, k = packed.shape
    key = (n, k, packed.dtype, panels, torch.get_num_threads())
    if key not in _SUM_BLOCKS:
        _SUM_BLOCKS[key] = _probe_sum_blocks(packed, panels)
    return _SUM_BLOCKS[key]


_SUM_BLOCKS: dict[tuple[int, int, torch.dtype, Panels, int], int | None] = {}


def _probe_sum_blocks(packed: torch.Tensor, panels: Panels) -> int | None:
    n, k = packed.shape
    low, high = _PROBE_ROWS
    rows = max(low, min(high, -(-_PROBE_OUTPUTS // n)))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
    many = onednn_linear(x, packed, None)
    linear_panels = torch.ops.radixserve.linear_panels.default
    for k_block in _K_BLOCKS:
        if k_block >= panels.k_pad:
            continue  # the same as 0, tried last
        got = torch.cat(
            [
                linear_panels(x[i : i + 4], packed, n, panels.k_pad, panels.block, k_block, None)
                for i in range(0, rows, 4)
            ]
        )
        if torch.equal(got, many):
            return k_block
    return None
