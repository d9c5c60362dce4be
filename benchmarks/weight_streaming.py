"""The floor of a decode step at concurrency 1: the time to read its weights once.

A decode step of one sequence must stream every weight it multiplies by from memory, so no
engine's step can be shorter on this machine. Measured as the bytes such a step reads, as served
(every tensor in the served dtype; with int8, the linear weights at one byte each plus a float32
scale per output channel), over the memory bandwidth this process's threads reach summing a
buffer far larger than the caches. An untied input embedding is left out: a step reads one row
of it (an 8B model's is 1.2 GB of bfloat16); a tied one is the LM head, read whole.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

_BANDWIDTH_BUFFER_BYTES = 1 << 30
_LM_HEAD = "lm_head.weight"


def decode_step_bytes(model_dir: str, dtype: torch.dtype, int8: bool = False) -> int:
    """The weight bytes a decode step of one sequence reads, from the checkpoint's headers."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[name] = f.get_slice(name).get_shape()
    tied = _LM_HEAD not in shapes
    total = 0
    for name, shape in shapes.items():
        if "embed_tokens" in name and not tied:
            continue
        numel = 1
        for size in shape:
            numel *= size
        if int8 and len(shape) == 2:
            total += numel + 4 * shape[0]
        else:
            total += numel * dtype.itemsize
    return total


def memory_bandwidth() -> float:
    """Bytes per second read by this process's threads: median of 5 timed sums of 1 GiB."""
    buffer = torch.ones(_BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return _BANDWIDTH_BUFFER_BYTES / statistics.median(times[1:])


def weight_streaming_seconds(
    model_dir: str, dtype: torch.dtype = torch.float32, int8: bool = False
) -> float:
    """The time to read a decode step's weights once, in `dtype` (or int8) on this machine."""
    return decode_step_bytes(model_dir, dtype, int8) / memory_bandwidth()
