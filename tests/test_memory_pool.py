"""The KV slot allocator (scheduler/memory_pool.py): slots freed before go out again before any
never used, so a long-running server touches the KV pool's pages only as far as its peak use."""

from __future__ import annotations

import random

import torch

from radixserve.scheduler.memory_pool import TokenSlotAllocator


def test_freed_slots_go_out_before_unused_ones() -> None:
    allocator = TokenSlotAllocator(100)
    first = allocator.alloc(10)
    assert first is not None and first.tolist() == list(range(1, 11))
    allocator.free(first[2:6])
    second = allocator.alloc(6)  # the four freed, then two never used
    assert second is not None and second.tolist() == [3, 4, 5, 6, 11, 12]
    assert allocator.num_free == 100 - 12
    allocator.free(second[3:4])
    allocator.free(first[:1])
    assert allocator.alloc(2).tolist() == [1, 6]  # in order: prompts' slots come in runs
    allocator.free(second[:3])
    assert allocator.alloc(1).tolist() == [3]  # merged now: [3, 4, 5]
    allocator.free(first[9:10])  # slot 10: not merged while merged ones suffice
    assert allocator.alloc(1).tolist() == [4]
    assert allocator.num_free == 100 - 12 + 2
    assert allocator.alloc(2).tolist() == [5, 10]
    assert allocator.alloc(89) is None and allocator.alloc(88) is not None


def test_a_workload_cycling_through_the_pool_stays_within_its_peak_use() -> None:
    """Random requests come and go, at most `peak` slots held at once, in a pool 50 times larger:
    no slot past `peak` is ever handed out, and none twice while held."""
    rng = random.Random(0)
    size, peak = 5_000, 100
    allocator = TokenSlotAllocator(size)
    held: list[torch.Tensor] = []
    for _ in range(2_000):
        in_use = sum(t.numel() for t in held)
        if held and (in_use > peak - 10 or rng.random() < 0.4):
            allocator.free(held.pop(rng.randrange(len(held))))
            continue
        slots = allocator.alloc(rng.randint(1, peak - in_use))
        assert slots is not None
        held.append(slots)
        every = torch.cat(held)
        assert every.numel() == every.unique().numel(), "a slot went out twice"
        assert int(every.max()) <= peak
        assert allocator.num_free == size - every.numel()
    free = allocator.free_slots()
    assert torch.equal(torch.cat([free, *held]).sort().values, torch.arange(1, size + 1))
