"""An int8 linear weight, as `--quantization int8` keeps it: int8 weights, activations quantized
per token at run time (w8a8 int8, as SGLang's and vLLM's `w8a8_int8`), with exact int32 dot
products.

Weights are quantized as they are loaded, a layer at a time, symmetrically per output channel;
each token's activations symmetrically on its own max |x|, with 8 bits, so a token's result does
not depend on what else is in the batch. The CPU extension quantizes the activations and
rescales the products. On CPUs with AVX512-VNNI (and no AMX) the weight is kept in blocks laid
out for vpdpbusd as its rows are quantized (`int8_vnni.cpp`), and one kernel of ours takes every
row count, quantizing the activations and rescaling in the same call. Elsewhere it stays as
plain rows [N, K], for the extension's `int8_linear` (each weight byte read once per block of 8
rows), or, for more rows on CPUs with AVX-VNNI or AMX, its `int8_gemm`: oneDNN's int8 matmul
(`torch._int_mm`) on a block of outputs at a time, rescaled while its products are in cache.
Without VNNI oneDNN's u8 x s8 pair sums saturate (measured: inexact on random int8 data), so there
the extension's kernel takes every batch size. All round the same way: the path does not change
a result.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from radixserve.model_worker.cpu_features import (
    has_amx_int8,
    has_avx512_vnni,
    has_int8_dot_products,
)
from radixserve.model_worker.cpu_kernels import require_cpu_kernels

# Rows from which oneDNN's int8 matmul beats int8_linear here (see benchmarks/RESULTS.md).
INT8_GEMM_MIN_ROWS = 9
_QUANTIZE_ROWS = 1024
_VNNI_BLOCK = 64  # output channels per block of int8_vnni.cpp's layout


def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's int8 matmul sums without saturating: on CPUs with VNNI or AMX."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return False  # oneDNN may be held below what the CPU has
    return has_int8_dot_products()


def int8_small_rows() -> int:
    """Rows below which int8_linear runs; oneDNN's int8 matmul from there on, where it is exact."""
    return INT8_GEMM_MIN_ROWS if onednn_int8_is_exact() else sys.maxsize


def vnni_kernel_available() -> bool:
    """Whether int8_vnni.cpp's kernel runs here: the CPU has AVX512-VNNI and the extension was
    built with it (it is built for the CPU it runs on). Asks the extension, which must be loaded
    (KernelBuildError if not)."""
    require_cpu_kernels("int8_vnni")
    return has_avx512_vnni() and bool(torch.ops.radixserve.int8_vnni_available())


def vnni_layout_available() -> bool:
    """Whether int8 weights are kept in int8_vnni.cpp's layout, for its kernel: where it runs,
    but on CPUs with AMX, which keep the plain layout: there oneDNN's int8 matmul runs on AMX
    tiles, whose peak is several times VNNI's (not measured: the kernel was tuned on a Zen 4)."""
    return vnni_kernel_available() and not has_amx_int8()


def _vnni_shape(rows: int, cols: int) -> tuple[int, int, int, int]:
    """int8_vnni.cpp's layout: blocks of 64 output channels by groups of 4 k, both padded."""
    return (-(-rows // _VNNI_BLOCK), -(-cols // 4), _VNNI_BLOCK, 4)


def int8_weight_nbytes(rows: int, cols: int) -> int:
    """What an int8 weight [rows, cols] takes in memory, in the layout this CPU gets."""
    values = math.prod(_vnni_shape(rows, cols)) if vnni_layout_available() else rows * cols
    return values + rows * torch.float32.itemsize  # one scale per output channel


class Int8Weight:
    """A linear layer's weight [N, K]: int8, one scale per output channel, in one copy: in
    int8_vnni.cpp's layout (`vnni`, uint8 [N / 64, K / 4, 64, 4], rounded up) where
    vnni_layout_available (AVX512-VNNI, no AMX), else plain rows [N, K]."""

    def __init__(self, weight: torch.Tensor, vnni: bool | None = None):
        self._allocate(weight.shape[0], weight.shape[1], weight.device, vnni)
        self.quantize_rows(0, weight)

    @classmethod
    def empty(
        cls, rows: int, cols: int, device: torch.device, vnni: bool | None = None
    ) -> Int8Weight:
        """To be filled by quantize_rows, as the loader reads the rows. `vnni`: the layout,
        by default the one this CPU's kernels read."""
        weight = cls.__new__(cls)
        weight._allocate(rows, cols, device, vnni)
        return weight

    @classmethod
    def from_int8(
        cls, q: torch.Tensor, scale: torch.Tensor, vnni: bool | None = None
    ) -> Int8Weight:
        """A weight quantized already: int8 values [N, K] (any, -128 included) and their scales."""
        weight = cls.empty(q.shape[0], q.shape[1], q.device, vnni)
        weight._write_rows(0, q.to(torch.int8))
        weight.scale.copy_(scale)
        return weight

    def _allocate(self, rows: int, cols: int, device: torch.device, vnni: bool | None) -> None:
        if device.type != "cpu":
            raise ValueError("--quantization int8 runs on the CPU only")
        require_cpu_kernels("an int8 weight")  # its ops quantize, multiply and rescale
        self.vnni = vnni_layout_available() if vnni is None else vnni
        if self.vnni:
            self.q = torch.empty(_vnni_shape(rows, cols), dtype=torch.uint8)
            # Channels past N (in the last block) are computed and never stored: weights of 0,
            # so that one layout of a weight has one content.
            self.q[-1:].fill_(128)
        else:
            self.q = torch.empty(rows, cols, dtype=torch.int8)
        self.scale = torch.empty(rows, dtype=torch.float32)
        self.shape = (rows, cols)
        self.nbytes = self.q.numel() + 4 * self.scale.numel()

    def _write_rows(self, start: int, q: torch.Tensor) -> None:
        if self.vnni:
            torch.ops.radixserve.int8_vnni_pack(self.q, start, q)
        else:
            self.q[start : start + q.shape[0]] = q

    def int8_rows(self) -> torch.Tensor:
        """The int8 values as plain rows [N, K] (a copy where the layout is VNNI's)."""
        if not self.vnni:
            return self.q
        rows, cols = self.shape
        plain = self.q.permute(0, 2, 1, 3).reshape(-1, self.q.shape[1] * 4)[:rows, :cols]
        return plain.view(torch.int8) ^ -128  # the layout keeps w + 128

    def quantize_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows start.. from float values, each on its own max |w|, as a token's activations are
        (the extension's quantize_rows_int8: one pass, no float32 temporaries)."""
        # A block of rows at a time: what the extension returns stays small beside an 8B model.
        for begin in range(0, rows.shape[0], _QUANTIZE_ROWS):
            block = rows[begin : begin + _QUANTIZE_ROWS].detach()
            if block.dtype not in (torch.float32, torch.bfloat16):
                block = block.float()
            q, scale = torch.ops.radixserve.quantize_rows_int8(block.contiguous())
            at = start + begin
            self._write_rows(at, q)
            self.scale[at : at + block.shape[0]] = scale

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds in memory."""
        return (self.q, self.scale)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> x W^T + bias [M, N], in x's dtype (float32 or bfloat16)."""
        ops = torch.ops.radixserve
        if self.vnni:
            return ops.int8_vnni_linear(x, self.q, self.scale, bias)
        if x.shape[0] < int8_small_rows():
            return ops.int8_linear(x, self.q, self.scale, bias)
        return ops.int8_gemm(x, self.q, self.scale, bias)
