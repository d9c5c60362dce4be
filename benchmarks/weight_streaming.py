"""The floor of a decode step at concurrency 1: the time to read its weights once.

A decode step of one sequence must stream every weight it multiplies by from memory, so no
engine's step can be shorter on this machine. Measured as the bytes such a step reads, as served
(every tensor in the served dtype; with int8, the linear weights at one byte each plus a float32
scale per output channel), over the memory bandwidth this process's threads reach reading
buffers far larger than the caches. An untied input embedding is left out: a step reads one row
of it (an 8B model's is 1.2 GB of bfloat16); a tied one is the LM head, read whole.

A read is torch's float32 max over the bytes, whatever their dtype: of the loops measured here
(torch's sum and max, hand-vectorized xor loops of one or four streams, with and without
prefetches) none read faster, and a max does no arithmetic that int8 bytes seen as floats
(denormals, NaN) could slow. This machine's bandwidth varies from one buffer to the next (1 GiB
buffers read at 27-47 GB/s in one session, each steady over its own reads), so the floor takes
the best of a few buffers: the strictest floor the machine shows. An engine's weights may sit on
slower memory than that; `bench_one_row.py` holds a step to a read of the model's own weights.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

_BANDWIDTH_BUFFER_BYTES = 1 << 30
_BANDWIDTH_BUFFERS = 4
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


def read_seconds(tensor: torch.Tensor) -> float:
    """The time to read a contiguous tensor's bytes once in this process's threads (the last
    bytes of a size that is not a multiple of 4 are left: a float32 view cannot hold them)."""
    data = tensor.reshape(-1).view(torch.uint8)
    words = data[: data.numel() // 4 * 4].view(torch.float32)
    start = time.perf_counter()
    if words.numel():
        words.amax()
    return time.perf_counter() - start


def memory_bandwidth() -> float:
    """Bytes per second this process's threads read: the best buffer's median of 5 reads, of a
    few buffers of 1 GiB allocated in turn."""
    best = 0.0
    for _ in range(_BANDWIDTH_BUFFERS):
        buffer = torch.full((_BANDWIDTH_BUFFER_BYTES,), 1, dtype=torch.uint8)
        times = [read_seconds(buffer) for _ in range(6)]
        best = max(best, _BANDWIDTH_BUFFER_BYTES / statistics.median(times[1:]))
        del buffer
    return best


def weight_streaming_seconds(
    model_dir: str, dtype: torch.dtype = torch.float32, int8: bool = False
) -> float:
    """The time to read a decode step's weights once, in `dtype` (or int8) on this machine."""
    return decode_step_bytes(model_dir, dtype, int8) / memory_bandwidth()
