"""Which kernels run the forward: `--kernels` picks them for the whole model (attention, linear
layers, norms, RoPE, SwiGLU, argmax).

- `torch_native`: eager torch everywhere (SDPA over K/V gathered from the pool); any device and
  dtype; the reference the others are tested against.
- `cpu_extension`: the CPU extension (float32 on the CPU, and bfloat16 where the CPU has it in
  hardware): paged attention that reads the pool in place, fused RMSNorm/RoPE/SwiGLU, and a
  memory-speed linear for a few rows.
- `auto`: `cpu_extension` where it applies and the extension builds (a failed build is logged, and
  the server goes on with `torch_native`), else `torch_native`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model_worker.attention import (
    GPU_KV_LEN_BUCKET,
    AttentionBackend,
    TorchNativeBackend,
)
from radixserve.model_worker.cpu_attention import CpuAttnBackend
from radixserve.model_worker.cpu_features import has_native_bf16
from radixserve.model_worker.cpu_kernels import cpu_kernels_available, load_cpu_kernels
from radixserve.model_worker.fused_ops import CpuKernelOps, TorchOps

KERNEL_CHOICES = ("auto", "torch_native", "cpu_extension")


@dataclass(frozen=True, slots=True)
class Kernels:
    name: str
    attn_backend: AttentionBackend
    ops: TorchOps


def select_kernels(
    name: str, num_heads: int, num_kv_heads: int, device: torch.device, dtype: torch.dtype
) -> Kernels:
    if name not in KERNEL_CHOICES:
        known = ", ".join(KERNEL_CHOICES)
        raise ValueError(f"unknown kernels {name!r}; known: {known}")
    why_not = _why_not_cpu_extension(device, dtype)
    if name == "auto":
        name = "cpu_extension" if why_not is None and cpu_kernels_available() else "torch_native"
    if name == "torch_native":
        bucket = GPU_KV_LEN_BUCKET if device.type == "cuda" else 1
        return Kernels(name, TorchNativeBackend(num_heads, num_kv_heads, bucket), TorchOps())
    if why_not is not None:
        raise ValueError(f"--kernels cpu_extension: {why_not}")
    load_cpu_kernels()  # built here, before the model, if this environment has no build yet
    return Kernels(name, CpuAttnBackend(num_heads, num_kv_heads), CpuKernelOps())


def _why_not_cpu_extension(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"it runs on the CPU, not on {device}"
    if dtype == torch.bfloat16 and not has_native_bf16():
        return "this CPU has no bfloat16 in hardware (AVX512-BF16 or AMX): use float32"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 or bfloat16, not {dtype}"
    return None
