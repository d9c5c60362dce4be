"""Scheduler-side KV bookkeeping: which request rows and which KV slots are in use.

The KV tensors themselves live in the model worker (model_worker/kv_pool.py); here we only hand
out indices. Slot 0 is never handed out: padding in kv_slots points at it.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Row r holds the KV slot of every token of the request that owns row r, in order, and
    zeros past them: gathered rows come padded with slot 0, which no request owns."""

    def __init__(self, num_rows: int, max_context_len: int):
        self.req_to_token = torch.zeros((num_rows, max_context_len), dtype=torch.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        return self._free_rows.pop()

    def free(self, row: int, num_written: int) -> None:
        """Give back `row`, whose first `num_written` entries were set."""
        self.req_to_token[row, :num_written] = 0
        self._free_rows.append(row)


class TokenSlotAllocator:
    """Free list of KV slots 1..size. Frees are batched and merged lazily on the next alloc."""

    def __init__(self, size: int):
        self.size = size
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    @property
    def num_free(self) -> int:
        return self._free.numel() + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when fewer are free: the caller decides what to give up."""
        if n > self.num_free:
            return None
        if n > self._free.numel():
            self._merge()
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots)
            self._num_released += slots.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot (for invariant checks)."""
        self._merge()
        return self._free

    def _merge(self) -> None:
        if self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released.clear()
            self._num_released = 0
