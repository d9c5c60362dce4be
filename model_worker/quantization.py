"""`--quantization int8`: int8 weights, activations quantized per token at run time (w8a8 int8,
as SGLang's and vLLM's `w8a8_int8`), through fbgemm's int8 GEMM in torch.

Weights are quantized once after loading, symmetrically per output channel. fbgemm's dynamic
linear quantizes its input with one scale for the whole tensor, from the tensor's min and max.
Each row is divided by its own max |x| (its scale multiplied back into the output), and a guard
row holding +1 and -1 pins the tensor's range to [-1, 1]: every token is then quantized on its
own range alone, and its result does not depend on what else is in the batch.
"""

from __future__ import annotations

import warnings

import torch

QUANTIZATION_METHODS = ("int8",)


class Int8Weight:
    """A linear layer's weight [N, K], int8 per output channel, packed for fbgemm."""

    def __init__(self, weight: torch.Tensor):
        if weight.device.type != "cpu":
            raise ValueError("--quantization int8 runs on the CPU only (fbgemm)")
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks quantized tensors as deprecated
            q = torch.quantize_per_channel(weight, scale.double(), zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.shape = tuple(weight.shape)
        self.nbytes = weight.numel() + 4 * weight.shape[0]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 -> x W^T + bias [M, N]."""
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
        rows = torch.empty(x.shape[0] + 1, x.shape[1], dtype=torch.float32)
        torch.div(x, row_scale, out=rows[1:])
        rows[0].zero_()
        rows[0, 0], rows[0, 1] = 1.0, -1.0
        # reduce_range: 7-bit activations, so that AVX2's u8 x s8 pair sums cannot saturate.
        # (Full 8 bits measured: more accurate on SmolLM2's activations, but up to 3x the error
        # on Gaussian ones, where the saturation shows; see benchmarks/RESULTS.md.)
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, True)[1:]
        y.mul_(row_scale)
        return y if bias is None else y.add_(bias)


def check_quantization(method: str | None, device: torch.device) -> None:
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        known = ", ".join(QUANTIZATION_METHODS)
        raise ValueError(f"unknown quantization {method!r}; known: {known}")
    if device.type != "cpu":
        raise ValueError("--quantization int8 runs on the CPU only (fbgemm)")
