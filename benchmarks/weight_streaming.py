"""The floor of a decode step at concurrency 1: the time to read every weight byte once.

A decode step of one sequence must stream all the weights from memory, so no engine's step can
be shorter on this machine. Measured by summing each weight tensor of the checkpoint in the
served dtype (float32 unless told; every byte read once, in this process's threads), after one
untimed pass that brings them into memory. With int8 weights the floor is a quarter of float32's
(the bytes are a quarter).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def weight_streaming_seconds(model_dir: str, dtype: torch.dtype = torch.float32) -> float:
    """Median over 5 timed passes of reading every weight once, in `dtype`."""
    weights = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        weights += [t.to(dtype) for t in load_file(file).values() if t.is_floating_point()]
    times = []
    for _ in range(6):
        start = time.perf_counter()
        for t in weights:
            t.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
