"""ModelWorkerBatch <-> bytes: how rank 0 sends each step's batch to the other TP ranks.

msgpack (msgspec) holding each tensor's dtype, shape and raw bytes; never pickle. The padded
[batch, max(seq_lens)] kv_slots table travels as each sequence's slots back to back, in int32,
and the receiver pads it again: the padding is most of the table when lengths differ.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

import msgspec
import numpy as np
import torch

from radixserve.model_worker.batch import (
    LogitBias,
    ModelWorkerBatch,
    PenaltyTokens,
    SamplingBatchInfo,
)

_DTYPES = {"int64", "int32", "float32", "bool"}  # what the batch's tensors hold
# A field holding one of these dataclasses travels as the list of its own fields.
_NESTED: dict[str, Any] = {
    "sampling": SamplingBatchInfo,
    "penalty_tokens": PenaltyTokens,
    "logit_bias": LogitBias,
}


class TensorBytes(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: ModelWorkerBatch) -> bytes:
    seq_lens = batch.seq_lens
    within = torch.arange(batch.kv_slots.shape[1])[None, :] < seq_lens[:, None]
    packed = replace(batch, kv_slots=batch.kv_slots[within].to(torch.int32))
    return _encoder.encode(_to_wire(packed))


def decode_batch(data: bytes) -> ModelWorkerBatch:
    """The batch rank 0 sent; ValueError if its shapes and lengths disagree (what the kernels
    would read out of bounds), checked in O(batch)."""
    packed = _from_wire(ModelWorkerBatch, msgspec.msgpack.decode(data, type=list[Any]))
    _check_lengths(packed)
    seq_lens = packed.seq_lens
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    within = torch.arange(max_len)[None, :] < seq_lens[:, None]
    kv_slots = torch.zeros(len(seq_lens), max_len, dtype=torch.int64)
    kv_slots[within] = packed.kv_slots.to(torch.int64)
    return replace(packed, kv_slots=kv_slots)


def _check_lengths(packed: ModelWorkerBatch) -> None:
    tokens, batch = packed.input_ids, packed.extend_lens
    per_token = (packed.input_ids, packed.positions, packed.out_cache_loc)
    per_sequence = [packed.prefix_lens, packed.extend_lens]
    per_sequence += [t for t in _tensors(packed.sampling) if t.dim() == 1]
    rules = [
        (all(t.dim() == 1 and len(t) == len(tokens) for t in per_token), "one entry per token"),
        (all(t.dim() == 1 and len(t) == len(batch) for t in per_sequence), "one per sequence"),
        (bool((packed.prefix_lens >= 0).all() and (batch >= 0).all()), "lengths >= 0"),
        (int(batch.sum()) == len(tokens), "the extend lengths sum to the tokens"),
        (packed.kv_slots.numel() == int(packed.seq_lens.sum()), "a slot per token of each"),
    ]
    for ok, rule in rules:
        if not ok:
            raise ValueError(f"a broadcast batch breaks its shape rules: {rule}")


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [v for f in fields(obj) if isinstance(v := getattr(obj, f.name), torch.Tensor)]


def _to_wire(obj: Any) -> list[Any]:
    values: list[Any] = []
    for field in fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, torch.Tensor):
            value = TensorBytes(
                str(value.dtype).removeprefix("torch."),
                list(value.shape),
                value.contiguous().numpy().tobytes(),
            )
        elif is_dataclass(value):
            value = _to_wire(value)
        values.append(value)  # else a bool, or None
    return values


def _from_wire(cls: Any, values: list[Any]) -> Any:
    kwargs = {}
    for field, value in zip(fields(cls), values, strict=True):
        if isinstance(value, dict):
            value = _tensor(msgspec.convert(value, TensorBytes))
        elif isinstance(value, list):
            value = _from_wire(_NESTED[field.name], value)
        kwargs[field.name] = value
    return cls(**kwargs)


def _tensor(t: TensorBytes) -> torch.Tensor:
    if t.dtype not in _DTYPES:
        raise ValueError(f"unexpected dtype {t.dtype!r} in a broadcast batch")
    array = np.frombuffer(bytearray(t.data), dtype=np.dtype(t.dtype))
    return torch.from_numpy(array).reshape(t.shape)
