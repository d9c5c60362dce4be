"""How a linear layer keeps its weight once loaded: as loaded, in oneDNN's layout, or int8.

The model runner picks one format for the whole model before building it; each linear layer
prepares its weight in that format as soon as the loader has filled it (all the pieces of a fused
one), and drops the plain tensor: at most one layer's plain weight exists besides the model, and
none for int8, whose rows are quantized as they are read.
"""

from __future__ import annotations

import enum

import torch

from radixserve.model_worker.int8_weight import Int8Weight, int8_weight_nbytes
from radixserve.model_worker.packed_linear import PackedWeight

# A linear weight in the form its kernels read, other than a plain tensor.
PreparedWeight = Int8Weight | PackedWeight


class WeightFormat(enum.Enum):
    PLAIN = "plain"  # the loaded tensor: F.linear and linear_small_m read it
    ONEDNN = "onednn"  # packed_linear.PackedWeight
    INT8 = "int8"  # int8_weight.Int8Weight

    def start_loading(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | Int8Weight:
        """Where the loader writes a weight's rows: a plain tensor, or for int8 the int8 weight
        itself (each row is quantized on its own, so no plain copy is needed)."""
        if self is WeightFormat.INT8:
            return Int8Weight.empty(rows, cols, device)
        return torch.empty(rows, cols, dtype=dtype, device=device)

    @staticmethod
    def write_rows(loading: torch.Tensor | Int8Weight, start: int, rows: torch.Tensor) -> None:
        if isinstance(loading, Int8Weight):
            loading.quantize_rows(start, rows)
        else:
            loading[start : start + rows.shape[0]].copy_(rows)

    def finish_loading(self, loading: torch.Tensor | Int8Weight) -> torch.Tensor | PreparedWeight:
        """The weight as kept: the plain tensor reordered for oneDNN (and dropped), or as is."""
        if self is WeightFormat.ONEDNN:
            assert isinstance(loading, torch.Tensor)
            return PackedWeight(loading)
        return loading

    def nbytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        """What a [rows, cols] weight loaded in `dtype` takes in memory in this format."""
        if self is WeightFormat.INT8:
            return int8_weight_nbytes(rows, cols)
        return rows * cols * dtype.itemsize


def held_tensors(weight: torch.Tensor | PreparedWeight) -> tuple[torch.Tensor, ...]:
    """The tensors a weight keeps in memory."""
    return (weight,) if isinstance(weight, torch.Tensor) else weight.tensors()


def tensor_address(tensor: torch.Tensor) -> int:
    """Where a tensor's data starts: one address per copy in memory (oneDNN's opaque tensors
    have no storage to ask)."""
    if tensor.is_mkldnn:
        return int(torch.ops.mkldnn.data_ptr(tensor))
    return tensor.untyped_storage().data_ptr()
