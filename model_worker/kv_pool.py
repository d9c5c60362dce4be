"""TokenToKVPool: the K and V of every cached token, addressed by KV slot.

The scheduler's allocator decides which slots a request owns; this pool only holds the tensors.
Slot 0 is padding: it is never handed out, so its contents are never attended to.
The buffers are allocated, not written (torch.empty): on the CPU a page of them takes memory only
once a token's K or V is first written there, so a pool sized for the worst case costs what is
used. Only slot 0 is zeroed, so that a padded row reads finite numbers.
"""

from __future__ import annotations

import torch


class TokenToKVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_slots, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in (*self.k_buffers, *self.v_buffers):
            buffer[0].zero_()

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [len(loc), kv_heads, head_dim] to slots `loc` of layer `layer_id`."""
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]
