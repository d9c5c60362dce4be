"""`--quantization`: the methods, and what each needs of the device, the dtype and the CPU
extension, checked before a model is built (int8's weights: int8_weight.py)."""

from __future__ import annotations

import torch

from radixserve.model_worker.cpu_kernels import KernelBuildError, load_cpu_kernels

QUANTIZATION_METHODS = ("int8",)


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
