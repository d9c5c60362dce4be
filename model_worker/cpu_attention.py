"""The attention of `--kernels cpu_extension`: it reads the paged KV pool in place.

One call per layer of the CPU extension's paged_attention (`csrc/attention.cpp`) writes the new
tokens' K and V to the pool and attends every query row straight from the pool's slots, with an
online softmax over blocks of keys: no gathered copy of any context, no padding to the longest
sequence, decodes and prefill chunks in one call.
"""

from __future__ import annotations

import torch

from radixserve.model_worker.attention import AttentionBackend
from radixserve.model_worker.cpu_kernels import require_cpu_kernels
from radixserve.model_worker.forward_batch import ForwardBatch


class CpuAttnBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int):
        require_cpu_kernels("its paged attention")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self._paged_attention = torch.ops.radixserve.paged_attention.default

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        # The kernel trusts its slot indices: check them once per forward, not once per layer.
        num_slots = fb.kv_pool.num_slots
        for name, slots in (("kv_slots", fb.kv_slots), ("out_cache_loc", fb.out_cache_loc)):
            if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < num_slots):
                raise IndexError(f"{name} outside the KV pool of {num_slots} slots")
        fb.attn_metadata = fb.kv_slots.contiguous()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        kv_slots = fb.attn_metadata
        assert isinstance(kv_slots, torch.Tensor), "init_forward_metadata was not called"
        k_cache, v_cache = fb.kv_pool.get_kv(layer_id)
        scale = q.shape[-1] ** -0.5
        return self._paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            fb.out_cache_loc,
            kv_slots,
            fb.prefix_lens,
            fb.extend_lens,
            scale,
        )
