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
    """Free list of KV slots 1..size. Slots freed before are handed out (in order of slot, as far
    as they have been merged) before any never used: the pool's pages are then touched only as far
    as its peak use, where handing out every slot in turn first made a server fault in fresh KV
    pages at every run of requests until it held the whole pool (the default model: 120,000 page
    faults a run of 64 x 128/128 and its RSS ~0.4 GB larger after each). Frees are batched, merged
    by the next alloc that needs them."""

    def __init__(self, size: int):
        self.size = size
        self._unused = torch.arange(1, size + 1, dtype=torch.int64)  # never handed out
        self._reusable = torch.empty(0, dtype=torch.int64)  # freed, merged
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    @property
    def num_free(self) -> int:
        return self._unused.numel() + self._reusable.numel() + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when fewer are free: the caller decides what to give up."""
        if n > self.num_free:
            return None
        if n > self._reusable.numel():
            self._merge()
        reused = min(n, self._reusable.numel())
        slots, self._reusable = self._reusable[:reused], self._reusable[reused:]
        if reused < n:
            fresh, self._unused = self._unused[: n - reused], self._unused[n - reused :]
            slots = torch.cat([slots, fresh]) if reused else fresh
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots)
            self._num_released += slots.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot (for invariant checks: no merge, so that checking changes no order)."""
        return torch.cat([self._reusable, *self._released, self._unused])

    def _merge(self) -> None:
        if self._released:
            # In order, so that a prompt's slots come in runs as they did from the unused ones
            # (attention reads a run of slots faster than scattered ones).
            self._reusable = torch.cat([self._reusable, *self._released]).sort().values
            self._released.clear()
            self._num_released = 0
