"""`--quantization int8`: int8 weights, activations quantized per token at run time (w8a8 int8,
as SGLang's and vLLM's `w8a8_int8`), with exact int32 dot products.

Weights are quantized as they are loaded, a layer at a time, symmetrically per output channel;
each token's activations symmetrically on its own max |x|, with 8 bits, so a token's result does
not depend on what else is in the batch. The CPU extension quantizes the activations and
rescales the products. The products run in its `int8_linear` (each weight byte read once per
block of 8 rows), or, for more rows on CPUs with VNNI or AMX, in its `int8_gemm`: oneDNN's int8
matmul (`torch._int_mm`) on a block of outputs at a time, rescaled while its products are in
cache.
Without VNNI oneDNN's u8 x s8 pair sums saturate (measured: inexact on random int8 data), so there
the extension's kernel takes every batch size. Both round the same way: the path does not change
a result.
"""

from __future__ import annotations

import os
import sys

import torch

from radixserve.model_worker.cpu_features import has_int8_dot_products
from radixserve.model_worker.cpu_kernels import KernelBuildError, load_cpu_kernels

QUANTIZATION_METHODS = ("int8",)

# Rows from which oneDNN's int8 matmul beats int8_linear here (see benchmarks/RESULTS.md).
INT8_GEMM_MIN_ROWS = 9
_QUANTIZE_ROWS = 1024


def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's int8 matmul sums without saturating: on CPUs with VNNI or AMX."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return False  # oneDNN may be held below what the CPU has
    return has_int8_dot_products()


def int8_small_rows() -> int:
    """Rows below which int8_linear runs; oneDNN's int8 matmul from there on, where it is exact."""
    return INT8_GEMM_MIN_ROWS if onednn_int8_is_exact() else sys.maxsize


class Int8Weight:
    """A linear layer's weight [N, K]: int8, one scale per output channel."""

    def __init__(self, weight: torch.Tensor):
        self._allocate(weight.shape[0], weight.shape[1], weight.device)
        self.quantize_rows(0, weight)

    @classmethod
    def empty(cls, rows: int, cols: int, device: torch.device) -> Int8Weight:
        """To be filled by quantize_rows, as the loader reads the rows."""
        weight = cls.__new__(cls)
        weight._allocate(rows, cols, device)
        return weight

    def _allocate(self, rows: int, cols: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError("--quantization int8 runs on the CPU only")
        load_cpu_kernels()  # its ops quantize, multiply and rescale
        self.q = torch.empty(rows, cols, dtype=torch.int8)
        self.scale = torch.empty(rows, dtype=torch.float32)
        self.shape = (rows, cols)
        self.nbytes = self.q.numel() + 4 * self.scale.numel()

    def quantize_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows start.. from float values, each on its own max |w| (the extension's
        quantize_weight_rows: one pass, no float32 temporaries)."""
        # A block of rows at a time: what the extension returns stays small beside an 8B model.
        for begin in range(0, rows.shape[0], _QUANTIZE_ROWS):
            block = rows[begin : begin + _QUANTIZE_ROWS].detach()
            if block.dtype not in (torch.float32, torch.bfloat16):
                block = block.float()
            q, scale = torch.ops.radixserve.quantize_weight_rows(block.contiguous())
            at = start + begin
            self.q[at : at + block.shape[0]] = q
            self.scale[at : at + block.shape[0]] = scale

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds in memory."""
        return (self.q, self.scale)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> x W^T + bias [M, N], in x's dtype (float32 or bfloat16)."""
        ops = torch.ops.radixserve
        if x.shape[0] < int8_small_rows():
            return ops.int8_linear(x, self.q, self.scale, bias)
        return ops.int8_gemm(x, self.q, self.scale, bias)


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        known = ", ".join(QUANTIZATION_METHODS)
        raise ValueError(f"unknown quantization {method!r}; known: {known}")
    if device.type != "cpu":
        raise ValueError("--quantization int8 runs on the CPU only")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"--quantization int8 runs with --dtype float32 or bfloat16, not {dtype}")
    try:
        load_cpu_kernels()
    except KernelBuildError as e:
        raise ValueError(f"--quantization int8 needs the CPU extension, which failed: {e}") from e
