"""What the CPU can do, from the flags /proc/cpuinfo reports: kernels and dtypes are picked at
run time from these, never from a guess (the same install meets AVX2 and AMX machines)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def has_native_bf16() -> bool:
    """bfloat16 arithmetic in hardware (AVX512-BF16 or AMX): without it a bf16 matmul is
    emulated, several times slower than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_int8_dot_products() -> bool:
    """VNNI or AMX: int8 products summed in int32 without the saturating 16-bit pair sums of
    plain AVX2."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def has_avx512_vnni() -> bool:
    """512-bit vpdpbusd (with AVX512-BW's byte ops): what int8_vnni.cpp's kernel runs on."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


def has_amx_int8() -> bool:
    """AMX's int8 tile multiplies, which oneDNN's int8 matmul runs on."""
    return "amx_int8" in cpu_flags()


def has_amx_bf16() -> bool:
    """AMX's bfloat16 tile multiplies, which oneDNN's bfloat16 matmul runs on."""
    return "amx_bf16" in cpu_flags()


def has_avx512_bf16() -> bool:
    """vdpbf16ps, the bfloat16 pair dot product the extension's linear_panels runs on (its
    build for this CPU has it exactly when the CPU reports it: -march=native)."""
    return "avx512_bf16" in cpu_flags()
